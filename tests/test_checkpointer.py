"""Checkpointer: periodic saves, ``latest`` only after commit, retention, preemption, two ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from _checkpointer_workers import App, FailingWriter, GatedWriter, Model, digest, train_step
from _dist_workers import check_all_ok, launch

from dcp_datastates import CheckpointSaveError, DataStatesWriter
from dcp_datastates.checkpointers.checkpointer import Checkpointer, step_dir_name

WORKER = str(Path(__file__).with_name("_checkpointer_workers.py"))


def _app() -> App:
    model = Model()
    return App(model, torch.optim.AdamW(model.parameters(), lr=1e-2))


def _committed(root: Path, step: int) -> bool:
    return (root / step_dir_name(step) / ".metadata").exists()


def test_saves_every_n_keeps_k_and_resumes_bit_exactly(tmp_path: Path) -> None:
    app, seen = _app(), {}
    with Checkpointer(tmp_path, every_steps=3, keep_latest_k=2) as ck:
        for step in range(1, 11):
            train_step(app, step, 1)
            seen[step] = digest(app)
            ck.maybe_save(step, {"app": app})
    assert ck.committed_steps() == [6, 9]
    assert not (tmp_path / step_dir_name(3)).exists()
    assert ck.latest_step() == 9

    fresh = _app()
    with Checkpointer(tmp_path, every_steps=3) as ck2:
        assert ck2.load_latest({"app": fresh}) == 9
    assert digest(fresh) == seen[9]
    for step in (10, 11):  # the resumed run goes on exactly as the first one did
        train_step(fresh, step, 1)
    train_step(app, 11, 1)
    assert digest(fresh) == digest(app)


def test_retention_deletes_the_directories_of_saves_that_never_committed(tmp_path: Path) -> None:
    """What a crash (SIGKILL, a second signal) leaves: a step directory with data and no
    ``.metadata``. Retention deletes those older than the newest commit, and leaves a newer one
    (the step a resumed run saves again) and anything not a step directory."""
    for step, files in ((2, ["__0_0.distcp"]), (4, []), (50, ["__0_0.distcp"])):
        (tmp_path / step_dir_name(step)).mkdir()
        for name in files:
            (tmp_path / step_dir_name(step) / name).write_bytes(b"partial")
    (tmp_path / "notes").mkdir()
    app = _app()
    with Checkpointer(tmp_path, every_steps=3, keep_latest_k=2) as ck:
        for step in range(1, 7):
            train_step(app, step, 1)
            ck.maybe_save(step, {"app": app})
    assert ck.committed_steps() == [3, 6]
    assert not (tmp_path / step_dir_name(2)).exists()
    assert not (tmp_path / step_dir_name(4)).exists()
    assert (tmp_path / step_dir_name(50) / "__0_0.distcp").exists()
    assert (tmp_path / "notes").is_dir()


def test_retention_deletes_the_other_old_checkpoints_past_one_it_cannot(tmp_path: Path) -> None:
    """Retention stopped at the first checkpoint it could not delete, and kept every older one
    after it for good (a user sweep). Step 1's ``.metadata`` is made undeletable (a directory,
    which ``unlink`` refuses, even to root): step 2 still goes, and each save's error, naming
    step 1, is raised once."""
    app = _app()
    ck = Checkpointer(tmp_path, every_steps=1, keep_latest_k=1)
    train_step(app, 1, 1)
    ck.maybe_save(1, {"app": app})
    ck.wait()
    metadata = tmp_path / step_dir_name(1) / ".metadata"
    metadata.unlink()
    metadata.mkdir()
    (metadata / "stuck").write_text("")
    for step in (2, 3):  # each save's retention tries step 1 again, and raises once
        train_step(app, step, 1)
        ck.maybe_save(step, {"app": app})
        with pytest.raises(OSError, match=step_dir_name(1)):
            ck.wait()
    assert ck.committed_steps() == [1, 3]
    assert not (tmp_path / step_dir_name(2)).exists()
    ck.close()


def test_load_latest_without_checkpoint_returns_none(tmp_path: Path) -> None:
    app = _app()
    before = digest(app)
    with Checkpointer(tmp_path / "empty") as ck:
        assert ck.load_latest({"app": app}) is None
    assert digest(app) == before


def test_latest_and_retention_wait_for_the_commit(tmp_path: Path) -> None:
    writer = GatedWriter(tmp_path, gated_step=4)
    app = _app()
    with Checkpointer(tmp_path, every_steps=2, keep_latest_k=1, writer=writer) as ck:
        for step in (1, 2, 3, 4):
            train_step(app, step, 1)
            ck.maybe_save(step, {"app": app})
        assert writer.entered.wait(30)
        # Step 4's data is written and its commit is in progress: nothing has moved yet.
        assert ck.latest_step() == 2
        assert _committed(tmp_path, 2) and not _committed(tmp_path, 4)
        writer.gate.set()
        ck.wait()
        assert ck.latest_step() == 4
        assert ck.committed_steps() == [4]
    writer.close()


def test_failed_save_is_raised_once_and_keeps_latest(tmp_path: Path) -> None:
    writer = FailingWriter(tmp_path, failing_step=4)
    app = _app()
    ck = Checkpointer(tmp_path, every_steps=2, keep_latest_k=1, writer=writer)
    for step in (1, 2, 3, 4, 5, 6):
        train_step(app, step, 1)
        if step < 5:  # step 5 is skipped: whether step 4's failure has landed yet is a race
            ck.maybe_save(step, {"app": app})
    # The save of step 6 first waits for step 4's, and reports its failure.
    with pytest.raises(CheckpointSaveError, match="no space left"):
        ck.maybe_save(6, {"app": app})
    assert ck.latest_step() == 2 and ck.committed_steps() == [2]
    assert ck.maybe_save(6, {"app": app})  # reported once: the loop goes on and saves
    ck.wait()
    assert ck.latest_step() == 6 and ck.committed_steps() == [6]
    assert not _committed(tmp_path, 4)
    ck.close()
    writer.close()


def test_requested_preemption_saves_the_current_step(tmp_path: Path) -> None:
    app = _app()
    ck = Checkpointer(tmp_path, every_steps=5, exit_on_preemption=False, preemption_signals=())
    for step in range(1, 7):
        train_step(app, step, 1)
        if step == 6:
            ck.request_preemption()  # what SIGTERM does
        ck.maybe_save(step, {"app": app})
    assert ck.preempted and ck.latest_step() == 6 and ck.committed_steps() == [5, 6]
    assert not ck.maybe_save(10, {"app": app})  # nothing more after the final checkpoint
    ck.close()
    step, loaded = _load_digest(tmp_path)
    assert step == 6 and loaded == digest(app)


def test_a_mistyped_option_names_the_checkpointers_own_and_writer_options_go_nowhere(
    tmp_path: Path,
) -> None:
    """``every_step=10`` was refused as an unknown *writer* option, listing the writer's
    options only; options given beside ``writer=`` were dropped (a user sweep)."""
    with pytest.raises(TypeError, match=r"every_step \(did you mean every_steps\?\)"):
        Checkpointer(tmp_path, every_step=10)
    writer = DataStatesWriter(tmp_path)
    try:
        with pytest.raises(ValueError, match="copy_workers"):
            Checkpointer(tmp_path, writer=writer, copy_workers=1)
    finally:
        writer.close()


def test_every_checkpointer_of_a_process_saves_on_sigterm_and_the_last_one_exits(
    tmp_path: Path,
) -> None:
    """A model's and an EMA's checkpointer in one loop: the second's ``signal.signal`` replaced
    the first's handler, so SIGTERM made only the EMA's final save (a user sweep), and closing
    them in the order made left the first one's handler installed. Both hear it now; the first
    to commit its final save returns, the last ends the process; closed, the handler before
    them is back."""
    before = signal.getsignal(signal.SIGTERM)
    app, ema = _app(), {"w": torch.ones(10)}
    model_ck = Checkpointer(tmp_path / "model", every_steps=100)
    ema_ck = Checkpointer(tmp_path / "ema", every_steps=100)
    try:
        for step in (1, 2, 3):
            if step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # handled on this (the main) thread
            train_step(app, step, 1)
            assert not model_ck.maybe_save(step, {"app": app}) or step == 3
            if step == 3:
                assert model_ck.preempted  # its final save returned: the EMA's is pending
                with pytest.raises(SystemExit):
                    ema_ck.maybe_save(step, {"ema": ema})
        assert model_ck.committed_steps() == [3] and ema_ck.committed_steps() == [3]
        assert signal.getsignal(signal.SIGTERM) is not before
    finally:
        model_ck.close()
        ema_ck.close()
    assert signal.getsignal(signal.SIGTERM) is before


# -- real processes ------------------------------------------------------------------------------
def _spawn(workdir: Path, **env: str) -> subprocess.Popen:
    workdir.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full_env.update({f"CK_{k.upper()}": v for k, v in env.items()})
    cmd = [sys.executable, WORKER, "train", "0", "1", "0", str(workdir)]
    return subprocess.Popen(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _lines_until(proc: subprocess.Popen, pred: Any, log: list[str]) -> str:
    """Read the worker's output until a line satisfies ``pred``; fail if it ends first."""
    for line in proc.stdout:
        log.append(line)
        if pred(line):
            return line
    raise AssertionError("worker ended before the awaited line:\n" + "".join(log[-40:]))


