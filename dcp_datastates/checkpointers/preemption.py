"""A ``Checkpointer``'s preemption watch and its per-step vote (moved out of ``checkpointer.py``).

A signal only sets a flag (:class:`Preemption`); the checkpointer acts on it at the next
``maybe_save``, where every rank agrees in one all-reduce (:func:`agree`) that a preemption is
pending, which ranks hold an earlier save's error, and whether the step to save is committed
already. A watchdog bounds the final save by the deadline; a second signal or the expired
deadline ends the process at once (``os._exit``).

May import: the leaves.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import NamedTuple

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class Agreed(NamedTuple):
    """What the ranks agreed at one call (:func:`agree`)."""

    preempted: bool  # some rank saw a preemption
    failed: list[int]  # the ranks holding an earlier save's error
    replacing: bool  # rank 0 found the step to save committed already


def agree(group: dist.ProcessGroup | None, flag: bool, failed: bool, replacing: bool) -> Agreed:
    """One all-reduce on ``group`` (None: this process alone) of the three."""
    if group is None:
        return Agreed(flag, [0] if failed else [], replacing)
    t = torch.zeros(2 + dist.get_world_size(group), dtype=torch.uint8)
    t[0], t[1] = int(flag), int(replacing)
    t[2 + dist.get_rank(group)] = int(failed)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return Agreed(bool(t[0]), [int(r) for r in t[2:].nonzero().flatten().tolist()], bool(t[1]))


class Preemption:
    """The flag a signal sets, the final save's ``finished`` event, and the deadline's watchdog.

    Args:
        deadline_s: Time from the request to ``finished``; past it the process exits.
        abort_exit_code: The exit status then, and at a second signal.
        latest: The ``latest`` file, named in the log line.
    """

    def __init__(self, deadline_s: float, abort_exit_code: int, latest: str) -> None:
        self.deadline_s, self.abort_exit_code, self.latest = deadline_s, abort_exit_code, latest
        self.requested = threading.Event()
        self.finished = threading.Event()  # the final checkpoint is committed (or not needed)
        self.watchdog: threading.Thread | None = None

    def request(self) -> None:
        if not self.requested.is_set():
            self.requested.set()
            self.watchdog = threading.Thread(
                target=self._watch, name="dcp-datastates-preemption", daemon=True
            )
            self.watchdog.start()

    def on_signal(self, signum: int) -> None:
        if self.requested.is_set():
            logger.error("second signal %d during the preemption save: exiting now", signum)
            os._exit(self.abort_exit_code)
        logger.warning("signal %d: checkpointing at the next step, then exiting", signum)
        self.request()

    def _watch(self) -> None:
        if not self.finished.wait(self.deadline_s):
            logger.error(
                "preemption save not committed within %.1fs: exiting; %s still names the "
                "previous checkpoint",
                self.deadline_s,
                self.latest,
            )
            os._exit(self.abort_exit_code)
