"""``JobThreads`` (the copy workers, a writer's planning thread): jobs run on a fixed set of
named threads, an error in a job is logged and does not end its worker, and shutdown runs what
was queued before it ends."""

from __future__ import annotations

import logging
import threading

import pytest

from dcp_datastates._concurrency.workers import JobThreads


def test_jobs_run_on_the_named_workers_and_shutdown_runs_the_queued_ones() -> None:
    workers = JobThreads(2, "datastates-copy")
    gate = threading.Event()
    ran: list[tuple[int, str]] = []
    lock = threading.Lock()

    def job(i: int) -> None:
        gate.wait(30)
        with lock:
            ran.append((i, threading.current_thread().name))

    for i in range(20):
        workers.submit(job, i)
    gate.set()  # all 20 queued before any could finish
    workers.shutdown()
    assert sorted(i for i, _ in ran) == list(range(20))
    assert {name for _, name in ran} <= {"datastates-copy_0", "datastates-copy_1"}
    assert not [t for t in threading.enumerate() if t.name.startswith("datastates-copy_")]
    with pytest.raises(RuntimeError, match="after shutdown"):
        workers.submit(job, 99)


def test_an_error_in_a_job_is_logged_and_the_worker_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    workers = JobThreads(1, "datastates-copy")
    done = threading.Event()

    def bad() -> None:
        raise ValueError("a broken job")

    with caplog.at_level(logging.ERROR, logger="dcp_datastates._concurrency.workers"):
        workers.submit(bad)
        workers.submit(done.set)  # the same (only) worker runs the next job
        assert done.wait(30)
        workers.shutdown()
    assert "a job failed" in caplog.text and "a broken job" in caplog.text


def test_no_thread_starts_before_the_first_job() -> None:
    before = {t.ident for t in threading.enumerate()}
    workers = JobThreads(3, "datastates-idle")
    assert {t.ident for t in threading.enumerate()} == before
    workers.shutdown()  # nothing to end
    with pytest.raises(ValueError, match="at least 1"):
        JobThreads(0, "x")


def test_shutdown_without_wait_returns_while_a_job_runs_and_the_thread_then_ends() -> None:
    """A writer collected without ``close()`` shuts its planning thread down from inside the
    garbage collector: that must not wait for a job in flight, and the job still completes."""
    workers = JobThreads(1, "datastates-plan-test")
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def job() -> None:
        started.set()
        release.wait(30)
        finished.set()

    workers.submit(job)
    assert started.wait(30)
    workers.shutdown(wait=False)  # returns although the job is still waiting
    assert not finished.is_set()
    with pytest.raises(RuntimeError, match="after shutdown"):
        workers.submit(job)
    release.set()
    (thread,) = [t for t in threading.enumerate() if t.name == "datastates-plan-test_0"]
    thread.join(30)
    assert finished.is_set() and not thread.is_alive()
