"""Peer replication on four real gloo ranks forming two simulated nodes of two ranks each
(``_peer_workers.py``): replicas land byte-exact on the other node, a lost node gets its files
back, a corrupt replica is found by every rank, and a dead peer fails a future, not training."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest
from _dist_workers import check_all_ok, launch
from _peer_workers import (
    RESTORE_TREES,
    STEP,
    data_name,
    file_bytes,
    node_root,
    rank_files,
)

from dcp_datastates.checkpointers.peer_replicas import MARKER_NAME, ReplicaInvalid, read_marker
from dcp_datastates.checkpointers.peer_ring import PeerRing
from dcp_datastates.checkpointers.peers import PeerReplicator

WORKERS = str(Path(__file__).with_name("_peer_workers.py"))
WORLD = 4

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _launch(scenario: str, workdir: Path) -> list:
    return launch(scenario, workdir, world_size=WORLD, timeout=90, script=WORKERS)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A step replicated once; tests that change it work on a copy."""
    workdir = tmp_path_factory.mktemp("peers")
    check_all_ok(_launch("replicate", workdir))
    return workdir


@pytest.fixture(scope="module")
def restored(replicated: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Node 1 (ranks 2 and 3) lost, memory and all, in two copies of the replicated tree: in
    ``mem_corrupt`` node 0's replica of rank 2 has one bit flipped; then one restart restores
    from ``mem_corrupt`` and from ``mem_lost`` in turn."""
    workdir = tmp_path_factory.mktemp("restore")
    for tree in RESTORE_TREES:
        shutil.copytree(replicated / "mem", workdir / tree)
        shutil.rmtree(node_root(workdir, 2, tree))
    replica = node_root(workdir, 0, "mem_corrupt") / "peer" / "rank_2" / f"step_{STEP}"
    blob = bytearray((replica / data_name(2)).read_bytes())
    blob[len(blob) // 2] ^= 0x40  # one flipped bit in memory
    (replica / data_name(2)).write_bytes(bytes(blob))
    check_all_ok(_launch("restore", workdir))
    return workdir


def _restore_reports(workdir: Path, tree: str) -> dict[int, dict]:
    return {r: json.loads((workdir / f"rank{r}.json").read_text())[tree] for r in range(WORLD)}


def test_each_rank_keeps_its_source_ranks_files_byte_exact_on_the_other_node(
    replicated: Path,
) -> None:
    for rank in range(WORLD):
        report = json.loads((replicated / f"rank{rank}.json").read_text())
        source = (rank + 2) % WORLD
        assert (report["peer"], report["source"]) == (source, source)
        assert report["all_reduce_ok"], f"rank {rank}'s all-reduces gave a wrong sum"
        replica = node_root(replicated, rank) / "peer" / f"rank_{source}" / f"step_{STEP}"
        assert Path(report["replica"]) == replica
        for name in rank_files(source):
            assert (replica / name).read_bytes() == file_bytes(name, source), name
            assert stat.S_IMODE((replica / name).stat().st_mode) == 0o600
        for d in (replica, replica.parent, replica.parent.parent):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
        marker = read_marker(replica, step=STEP, source=source, world_size=WORLD)
        assert set(marker["files"]) == set(rank_files(source))
        assert report["bytes_sent"] == sum(len(file_bytes(n, rank)) for n in rank_files(rank))
        # the older steps pruned (rank 2 never got rank 0's step STEP - 1), and no partial
        # directory left by the failed one
        older = [STEP - 2] if rank == 2 else [STEP - 2, STEP - 1]
        assert report["pruned"] == [f"step_{s}" for s in older]
        assert report["kept_after_prune"] == [f"step_{STEP}"]
        assert sorted(p.name for p in replica.iterdir()) == sorted(
            [*rank_files(source), MARKER_NAME]
        )


def test_an_unreadable_file_fails_its_step_on_both_ends_and_the_next_step_replicates(
    replicated: Path,
) -> None:
    reports = [json.loads((replicated / f"rank{r}.json").read_text()) for r in range(WORLD)]
    sender, receiver = reports[0]["failure"], reports[2]["failure"]
    assert "rank 0" in sender and "missing.distcp" in sender and f"step {STEP - 1}" in sender
    assert "from rank 0" in receiver and "missing.distcp" in receiver, receiver
    assert reports[1]["failure"] is None and reports[3]["failure"] is None
    # step STEP (after the failure) replicated everywhere: the other tests check its bytes


def test_a_lost_node_gets_its_ranks_files_back_from_their_peers(restored: Path) -> None:
    reports = _restore_reports(restored, "mem_lost")
    assert [reports[r]["lost"] for r in range(WORLD)] == [False, False, True, True]
    assert reports[0]["restored"] == reports[1]["restored"] == []
    for rank in (2, 3):
        assert sorted(reports[rank]["restored"]) == sorted(rank_files(rank))
        step_dir = node_root(restored, rank, "mem_lost") / f"step_{STEP}"
        for name in rank_files(rank):
            assert (step_dir / name).read_bytes() == file_bytes(name, rank), name
            assert stat.S_IMODE((step_dir / name).stat().st_mode) == 0o600
        assert not [p for p in step_dir.iterdir() if p.name.endswith(".tmp")]


def test_a_corrupt_replica_fails_the_restore_on_every_rank(restored: Path) -> None:
    for rank, report in _restore_reports(restored, "mem_corrupt").items():
        assert "restored" not in report, f"rank {rank} restored from a corrupt replica"
        assert report["failures"].keys() == {"2"}, report
        assert "checksum" in report["failures"]["2"] and data_name(2) in report["error"]
    # nothing written for the lost ranks, not even rank 3's intact replica
    assert not (node_root(restored, 2, "mem_corrupt") / f"step_{STEP}").exists()


def test_a_dead_peer_fails_the_future_of_the_rank_paired_with_it_and_nothing_else(
    tmp_path: Path,
) -> None:
    results = _launch("die", tmp_path)
    reports = {r.rank: r.report for r in results}
    for rank in (0, 2):  # paired with each other: both steps replicate
        assert reports[rank].get("ok") and "error" not in reports[rank], results[rank].output
        assert reports[rank]["again"] == "ok"
    bad = reports[1]
    assert bad.get("ok") and bad["trained_on"], results[1].output
    assert bad["error_fields"] == [1, 3, 3, STEP]
    assert "rank 1" in bad["error"] and "rank 3" in bad["error"]
    assert "earlier replication broke" in bad["again"]


@pytest.mark.parametrize(
    ("nodes", "distance", "peers"),
    [
        ([0, 0, 1, 1], 1, [2, 3, 0, 1]),
        ([0, 0, 1, 1, 2, 2], 1, [2, 3, 4, 5, 0, 1]),
        ([0, 0, 1, 1, 2, 2], 2, [4, 5, 0, 1, 2, 3]),
        ([7, 3, 7, 3], 1, [1, 0, 3, 2]),  # node ids in any order, ranks interleaved
    ],
)
def test_ring_puts_each_peer_distance_nodes_on_with_the_same_local_index(
    nodes: list[int], distance: int, peers: list[int]
) -> None:
    ring = PeerRing(node_of_rank=tuple(nodes), distance=distance)
    assert [ring.peer(r) for r in range(len(nodes))] == peers
    assert [ring.source(ring.peer(r)) for r in range(len(nodes))] == list(range(len(nodes)))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"node_of_rank": (0, 0, 0)}, "node_of_rank=[0, 0, 0]"),
        ({"node_of_rank": (0, 0, 1)}, "different numbers of ranks"),
        ({"node_of_rank": (0, 1), "distance": 2}, "distance=2"),
        ({"node_of_rank": (0, 1), "distance": 0}, "distance=0"),
    ],
)
def test_ring_refuses_a_layout_without_a_peer_on_another_node(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        PeerRing(**kwargs)


def test_ring_from_ranks_per_node_must_divide_the_world() -> None:
    with pytest.raises(ValueError, match="ranks_per_node=3"):
        PeerRing.of(4, node_of_rank=None, ranks_per_node=3, distance=1)
    with pytest.raises(ValueError, match="on one node"):
        PeerRing.of(4, node_of_rank=None, ranks_per_node=4, distance=1)  # one node: no peer


def test_a_replica_without_its_marker_does_not_count(tmp_path: Path) -> None:
    (tmp_path / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(ReplicaInvalid, match="no replica"):
        read_marker(tmp_path, step=1, source=0, world_size=2)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"chunk_bytes": 0}, "chunk_bytes=0"),
        ({"keep": 0}, "keep=0"),
        ({"nice": 20}, "nice=20"),
        ({"timeout": 30}, "timeout=30"),
        ({}, "torch.distributed initialized"),  # this process has no group
    ],
)
def test_replicator_names_a_bad_option_before_it_joins_a_group(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        PeerReplicator(ranks_per_node=1, **kwargs)
