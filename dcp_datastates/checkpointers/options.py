"""Frozen, validated options of :class:`~dcp_datastates.Checkpointer` (its own, not the
writer's): checked at construction, so that ``every_steps=2.5`` or ``keep_latest_k="3"`` fails
there naming itself instead of saving every 5 steps or failing one save later.

May import: the leaves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..options import _check_int

#: Exit status when a second signal or the deadline ends the process before the final commit.
ABORT_EXIT_CODE = 143


@dataclass(frozen=True, kw_only=True)
class CheckpointerOptions:
    """When a :class:`~dcp_datastates.Checkpointer` saves, what it keeps and how it ends.

    Attributes:
        every_steps: ``maybe_save`` saves when ``step % every_steps == 0`` (an int, at least 1).
        keep_latest_k: Committed checkpoints to keep; ``0`` keeps all.
        preemption_deadline_s: Seconds from the first signal to the final commit (above 0).
        exit_on_preemption: Raise ``SystemExit(preemption_exit_code)`` after the final save.
        preemption_exit_code: The exit status then (0 to 255).
        abort_exit_code: The exit status when a second signal or the deadline ends the process
            before the final commit (0 to 255).
    """

    every_steps: int = 100
    keep_latest_k: int = 0
    preemption_deadline_s: float = 120.0
    exit_on_preemption: bool = True
    preemption_exit_code: int = 0
    abort_exit_code: int = ABORT_EXIT_CODE

    def __post_init__(self) -> None:
        _check_int("every_steps", self.every_steps, low=1)
        _check_int("keep_latest_k", self.keep_latest_k, low=0, hint=" (0 keeps all)")
        deadline = self.preemption_deadline_s
        if (
            isinstance(deadline, bool)
            or not isinstance(deadline, (int, float))
            or not 0 < deadline < math.inf
        ):
            raise ValueError(
                f"preemption_deadline_s={deadline!r} must be a number of seconds above 0"
            )
        if not isinstance(self.exit_on_preemption, bool):
            raise ValueError(
                f"exit_on_preemption={self.exit_on_preemption!r} must be True or False"
            )
        _check_int("preemption_exit_code", self.preemption_exit_code, low=0, high=255)
        _check_int("abort_exit_code", self.abort_exit_code, low=0, high=255)
