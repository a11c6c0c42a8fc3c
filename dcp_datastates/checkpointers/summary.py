"""One line per committed save of a ``Checkpointer``, for a user's log (the writer's
``SaveStats`` hold the figures; its own summary names no step).

May import: the leaves.
"""

from __future__ import annotations

from ..stats import SaveStats

_UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def summary_line(step: int, stats: SaveStats) -> str:
    """One line about a committed save, for a user's log: ``rank 0: step 100 committed:
    1.2 GB written by this rank, blocked 3 ms, safe to change after 410 ms, durable after
    2.10 s`` (this rank's figures, from the start of the save)."""

    def size(n: int) -> str:
        return next((f"{n / b:.1f} {u}" for u, b in _UNITS if n >= b), f"{n} B")

    def secs(t: float | None) -> str:
        return "-" if t is None else f"{t * 1e3:.0f} ms" if t < 1 else f"{t:.2f} s"

    return (
        f"rank {stats.rank}: step {step} committed: {size(stats.bytes_written)} written by this "
        f"rank, blocked {secs(stats.blocked_s)}, safe to change after "
        f"{secs(stats.safe_to_mutate_s)}, durable after {secs(stats.durable_s)}"
    )
