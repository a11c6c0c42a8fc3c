"""A signal whose C handler runs on another thread while the main thread sleeps in a wait.

That is what the kernel does when the main thread cannot take a process's signal, and what a
signal that lands in the last instant before the main thread's wait amounts to: Python runs the
handler on the main thread only, once that thread runs bytecode again, so a wait with no timeout
would keep the handler from ever running. Import it like ``conftest``.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable


def main_thread_sleeps() -> bool:
    """The main thread is parked in the kernel (state S) inside a Python-level ``wait``."""
    main = threading.main_thread()
    frame = sys._current_frames().get(main.ident)
    with open(f"/proc/self/task/{main.native_id}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    return state == "S" and frame is not None and frame.f_code.co_name == "wait"


def signal_from_a_thread_once_main_sleeps(
    signum: int, then: Callable[[], None] | None = None
) -> threading.Thread:
    """Start a thread that waits until the main thread sleeps, sends ``signum`` to itself (not
    to the process) and then calls ``then``."""

    def run() -> None:
        # Polled: a thread's scheduler state is nobody's event to wait on.
        while not main_thread_sleeps():
            threading.Event().wait(0.01)
        signal.pthread_kill(threading.get_ident(), signum)
        if then is not None:
            then()

    thread = threading.Thread(target=run, name="signaller", daemon=True)
    thread.start()
    return thread
