"""Checkpoints on a real S3 server on loopback (moto in server mode): streaming multipart
writes, the commit without rename, stock interop, retries, permanent errors and a server that
stops mid-upload."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import _s3_server
import pytest
import torch
import torch.distributed.checkpoint as dcp
from _s3_server import Fault, S3Env
from torch.distributed.checkpoint.api import CheckpointException

from dcp_datastates import CheckpointNotCommittedError, DataStatesReader, DataStatesWriter
from dcp_datastates.format import METADATA_NAME

moto_server, s3, s3_proxy = _s3_server.moto_server, _s3_server.s3, _s3_server.s3_proxy

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

MiB = 1 << 20
PART = 5 * MiB


def _state(seed: int = 0, mib: int = 12) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(mib * MiB // 4, generator=g),
        "small": torch.arange(7, dtype=torch.int64) + seed,
        "extra": {"step": seed, "name": "run"},
    }


def _empty_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        "big": torch.zeros_like(sd["big"]),
        "small": torch.zeros_like(sd["small"]),
        "extra": {"step": -1, "name": ""},
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert torch.equal(a["big"], b["big"])
    assert torch.equal(a["small"], b["small"])
    assert a["extra"] == b["extra"]


def _save(env: S3Env, url: str, sd: dict[str, Any], **options: Any) -> DataStatesWriter:
    writer = DataStatesWriter(
        url, storage_options=env.options(part_bytes=PART), flush_workers=2, **options
    )
    try:
        dcp.save(sd, storage_writer=writer)
    finally:
        writer.close()
    return writer


def _load(env: S3Env, url: str, like: dict[str, Any]) -> dict[str, Any]:
    out = _empty_like(like)
    dcp.load(out, storage_reader=DataStatesReader(url, storage_options=env.options()))
    return out


def test_checkpoint_round_trips_and_stock_fsspec_reader_loads_it(s3: S3Env) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    sd = _state()
    _save(s3, s3.url("step-1"), sd)
    assert METADATA_NAME in [k.rsplit("/", 1)[-1] for k in s3.list_keys("step-1/")]
    _assert_same(_load(s3, s3.url("step-1"), sd), sd)
    stock = _empty_like(sd)
    dcp.load(stock, storage_reader=FsspecReader(s3.url("step-1"), endpoint_url=s3.endpoint))
    _assert_same(stock, sd)
    assert s3.open_uploads() == []


def test_spread_prefixes_put_each_ranks_objects_under_a_hashed_prefix_stock_reads(
    s3: S3Env,
) -> None:
    """With ``spread_prefixes`` the data objects sit under sub-prefixes (for stores that
    throttle per prefix); ``.metadata`` names them, so stock ``FsspecReader`` loads the
    checkpoint as ours does."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    from dcp_datastates.storage.s3 import S3Storage

    sd = _state(seed=5, mib=2)
    writer = DataStatesWriter(
        s3.url("spread"), storage_options=s3.options(part_bytes=PART, spread_prefixes=16)
    )
    try:
        dcp.save(sd, storage_writer=writer)
    finally:
        writer.close()
    data = [k for k in s3.list_keys("spread/") if k.endswith(".distcp")]
    hashed = S3Storage(s3.url("x"), s3.options(spread_prefixes=16)).data_dir(0)
    assert data and all(k.split("/")[-2] == hashed.rstrip("/") for k in data), data
    assert len(hashed) == 2  # one hex digit and the slash for 16 prefixes
    _assert_same(_load(s3, s3.url("spread"), sd), sd)
    stock = _empty_like(sd)
    dcp.load(stock, storage_reader=FsspecReader(s3.url("spread"), endpoint_url=s3.endpoint))
    _assert_same(stock, sd)
    with pytest.raises(ValueError, match="spread_prefixes"):
        S3Storage(s3.url("x"), s3.options(spread_prefixes=-1))


def test_our_reader_loads_what_stock_fsspec_writer_wrote(s3: S3Env) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    sd = _state(seed=3, mib=2)
    dcp.save(sd, storage_writer=FsspecWriter(s3.url("stock"), endpoint_url=s3.endpoint))
    _assert_same(_load(s3, s3.url("stock"), sd), sd)


def test_objects_stream_as_multipart_uploads_within_a_small_host_pool(s3_proxy: S3Env) -> None:
    """24 MiB through an 8 MiB pool: only possible if parts leave while later pieces land."""
    sd = _state(seed=1, mib=24)
    writer = _save(s3_proxy, s3_proxy.url("stream"), sd, host_pool_bytes=8 * MiB, chunk_bytes=MiB)
    stats = writer.last_stats
    assert stats is not None and stats.pool_peak_bytes <= 8 * MiB
    parts = [p for m, p in s3_proxy.proxy.requests if m == "PUT" and "partNumber=" in p]
    assert len(parts) >= 4  # 24 MiB in 5 MiB parts, over two objects
    _assert_same(_load(s3_proxy, s3_proxy.url("stream"), sd), sd)


