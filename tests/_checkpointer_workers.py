"""A training loop with a :class:`Checkpointer`, run as a real process by the checkpointer tests.

``python _checkpointer_workers.py train RANK WORLD PORT DIR`` (the arguments of
``_dist_workers.launch``; WORLD 1 runs without a process group). Settings come from the
environment (``CK_*``, see ``_settings``). Every step prints one line
``step N digest D latest L`` (flushed), so a test can wait on the output instead of sleeping;
the rank's report (``DIR/rank{RANK}.json``, written by ``_dist_workers.run_worker``) lists the
digests per step and how the run ended. A preemption's ``SystemExit`` ends the run with exit
status 0 (the checkpointer's ``preemption_exit_code``), as a real loop's would.
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_workers import _init, run_worker  # noqa: E402
from _signal_util import signal_from_a_thread_once_main_sleeps  # noqa: E402

from dcp_datastates import DataStatesWriter  # noqa: E402
from dcp_datastates.checkpointers.checkpointer import Checkpointer, step_dir_name  # noqa: E402


def say(line: str) -> None:
    """One line to the test, in one write: print() writes the text and its newline apart, so a
    line from the save thread could land inside the training loop's (the test reads lines)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class App(Stateful):
    """Model, optimizer and the loop's own counter: what a plain loop checkpoints."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim, self.extra = model, optim, {"seen": 0}

    # get_state_dict gives a fresh optimizer its state entries, so that DCP has a target for
    # them when loading (a fresh optimizer's own state_dict() has none).
    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd, **self.extra}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
        )
        self.extra["seen"] = sd["seen"]


def digest(app: App) -> str:
    h = hashlib.sha256()
    for t in list(app.model.state_dict().values()):
        h.update(t.detach().numpy().tobytes())
    for st in app.optim.state_dict()["state"].values():
        for v in st.values():
            h.update(v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    h.update(str(app.extra["seen"]).encode())
    return h.hexdigest()[:16]


def train_step(app: App, step: int, world: int) -> None:
    g = torch.Generator().manual_seed(step)  # the batch of a step depends only on the step
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(app.model(x), y)
    loss.backward()
    if world > 1:
        for p in app.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    app.optim.step()
    app.optim.zero_grad()
    app.extra["seen"] += 8


def _names_step(checkpoint_id: str, name: str) -> bool:
    """Whether a save goes to step ``name``: its directory, or beside it (a step saved again
    is written to ``step_00000002.replacing``, then swapped in)."""
    return os.path.basename(checkpoint_id.rstrip("/")).split(".")[0] == name


class GatedWriter(DataStatesWriter):
    """Holds the commit of one checkpoint until the test opens the gate."""

    def __init__(self, *args: Any, gated_step: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.gated = step_dir_name(gated_step)
        self.entered, self.gate = threading.Event(), threading.Event()

    def finish(self, metadata: Any, results: Any) -> None:
        if _names_step(self.checkpoint_id, self.gated):
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        super().finish(metadata, results)


class FailingWriter(DataStatesWriter):
    """The commit of one checkpoint fails, as a full disk at commit time would."""

    def __init__(self, *args: Any, failing_step: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.failing = step_dir_name(failing_step)

    def finish(self, metadata: Any, results: Any) -> None:
        if _names_step(self.checkpoint_id, self.failing):
            raise OSError(28, "injected: no space left at commit")
        super().finish(metadata, results)


def damage(step_dir: Path) -> None:
    """Flip one byte in the middle of every data file of a checkpoint (its records' crc32c
    then fail on load), as a bad disk or a torn copy would."""
    for path in sorted(step_dir.glob("*.distcp")):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


class PickyApp(App):
    """Refuses to load the state saved after ``refused_seen`` samples: a failure after DCP's
    collectives (a ``Stateful``'s own ``load_state_dict``), which DCP tells no other rank."""

    def __init__(self, *args: Any, refused_seen: int | None = None) -> None:
        super().__init__(*args)
        self.refused_seen = refused_seen

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["seen"] == self.refused_seen:
            raise ValueError(f"injected: this rank refuses the state after {sd['seen']} samples")
        super().load_state_dict(sd)


class BlockingWriter(DataStatesWriter):
    """Fault injection: the commit of every save after the first ``free`` ones never ends."""

    free = 1

    def finish(self, metadata: Any, results: Any) -> None:
        type(self).free -= 1
        if type(self).free < 0:
            say("finish blocked")
            threading.Event().wait()
        super().finish(metadata, results)


def _settings() -> dict[str, Any]:
    e = os.environ
    return {
        "every": int(e.get("CK_EVERY", "5")),
        "keep": int(e.get("CK_KEEP", "0")),
        "max_steps": int(e.get("CK_MAX_STEPS", "100000")),
        "deadline": float(e.get("CK_DEADLINE", "60")),
        "block_after": int(e.get("CK_BLOCK_AFTER", "-1")),  # commits allowed before blocking
        "self_signal": e.get("CK_SELF_SIGNAL", ""),  # "RANK:STEP": that rank SIGTERMs itself
        # STEP: before that step's save, a thread waits until the main thread sleeps, then
        # SIGTERMs itself (not the process): the signal's C handler runs on that thread.
        "thread_signal": int(e.get("CK_THREAD_SIGNAL", "-1")),
        # STEP: rank 0 makes ``latest`` a directory before that step's save, so that its own
        # bookkeeping fails (rank 0's alone); the loop catches what maybe_save raises, records
        # it, and rank 0 then removes the directory.
        "break_latest": int(e.get("CK_BREAK_LATEST", "-1")),
    }


def _train(rank: int, world: int, port: int, workdir: Path) -> dict[str, Any]:
    cfg = _settings()
    if world > 1:
        _init(rank, world, port)
    report: dict[str, Any] = {"digests": {}, "ended": "running", "raised": {}}
    model = Model()
    app = App(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    root = workdir / "ckpt"
    writer = None
    if cfg["block_after"] >= 0:
        BlockingWriter.free = cfg["block_after"]
        writer = BlockingWriter(root)
    ck = Checkpointer(
        root,
        every_steps=cfg["every"],
        keep_latest_k=cfg["keep"],
        preemption_deadline_s=cfg["deadline"],
        writer=writer,
    )
    try:
        start = ck.load_latest({"app": app})
        report["resumed"] = start
        say(f"resumed {start} digest {digest(app)}")
        step = start or 0
        while step < cfg["max_steps"]:
            step += 1
            train_step(app, step, world)
            report["digests"][step] = digest(app)
            if cfg["self_signal"] == f"{rank}:{step}":
                os.kill(os.getpid(), signal.SIGTERM)
            try:
                latest = ck.latest_step()
            except IsADirectoryError:  # CK_BREAK_LATEST
                latest = "unreadable"
            line = f"step {step} digest {report['digests'][step]} latest {latest}"
            say(line)
            if step == cfg["thread_signal"]:
                say("signalling from a thread")
                signal_from_a_thread_once_main_sleeps(signal.SIGTERM)
            if rank == 0 and step == cfg["break_latest"]:
                (root / "latest").unlink(missing_ok=True)
                (root / "latest").mkdir(parents=True)
                (root / "latest" / "x").write_text("a directory where the file goes")
            try:
                ck.maybe_save(step, {"app": app})
            except Exception as exc:
                if cfg["break_latest"] < 0:
                    raise
                report["raised"][step] = f"{type(exc).__name__}: {exc}"
                say(f"raised at {step}: {type(exc).__name__}")
                if rank == 0:
                    (root / "latest" / "x").unlink()
                    (root / "latest").rmdir()
            except SystemExit:  # the final checkpoint is committed: the run ends here (exit 0)
                report["ended"] = f"preempted {step}"
                say(f"preempted {step}")
                break
        else:
            report["ended"] = "finished"
        ck.close()
    finally:
        if world > 1:
            dist.destroy_process_group()
    return report


def _resume(rank: int, world: int, port: int, workdir: Path) -> dict[str, Any]:
    """Save steps 1 to 3; damage step 3's data and have rank 1 alone refuse step 2's state;
    resume. Every rank must load step 1 (DCP reports the first failure to every rank itself,
    the second to none)."""
    _init(rank, world, port)
    try:
        model = Model()
        app = App(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        root = workdir / "ckpt"
        ck = Checkpointer(root, every_steps=1, preemption_signals=())
        digests = {}
        for step in (1, 2, 3):
            train_step(app, step, world)
            ck.maybe_save(step, {"app": app})
            digests[step] = digest(app)
        ck.wait()
        dist.barrier()  # every rank's save of step 3 is committed and `latest` names it
        if rank == 0:
            damage(root / step_dir_name(3))
        dist.barrier()
        fresh_model = Model()
        fresh = PickyApp(
            fresh_model,
            torch.optim.AdamW(fresh_model.parameters(), lr=1e-2),
            refused_seen=16 if rank == 1 else None,  # step 2's state (8 samples a step)
        )
        resumed = ck.load_latest({"app": fresh})
        ck.close()
        return {"resumed": resumed, "digest": digest(fresh), "digests": digests}
    finally:
        dist.destroy_process_group()


def _scenario(scenario: str, rank: int, world: int, port: int, workdir: Path) -> dict[str, Any]:
    if scenario == "resume":
        return _resume(rank, world, port, workdir)
    if scenario != "train":
        raise ValueError(f"unknown scenario {scenario!r}")
    return _train(rank, world, port, workdir)


if __name__ == "__main__":
    sys.exit(run_worker(sys.argv[1:], _scenario))
