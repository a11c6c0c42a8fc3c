"""Checkpointer, resuming and as a new user meets it: a damaged or uncommitted newest step falls
back to the one before, a step saved again never leaves nothing loadable, ``load(step=)``,
arguments and the root checked at construction, one summary line per save."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _checkpointer_workers import (
    App,
    FailingWriter,
    GatedWriter,
    Model,
    damage,
    digest,
    train_step,
)
from _dist_workers import check_all_ok, launch

from dcp_datastates import (
    CheckpointLoadError,
    CheckpointNotCommittedError,
    DataStatesWriter,
    StorageWriteError,
)
from dcp_datastates.checkpointers import steps
from dcp_datastates.checkpointers.checkpointer import Checkpointer, step_dir_name

WORKER = str(Path(__file__).with_name("_checkpointer_workers.py"))
LOGGER = "dcp_datastates.checkpointers"


def _app() -> App:
    model = Model()
    return App(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _run(root: Path, steps_: range | tuple[int, ...], **options: Any) -> dict[int, str]:
    """Train and save every step of ``steps_``; the digest after each."""
    app, seen = _app(), {}
    with Checkpointer(root, every_steps=1, preemption_signals=(), **options) as ck:
        for step in steps_:
            train_step(app, step, 1)
            seen[step] = digest(app)
            ck.maybe_save(step, {"app": app})
    return seen


def _resume(root: Path) -> tuple[int | None, str]:
    app = _app()
    with Checkpointer(root, preemption_signals=()) as ck:
        step = ck.load_latest({"app": app})
    return step, digest(app)


# -- item 9: resume from the newest checkpoint that loads --------------------------------------
def test_a_damaged_latest_falls_back_to_the_step_before_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen = _run(tmp_path, (1, 2, 3))
    damage(tmp_path / step_dir_name(3))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert _resume(tmp_path) == (2, seen[2])
    (skip,) = [r.getMessage() for r in caplog.records if "cannot resume from step 3" in r.message]
    assert skip.startswith("rank 0:") and "ChecksumMismatchError" in skip, skip


def test_an_uncommitted_latest_falls_back_to_the_newest_committed_step(tmp_path: Path) -> None:
    """What a save over the step ``latest`` names left before (it uncommitted that step first)."""
    seen = _run(tmp_path, (1, 2, 3))
    (tmp_path / step_dir_name(3) / ".metadata").unlink()
    assert _resume(tmp_path) == (2, seen[2])


def test_when_no_step_loads_an_exception_lists_each_step_and_why(tmp_path: Path) -> None:
    _run(tmp_path, (1, 2))
    (tmp_path / step_dir_name(2) / ".metadata").unlink()  # the step `latest` names
    damage(tmp_path / step_dir_name(1))
    with pytest.raises(CheckpointLoadError) as raised:  # an Exception: `except Exception` sees it
        _resume(tmp_path)
    assert isinstance(raised.value, Exception)
    assert list(raised.value.failures) == [2, 1]
    message = str(raised.value)
    assert "step 2: not committed" in message, message
    assert "step 1: rank 0: ChecksumMismatchError" in message, message


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_fall_back_together_past_a_step_one_rank_alone_cannot_load(
    tmp_path: Path,
) -> None:
    """Step 3 is damaged (DCP fails its load on every rank); rank 1 alone refuses step 2 in its
    own ``load_state_dict`` (no other rank hears of it from DCP): both ranks load step 1."""
    results = launch("resume", tmp_path, script=WORKER, timeout=120)
    check_all_ok(results)
    assert [r.report["resumed"] for r in results] == [1, 1]
    assert [r.report["digest"] for r in results] == [r.report["digests"]["1"] for r in results]
    for r in results:
        assert f"rank {r.rank}: cannot resume from step 3" in r.output, r.output[-3000:]
        assert f"rank {r.rank}: cannot resume from step 2" in r.output, r.output[-3000:]
    assert "failed on rank(s) [1]" in results[0].output, results[0].output[-3000:]
    assert "injected: this rank refuses" in results[1].output, results[1].output[-3000:]


# -- item 9: saving again the step `latest` names ----------------------------------------------
def test_saving_the_latest_step_again_keeps_it_loadable_until_the_new_save_commits(
    tmp_path: Path,
) -> None:
    """A run resumed by other means saves step 2 again, with keep_latest_k=1: the writer
    uncommitted step 2 before writing over it, so a crash then left nothing to load."""
    seen = _run(tmp_path, (1, 2), keep_latest_k=1)
    app = _app()
    for step in (1, 2, 3):  # a different state to save as step 2
        train_step(app, step, 1)
    writer = GatedWriter(tmp_path, gated_step=2)
    ck = Checkpointer(tmp_path, every_steps=1, keep_latest_k=1, writer=writer)
    try:
        assert ck.maybe_save(2, {"app": app})
        assert writer.entered.wait(30)  # written, about to commit: the old step 2 still loads
        assert _resume(tmp_path) == (2, seen[2])
        writer.gate.set()
        ck.wait()
    finally:
        writer.gate.set()
        ck.close()
        writer.close()
    assert _resume(tmp_path) == (2, digest(app))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", step_dir_name(2)]


def test_a_failed_save_over_the_latest_step_leaves_the_old_one_loadable(tmp_path: Path) -> None:
    seen = _run(tmp_path, (1, 2), keep_latest_k=1)
    app = _app()
    writer = FailingWriter(tmp_path, failing_step=2)
    ck = Checkpointer(tmp_path, every_steps=1, keep_latest_k=1, writer=writer)
    ck.maybe_save(2, {"app": app})
    with pytest.raises(Exception, match="no space left"):
        ck.wait()
    ck.close()
    writer.close()
    assert _resume(tmp_path) == (2, seen[2])


def _save_to(path: Path, app: App) -> None:
    writer = DataStatesWriter(path)
    try:
        dcp.save({"app": app}, storage_writer=writer, no_dist=True)
    finally:
        writer.close()


@pytest.mark.parametrize(
    "crash", ["before the swap", "between the two renames", "before the old one is deleted"]
)
def test_a_crash_while_replacing_a_step_leaves_one_that_loads(tmp_path: Path, crash: str) -> None:
    """A step saved again is written beside the old one and swapped in by two renames once it
    is committed. What a crash leaves at each point loads, and the next save tidies it."""
    old = _run(tmp_path, (1, 2))[2]
    new_app = _app()
    for step in (1, 2, 3):
        train_step(new_app, step, 1)
    place = tmp_path / step_dir_name(2)
    replacing, replaced = (Path(f"{place}{suffix}") for suffix in steps.ASIDE)
    _save_to(replacing, new_app)
    if crash != "before the swap":
        place.rename(replaced)
    if crash == "before the old one is deleted":
        replacing.rename(place)
    expected = old if crash == "before the swap" else digest(new_app)
    assert _resume(tmp_path) == (2, expected)

    app = _app()
    with Checkpointer(tmp_path, every_steps=1, preemption_signals=()) as ck:
        ck.load({"app": app}, step=2)
        ck.maybe_save(3, {"app": app})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        step_dir_name(1),
        step_dir_name(2),
        step_dir_name(3),
    ]
    app = _app()
    with Checkpointer(tmp_path, preemption_signals=()) as ck:
        ck.load({"app": app}, step=2)
    assert digest(app) == expected


# -- item 10: a new user's checkpointer --------------------------------------------------------
def test_load_takes_a_given_step_and_names_the_steps_there_when_it_is_absent(
    tmp_path: Path,
) -> None:
    seen = _run(tmp_path, (1, 2, 3))
    app = _app()
    with Checkpointer(tmp_path, preemption_signals=()) as ck:
        assert ck.load({"app": app}, step=2) == 2
        assert digest(app) == seen[2]
        with pytest.raises(CheckpointNotCommittedError, match=r"committed steps are \[1, 2, 3\]"):
            ck.load({"app": app}, step=5)
        with pytest.raises(ValueError, match="step='2'"):
            ck.load({"app": app}, step="2")  # type: ignore[arg-type]
        damage(tmp_path / step_dir_name(3))
        with pytest.raises(CheckpointLoadError, match="ChecksumMismatchError") as raised:
            ck.load({"app": app}, step=3)  # a step asked for by name does not fall back
    assert list(raised.value.failures) == [3]
    assert "may hold part of it" in str(raised.value)  # a failed load can leave some of its state


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("every_steps", 2.5, "is a float; it must be an int"),
        ("every_steps", True, "is a bool; it must be an int"),
        ("every_steps", 0, "must be at least 1"),
        ("keep_latest_k", "3", "is a str; it must be an int"),
        ("keep_latest_k", -1, "must be at least 0"),
        ("preemption_deadline_s", 0, "must be a number of seconds above 0"),
        ("exit_on_preemption", "yes", "must be True or False"),
        ("abort_exit_code", 300, "must be between 0 and 255"),
    ],
)
def test_a_bad_argument_is_refused_at_construction_naming_it(
    tmp_path: Path, option: str, value: Any, words: str
) -> None:
    with pytest.raises(ValueError, match=f"{option}={value!r}") as raised:
        Checkpointer(tmp_path, preemption_signals=(), **{option: value})
    assert words in str(raised.value)


def _unwritable_dir(tmp_path: Path) -> Path:
    """A directory this process cannot create files in: a read-only one, or, as root (who
    writes through any mode bits), sysfs."""
    if os.geteuid() != 0:
        path = tmp_path / "read-only"
        path.mkdir(mode=0o555)
        return path
    if not os.path.isdir("/sys/kernel"):
        pytest.skip("root without sysfs: no directory here refuses root's writes")
    return Path("/sys/kernel")


@pytest.mark.parametrize("where", ["under a file", "a directory that refuses writes"])
def test_a_root_that_cannot_be_written_is_refused_at_construction(
    tmp_path: Path, where: str
) -> None:
    if where == "under a file":
        (tmp_path / "a-file").write_text("")
        root = tmp_path / "a-file" / "ckpt"
    else:
        root = _unwritable_dir(tmp_path)
    with pytest.raises(StorageWriteError, match="not writable") as raised:
        Checkpointer(root, preemption_signals=())
    assert str(root) in str(raised.value)


def test_each_committed_save_leaves_a_one_line_summary(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = _app()
    ck = Checkpointer(tmp_path, every_steps=2, preemption_signals=())
    assert ck.last_summary is None
    with caplog.at_level(logging.INFO, logger=LOGGER), ck:
        for step in (1, 2, 3, 4):
            train_step(app, step, 1)
            ck.maybe_save(step, {"app": app})
        ck.wait()
        summary = ck.last_summary
    assert summary is not None and "\n" not in summary
    assert summary.startswith("rank 0: step 4 committed:"), summary
    for words in ("kB", "blocked", "safe to change after", "durable after"):
        assert words in summary, summary
    logged = [r.getMessage() for r in caplog.records if "committed:" in r.getMessage()]
    assert [line.split(":")[1] for line in logged] == [" step 2 committed", " step 4 committed"]
