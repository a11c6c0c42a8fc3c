"""The load's thread pool: region reads (urgent) run before new records start."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable


class Runner:
    """A pool that runs urgent jobs (region reads) before others; the first error wins."""

    def __init__(self, workers: int) -> None:
        self._queue: queue.PriorityQueue[tuple[int, int, Callable[[], None] | None]] = (
            queue.PriorityQueue()
        )
        self._order = itertools.count()
        self._lock = threading.Condition()
        self._pending = 0
        self.error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._work, name=f"datastates-read_{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: Callable[[], None], *, urgent: bool) -> None:
        with self._lock:
            self._pending += 1
        self._queue.put((0 if urgent else 1, next(self._order), job))

    def _work(self) -> None:
        while True:
            job = self._queue.get()[2]
            if job is None:
                return
            try:
                if self.error is None:
                    job()
            except BaseException as exc:
                with self._lock:
                    if self.error is None:
                        self.error = exc
            finally:
                with self._lock:
                    self._pending -= 1
                    if not self._pending:
                        self._lock.notify_all()
            job = None  # not held while waiting for the next (what it read is the caller's)

    def join(self) -> None:
        """Wait for every job (and the jobs they submitted); raise the first error."""
        with self._lock:
            self._lock.wait_for(lambda: not self._pending)
        for _ in self._threads:
            self._queue.put((2, next(self._order), None))
        for t in self._threads:
            t.join()
        if self.error is not None:
            raise self.error


__all__ = ["Runner"]
