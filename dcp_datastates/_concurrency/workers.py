"""``JobThreads``: a fixed set of threads running jobs from one queue; the scheduler's copy
workers and a writer's planning thread.

A ``ThreadPoolExecutor`` did this before, and every job paid for a ``Future`` nobody read (a
``Condition`` made, entered on start and on the result, and notified), a work item and the
executor's idle-thread bookkeeping: on the train scenario's state (129 pieces per save) about
3.5 ms of process CPU per save on the scheduler and copy threads (112 against 115.6 ms), CPU
that competes with the training. For the planning thread the submit is on the caller's thread,
inside ``async_save``: with caches cold after a save (the flush moved the state through them)
``ThreadPoolExecutor.submit`` took 30-40 us of the 0.6 ms the caller is blocked at 99 tensors, a
``SimpleQueue.put`` a fraction of that. Jobs here report their own outcome
(``session.copied``, ``session.plan_failed``), so a job is a function and its arguments on a
``SimpleQueue``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class JobThreads:
    """``count`` threads named ``{name}_{i}``, started with the first job; :meth:`shutdown`
    runs the queued jobs, then ends the threads (and waits for them)."""

    def __init__(self, count: int, name: str) -> None:
        if count < 1:
            raise ValueError(f"{name}: threads must be at least 1, got {count}")
        self._count = count
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``fn(*args)``; an error it raises is logged (jobs report their own)."""
        if self._closed:
            raise RuntimeError(f"{self._name}: submit after shutdown")
        if not self._threads:
            self._start()
        self._jobs.put((fn, args))

    def start(self) -> None:
        """Start the threads now rather than with the first job (``warm_up``: a thread's start
        waits for it to run, 2-9 ms on a busy 2-core machine); none after ``shutdown``."""
        if not self._closed:
            self._start()

    def _start(self) -> None:
        with self._lock:
            if self._threads:
                return
            for i in range(self._count):
                # Daemons: the scheduler's exit handler (scheduler._stop_at_exit) shuts the copy
                # workers down before the interpreter finalizes, and a planning thread serves
                # the non-daemon save threads the interpreter joins at exit.
                t = threading.Thread(target=self._work, name=f"{self._name}_{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args = job
            try:
                fn(*args)
            except BaseException:  # never let an error end a worker
                logger.exception("%s: a job failed", threading.current_thread().name)
            # Not held while waiting for the next job: the job's session would live on.
            job = fn = args = None

    def shutdown(self, wait: bool = True) -> None:
        """Run the queued jobs, then end the threads; ``wait``: and wait for them (never for
        the calling thread itself)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        for t in threads if wait else ():
            if t is not threading.current_thread():
                t.join()