def test_transient_503_and_slowdown_answers_are_retried(s3_proxy: S3Env) -> None:
    proxy = s3_proxy.proxy
    faults = [
        Fault("PUT", r"partNumber=1(&|$)", status=503, code="ServiceUnavailable", times=2),
        Fault("PUT", r"/\.metadata$", status=503, code="SlowDown"),
        Fault("GET", r"__0_0\.distcp", status=500, code="InternalError"),
    ]
    proxy.faults += faults
    sd = _state(seed=2)
    _save(s3_proxy, s3_proxy.url("retry"), sd)
    _assert_same(_load(s3_proxy, s3_proxy.url("retry"), sd), sd)
    assert [f.hits for f in faults] == [2, 1, 1]


def test_permanent_403_fails_fast_names_bucket_and_key_and_leaves_no_upload(
    s3_proxy: S3Env,
) -> None:
    denied = Fault(
        "PUT", r"__0_0\.distcp\?.*partNumber=2", status=403, code="AccessDenied", times=None
    )
    s3_proxy.proxy.faults.append(denied)
    with pytest.raises(CheckpointException) as info:
        _save(s3_proxy, s3_proxy.url("denied"), _state(seed=4))
    text = str(info.value)
    assert s3_proxy.bucket in text and "denied/__0_0.distcp" in text and "AccessDenied" in text
    assert denied.hits == 1  # not retried
    assert METADATA_NAME not in [k.rsplit("/", 1)[-1] for k in s3_proxy.list_keys("denied/")]
    assert s3_proxy.open_uploads() == []


def test_missing_bucket_fails_before_any_write_with_a_clear_error(s3: S3Env) -> None:
    with pytest.raises(CheckpointException) as info:
        _save(s3, "s3://no-such-bucket-here/ckpt", _state(mib=1))
    assert "no-such-bucket-here" in str(info.value)
    assert "bucket" in str(info.value).lower()


def test_server_stopped_mid_upload_leaves_no_checkpoint_and_the_previous_one_loads(
    s3_proxy: S3Env,
) -> None:
    server = s3_proxy.server
    first = _state(seed=5)
    _save(s3_proxy, s3_proxy.url("step-1"), first)
    s3_proxy.proxy.faults.append(
        Fault("PUT", r"step-2/__0_0\.distcp\?.*partNumber=2", action=server.stop)
    )
    with pytest.raises(CheckpointException) as info:
        _save(s3_proxy, s3_proxy.url("step-2"), _state(seed=6))
    assert "gave up after" in str(info.value)
    server.start()
    assert not any(k.endswith(METADATA_NAME) for k in s3_proxy.list_keys("step-2/"))
    reader = DataStatesReader(s3_proxy.url("step-2"), storage_options=s3_proxy.options())
    with pytest.raises(CheckpointNotCommittedError):
        reader.read_metadata()
    _assert_same(_load(s3_proxy, s3_proxy.url("step-1"), first), first)
    # The next save to that prefix aborts the uploads the failed one could not, and commits.
    second = _state(seed=7)
    _save(s3_proxy, s3_proxy.url("step-2"), second)
    assert s3_proxy.open_uploads() == []
    _assert_same(_load(s3_proxy, s3_proxy.url("step-2"), second), second)


def test_objects_left_by_an_earlier_failed_attempt_are_not_part_of_the_new_checkpoint(
    s3: S3Env,
) -> None:
    client = s3.client()
    for name, body in [("__0_0.distcp", b"x" * 4096), ("__0_9.distcp", b"stale")]:
        client.put_object(Bucket=s3.bucket, Key=f"retry/{name}", Body=body)
    sd = _state(seed=8, mib=1)
    _save(s3, s3.url("retry"), sd)
    _assert_same(_load(s3, s3.url("retry"), sd), sd)
    metadata = DataStatesReader(s3.url("retry"), storage_options=s3.options()).read_metadata()
    assert "__0_9.distcp" not in {i.relative_path for i in metadata.storage_data.values()}
    assert "retry/__0_9.distcp" not in s3.list_keys("retry/")  # the commit removed it