def _step_line(min_step: int, latest: int) -> Any:
    def pred(line: str) -> bool:
        p = line.split()
        return p[:1] == ["step"] and int(p[1]) >= min_step and p[5] == str(latest)

    return pred


def _finish(proc: subprocess.Popen, log: list[str], timeout: float = 120) -> tuple[int, str]:
    """Wait for the worker and add the rest of its output to ``log``. The rest is read through
    ``proc.stdout`` itself: ``communicate()`` reads the pipe and misses the lines that
    ``_lines_until`` has already buffered."""
    rest: list[str] = []
    reader = threading.Thread(target=lambda: rest.append(proc.stdout.read()), daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(10)
        raise AssertionError(
            f"worker still running after {timeout} s:\n{''.join(log)}{''.join(rest)}"
        ) from None
    reader.join(10)
    log.extend(rest)
    return proc.returncode, "".join(log)


def _digests(text: str) -> dict[int, str]:
    out = {}
    for line in text.splitlines():
        p = line.split()
        if p[:1] == ["step"]:
            out[int(p[1])] = p[3]
    return out


def _reference_digests(steps: int) -> dict[int, str]:
    """An uninterrupted run's digest after each step, computed here."""
    app, out = _app(), {}
    for step in range(1, steps + 1):
        train_step(app, step, 1)
        out[step] = digest(app)
    return out


def _load_digest(root: Path) -> tuple[int | None, str]:
    app = _app()
    with Checkpointer(root) as ck:
        step = ck.load_latest({"app": app})
    return step, digest(app)


@pytest.mark.slow
def test_sigterm_mid_training_commits_a_final_checkpoint(tmp_path: Path) -> None:
    proc, log = _spawn(tmp_path / "run", every="5"), []
    _lines_until(proc, _step_line(7, 5), log)  # step 5 is committed and training goes on
    proc.send_signal(signal.SIGTERM)
    rc, text = _finish(proc, log)
    assert rc == 0, text
    final = int(next(ln for ln in text.splitlines() if ln.startswith("preempted")).split()[1])
    assert final >= 7
    digests = _digests(text)
    root = tmp_path / "run" / "ckpt"
    step, loaded = _load_digest(root)
    assert step == final and loaded == digests[final]

    # Restarted, the run continues exactly as an uninterrupted one.
    resumed, rlog = _spawn(tmp_path / "run", every="5", max_steps=str(final + 3)), []
    rc, rtext = _finish(resumed, rlog)
    assert rc == 0, rtext
    assert f"resumed {final}" in rtext
    ref = _reference_digests(final + 3)
    assert _digests(rtext)[final + 3] == ref[final + 3]
    assert digests[final] == ref[final]


@pytest.mark.slow
def test_second_signal_during_the_final_save_keeps_the_previous(tmp_path: Path) -> None:
    # The first commit goes through; the final save's commit hangs until the second signal.
    proc, log = _spawn(tmp_path, every="5", block_after="1"), []
    _lines_until(proc, _step_line(6, 5), log)
    proc.send_signal(signal.SIGTERM)
    # Under load the step-5 commit can land late, after the next save's commit already blocked:
    # that blocked save is then the one the final checkpoint waits for.
    if not any(ln.startswith("finish blocked") for ln in log):
        _lines_until(proc, lambda ln: ln.startswith("finish blocked"), log)
    proc.send_signal(signal.SIGTERM)
    rc, text = _finish(proc, log)
    assert rc == 143, text
    root = tmp_path / "ckpt"
    step, loaded = _load_digest(root)
    assert step == 5 and loaded == _digests(text)[5]
    assert len([p for p in root.iterdir() if p.name.startswith("step_")]) == 2


@pytest.mark.slow
def test_expired_deadline_keeps_the_previous(tmp_path: Path) -> None:
    proc, log = _spawn(tmp_path, every="5", block_after="1", deadline="2"), []
    _lines_until(proc, _step_line(6, 5), log)
    proc.send_signal(signal.SIGTERM)
    rc, text = _finish(proc, log)
    assert rc == 143 and "finish blocked" in text, text
    step, loaded = _load_digest(tmp_path / "ckpt")
    assert step == 5 and loaded == _digests(text)[5]


@pytest.mark.slow
def test_a_signal_taken_by_another_thread_reaches_a_loop_blocked_on_a_hung_save(
    tmp_path: Path,
) -> None:
    # Step 10's commit hangs, so the save at step 15 waits for it without end. The SIGTERM's C
    # handler runs on another thread once the main thread sleeps in that wait: Python runs the
    # handler on the main thread only, when it next runs bytecode. A wait with no timeout never
    # lets it (CI hung so once: the signal had landed just before the main thread blocked).
    proc, log = _spawn(tmp_path, every="5", block_after="1", deadline="2", thread_signal="15"), []
    _lines_until(proc, lambda ln: ln.startswith("signalling from a thread"), log)
    rc, text = _finish(proc, log, timeout=60)
    assert rc == 143 and "finish blocked" in text, text
    assert "signal 15: checkpointing" in text, text
    step, loaded = _load_digest(tmp_path / "ckpt")
    assert step == 5 and loaded == _digests(text)[5]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_agree_on_preemption_and_resume(tmp_path: Path, monkeypatch: Any) -> None:
    # Only rank 1 gets the signal (at step 7); both ranks must save step 7 and stop there.
    monkeypatch.setenv("CK_EVERY", "5")
    monkeypatch.setenv("CK_SELF_SIGNAL", "1:7")
    results = launch("train", tmp_path / "run", script=WORKER, timeout=120)
    check_all_ok(results)
    assert [r.report["ended"] for r in results] == ["preempted 7", "preempted 7"]
    monkeypatch.delenv("CK_SELF_SIGNAL")
    monkeypatch.setenv("CK_MAX_STEPS", "9")
    resumed = launch("train", tmp_path / "run", script=WORKER, timeout=120)
    check_all_ok(resumed)
    assert [r.report["resumed"] for r in resumed] == [7, 7]
    # Both ranks see the same batches, so the uninterrupted two-rank run (mean of equal
    # gradients) is bit for bit the one-process run.
    ref = _reference_digests(9)
    assert [r.report["digests"]["7"] for r in results] == [ref[7]] * 2
    assert [r.report["digests"][s] for r in resumed for s in ("8", "9")] == [ref[8], ref[9]] * 2


@pytest.mark.slow
@pytest.mark.multiprocess
def test_an_error_on_rank_0_alone_is_raised_by_every_rank_at_the_same_step(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Rank 0's ``latest`` cannot be written (a directory stands there): its error was raised
    there alone, before the preemption vote, so a loop that caught it had its ranks voting one
    step apart and the last vote waited for good. Every rank raises it at the same step now
    (rank 1 naming rank 0), and the loop that goes on saves and finishes on both."""
    monkeypatch.setenv("CK_EVERY", "5")
    monkeypatch.setenv("CK_MAX_STEPS", "15")
    monkeypatch.setenv("CK_BREAK_LATEST", "5")
    results = launch("train", tmp_path / "run", script=WORKER, timeout=120)
    check_all_ok(results)
    assert [r.report["ended"] for r in results] == ["finished", "finished"]
    raised = [r.report["raised"] for r in results]
    assert len(raised[0]) == 1 and list(raised[0]) == list(raised[1]), raised
    (first,) = raised[0].values()
    assert first.startswith(("IsADirectoryError", "OSError")), first
    (other,) = raised[1].values()
    assert other.startswith("CheckpointSaveError") and "rank(s) [0]" in other, other
    ck = tmp_path / "run" / "ckpt"
    assert (ck / "latest").read_text().strip() == "15"
    assert _committed(ck, 15)
