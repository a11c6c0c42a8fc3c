"""Power loss: the order of durable operations, as ``docs/format.md`` ("Commit order") writes it.

A process kill only shows what a crash leaves; a power loss also drops whatever was not fsynced,
in any order. So these tests record the file system calls that make things durable (``fsync``,
``os.replace``, ``os.unlink``, through a recording wrapper around the real ``os`` functions) while
real saves run, and check their order:

    uncommit: unlink .metadata, fsync dir              (overwrite only, before any data)
    data:     fsync every data file                    (each rank, once per file)
    commit:   unlink stale files of an earlier save, fsync dir and the directories above it,
              manifest: fsync .tmp, replace, fsync dir; .metadata: fsync .tmp, replace, fsync dir
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import READERS, assert_same_state, load_like

from dcp_datastates import DataStatesWriter, cli
from dcp_datastates.format import DATA_SUFFIX, MANIFEST_NAME, METADATA_NAME

Event = tuple[str, str]  # (operation, what: a name in the checkpoint, "dir", or "parent")


def _state(n: int = 8) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    return {f"w{i}": torch.randn(256, 64, generator=g) for i in range(n)} | {"step": n}


@pytest.fixture
def record(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path], list[Event]]:
    """``events = record(ckpt)``: from then on, durable operations on ``ckpt`` (and fsyncs of
    the directories above it) are appended to ``events``, in the order they happen."""
    events: list[Event] = []
    lock = threading.Lock()
    root: list[Path] = []
    real_fsync, real_replace, real_unlink = os.fsync, os.replace, os.unlink

    def name(path: str | os.PathLike) -> str | None:
        if not root:
            return None
        p = Path(os.path.abspath(path))
        if p == root[0]:
            return "dir"
        if p.parent == root[0]:
            return p.name
        if p in root[0].parents:
            return "parent"
        return None

    def note(op: str, path: str | os.PathLike) -> None:
        what = name(path)
        if what is not None:
            with lock:
                events.append((op, what))

    def fsync(fd: int) -> None:
        note("fsync", os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(src: Any, dst: Any, **kwargs: Any) -> None:
        real_replace(src, dst, **kwargs)
        note("replace", dst)

    def unlink(path: Any, **kwargs: Any) -> None:
        real_unlink(path, **kwargs)
        note("unlink", path)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "unlink", unlink)

    def start(ckpt: Path) -> list[Event]:
        root.append(Path(os.path.abspath(ckpt)))
        return events

    return start


def _save(path: Path, flush_workers: int, state: dict[str, Any], **options: Any) -> None:
    writer = DataStatesWriter(path, flush_workers=flush_workers, **options)
    try:
        dcp.save(state, storage_writer=writer, no_dist=True)
    finally:
        writer.close()


def _is_data(what: str) -> bool:
    return what.endswith(DATA_SUFFIX)


def _commit_tail() -> list[Event]:
    return [
        ("fsync", f"{MANIFEST_NAME}.tmp"),
        ("replace", MANIFEST_NAME),
        ("fsync", "dir"),
        ("fsync", f"{METADATA_NAME}.tmp"),
        ("replace", METADATA_NAME),
        ("fsync", "dir"),
    ]


def test_a_new_checkpoint_is_made_durable_in_the_documented_order(
    tmp_path: Path, record: Callable[[Path], list[Event]]
) -> None:
    ckpt = tmp_path / "runs" / "step_1"  # neither directory exists yet
    events = record(ckpt)
    _save(ckpt, 2, _state())

    data = [e for e in events if _is_data(e[1])]  # two flush threads: either order
    assert sorted(data) == [("fsync", f"__0_{n}{DATA_SUFFIX}") for n in range(2)], events
    rest = [e for e in events if not _is_data(e[1])]
    first_data_sync = max(events.index(e) for e in data)
    # Every data file is durable before the directory sync that precedes the commit ...
    assert events.index(("fsync", "dir")) > first_data_sync
    # ... which also syncs each directory above, the two this save created included ...
    parents = [i for i, e in enumerate(events) if e == ("fsync", "parent")]
    assert len(parents) >= 2, events
    assert all(
        first_data_sync < i < events.index(("fsync", f"{MANIFEST_NAME}.tmp")) for i in parents
    )
    # ... then the manifest, then .metadata, each through a synced temp file and a synced rename.
    assert [e for e in rest if e[1] != "parent"] == [("fsync", "dir"), *_commit_tail()], events


def test_overwriting_a_bigger_save_uncommits_durably_and_leaves_no_stale_files(
    tmp_path: Path, record: Callable[[Path], list[Event]]
) -> None:
    ckpt = tmp_path / "ckpt"
    _save(ckpt, 4, _state(9))  # an earlier, bigger save: four data files ...
    assert len(list(ckpt.glob(f"*{DATA_SUFFIX}"))) == 4
    for rank in (2, 3):  # ... and the files ranks 2 and 3 of a 4-rank save would have left
        shutil.copy(ckpt / f"__0_0{DATA_SUFFIX}", ckpt / f"__{rank}_0{DATA_SUFFIX}")
    (ckpt / f"{METADATA_NAME}.tmp").write_bytes(b"left by a commit that died")
    (ckpt / "notes.txt").write_text("not ours: stays")

    events = record(ckpt)
    state = _state(8)
    _save(ckpt, 1, state)

    # The old commit record goes first, durably, before a data byte is made durable.
    assert events[:2] == [("unlink", METADATA_NAME), ("fsync", "dir")], events
    stale = {f"__0_{n}{DATA_SUFFIX}" for n in (1, 2, 3)} | {f"{METADATA_NAME}.tmp"}
    stale |= {f"__{rank}_0{DATA_SUFFIX}" for rank in (2, 3)}
    unlinked = [i for i, e in enumerate(events) if e[0] == "unlink" and e[1] in stale]
    assert {events[i][1] for i in unlinked} == stale
    data_sync = events.index(("fsync", f"__0_0{DATA_SUFFIX}"))
    commit_sync = len(events) - len(_commit_tail()) - 1
    while events[commit_sync] == ("fsync", "parent"):
        commit_sync -= 1
    assert events[commit_sync] == ("fsync", "dir"), events
    assert all(data_sync < i < commit_sync for i in unlinked), events
    assert events[-len(_commit_tail()) :] == _commit_tail()

    # What is left is exactly what .metadata names, and every reader agrees with it.
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == sorted([f"__0_0{DATA_SUFFIX}", MANIFEST_NAME, METADATA_NAME, "notes.txt"])
    for reader in READERS:
        assert_same_state(state, load_like(ckpt, state, reader))
    assert cli.main(["verify", "--quiet", str(ckpt)]) == 0


def test_without_sync_files_nothing_is_fsynced_but_stale_files_still_go(
    tmp_path: Path, record: Callable[[Path], list[Event]]
) -> None:
    ckpt = tmp_path / "ckpt"
    _save(ckpt, 3, _state(9), sync_files=False)
    events = record(ckpt)
    _save(ckpt, 1, _state(8), sync_files=False)
    assert not [e for e in events if e[0] == "fsync"], events
    assert sorted(p.name for p in ckpt.glob(f"*{DATA_SUFFIX}")) == [f"__0_0{DATA_SUFFIX}"]


@pytest.mark.parametrize(
    "first_collective", [True, False], ids=["global-then-rank", "rank-then-global"]
)
def test_a_save_with_the_other_use_collectives_uncommits_the_first_or_refuses(
    tmp_path: Path, record: Callable[[Path], list[Event]], first_collective: bool
) -> None:
    """Both settings write ``__{rank}_{n}`` data files; only the commit record differs
    (``.metadata`` or ``__{rank}.metadata``). A user sweep (2 gloo ranks) found ``overwrite=False``
    ignored across the switch, and a global ``.metadata`` left committing overwritten data."""
    ckpt = tmp_path / "ckpt"
    first, second = _state(9), _state(8)

    def save(state: dict[str, Any], collective: bool, **options: Any) -> None:
        writer = DataStatesWriter(ckpt, flush_workers=1, **options)
        try:
            dcp.save(state, storage_writer=writer, no_dist=True, use_collectives=collective)
        finally:
            writer.close()

    save(first, first_collective)
    old_record = METADATA_NAME if first_collective else f"__0{METADATA_NAME}"
    refused = rf"self.overwrite=False. rank 0: \S*{old_record} exists"
    with pytest.raises(BaseException, match=refused):
        save(second, not first_collective, overwrite=False)
    assert_same_state(first, load_like(ckpt, first, "datastates"))

    events = record(ckpt)
    save(second, not first_collective)
    assert events[:2] == [("unlink", old_record), ("fsync", "dir")], events
    new_record = f"__0{METADATA_NAME}" if first_collective else METADATA_NAME
    records = sorted(p.name for p in ckpt.iterdir() if p.name.endswith(METADATA_NAME))
    assert records == [new_record]
    if not first_collective:  # the global save also removed the rank's own manifest
        assert not (ckpt / f"__0{MANIFEST_NAME}").exists()
    for reader in READERS:
        assert_same_state(second, load_like(ckpt, second, reader))
    assert cli.main(["verify", "--quiet", str(ckpt)]) == 0