def test_commit_refuses_an_object_whose_size_is_not_what_was_written(s3: S3Env) -> None:
    from dcp_datastates.storage.base import storage_for
    from dcp_datastates.storage.s3 import ObjectStoreError

    storage = storage_for(s3.url("sizes"), s3.options())
    storage.put_atomic("__0_0.distcp", b"abc", sync=True)
    storage.check_sizes({"__0_0.distcp": 3})
    with pytest.raises(ObjectStoreError, match="3 bytes but the save wrote 4") as info:
        storage.check_sizes({"__0_0.distcp": 4})
    assert info.value.key == "sizes/__0_0.distcp"
    with pytest.raises(ObjectStoreError, match="missing"):
        storage.check_sizes({"__0_1.distcp": 1})


def test_listings_and_existence_are_never_served_from_a_stale_cache(s3: S3Env) -> None:
    from dcp_datastates.storage.base import storage_for

    storage = storage_for(s3.url("fresh"), s3.options())
    storage.put_atomic("a", b"1", sync=True)
    assert storage.fs.ls(f"{s3.bucket}/fresh", detail=False)  # fills s3fs's listing cache
    s3.client().put_object(Bucket=s3.bucket, Key="fresh/b", Body=b"2")
    assert storage.list_names() == ["a", "b"]
    assert storage.exists("b")
    s3.client().delete_object(Bucket=s3.bucket, Key="fresh/a")
    assert not storage.exists("a")
    assert storage.size("b") == 1


def test_ranged_reads_fill_the_callers_buffers_and_stop_at_the_end(s3: S3Env) -> None:
    from dcp_datastates.storage.base import storage_for

    storage = storage_for(s3.url("ranged"), s3.options())
    storage.put_atomic("blob", bytes(range(256)) * 4, sync=True)
    ranged = storage.open_ranged("blob")
    a, b = bytearray(10), bytearray(20)
    assert ranged.read_into(100, [memoryview(a), memoryview(b)]) == 30
    assert bytes(a + b) == (bytes(range(256)) * 4)[100:130]
    tail = bytearray(50)
    assert ranged.read_into(1000, [memoryview(tail)]) == 24
    assert ranged.read_into(1024, [memoryview(tail)]) == 0


def test_retry_policy_refuses_bad_values_and_classifies_errors() -> None:
    pytest.importorskip("botocore")
    from botocore.exceptions import ClientError, EndpointConnectionError

    from dcp_datastates.storage.s3 import RetryPolicy, classify

    with pytest.raises(ValueError, match="attempts=0"):
        RetryPolicy(attempts=0)

    def client_error(status: int, code: str) -> ClientError:
        return ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject"
        )

    assert classify(client_error(503, "SlowDown"))[0]
    assert classify(client_error(500, "InternalError"))[0]
    assert classify(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))[0]
    transient, number, code, _ = classify(client_error(403, "AccessDenied"))
    assert (transient, number, code) == (False, errno.EACCES, "AccessDenied")
    assert classify(client_error(404, "NoSuchBucket"))[:2] == (False, errno.ENOENT)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_gloo_ranks_save_to_s3_and_one_process_loads_it(
    s3: S3Env, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from _dist_workers import check_all_ok, empty_like_values, full_values, launch

    monkeypatch.setenv("DCP_TEST_S3_URL", s3.url("ranks"))
    monkeypatch.setenv("DCP_TEST_S3_ENDPOINT", s3.endpoint)
    workers = str(Path(__file__).with_name("_s3_workers.py"))
    check_all_ok(launch("save", tmp_path, timeout=60, script=workers))
    names = {k.rsplit("/", 1)[-1] for k in s3.list_keys("ranks/")}
    assert {METADATA_NAME, "__0_0.distcp", "__1_0.distcp"} <= names
    target = empty_like_values(full_values())
    dcp.load(target, storage_reader=DataStatesReader(s3.url("ranks"), storage_options=s3.options()))
    expected = full_values()
    for key in ("sharded", "replicated_dt", "plain"):
        assert torch.equal(target[key], expected[key])
    assert target["meta"] == expected["meta"]
    assert s3.open_uploads() == []


def test_cli_says_when_the_store_cannot_be_read_without_a_traceback(
    s3: S3Env, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing bucket printed a traceback and exit code 1, the code of a damaged checkpoint
    (a user sweep): a script could not tell an unreachable store from a corrupt checkpoint."""
    from dcp_datastates import cli

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    for command in ("verify", "inspect"):
        assert cli.main([command, "s3://no-such-bucket-here/run/step-1"]) == cli.EXIT_UNREADABLE
        err = capsys.readouterr().err
        assert "no-such-bucket-here" in err and "nothing was checked" in err, err
