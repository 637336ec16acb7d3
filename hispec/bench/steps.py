"""A run of named steps whose results outlive the process: each step's record is one JSON line appended and
fsync'ed the moment the step ends, a deadline interrupts a step still running (SIGALRM), and SIGTERM ends the
running step as `terminated` instead of killing the process mid-write. `tools/gpu_check.py` is the user: on a lent
machine with minutes of budget, whatever finished before the budget or a `timeout` ran out must survive.

Why not a library: `signal.setitimer` and `os.fsync` are the whole mechanism; the job runners that do this (e.g.
submitit, accelerate's launchers) work at the process level, not per step inside one process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from pathlib import Path

__all__ = ["StepTimeout", "Terminated", "append_record", "deadline", "on_sigterm"]


class StepTimeout(BaseException):
    """The run's deadline passed while a step was running (a BaseException: library code catching Exception
    must not swallow it)."""


class Terminated(BaseException):
    """SIGTERM arrived (e.g. `timeout` ending the run): the step is recorded, the rest skipped, the summary written."""


def append_record(path: Path, record: dict) -> None:
    """One JSON line, appended, flushed and fsync'ed: it survives the process being killed right after."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def deadline(seconds: float | None, why: str = "the time budget ran out"):
    """Raise StepTimeout in the block once `seconds` have passed (SIGALRM; only in the main thread and only when
    no other interval timer is armed, else the block runs unbounded and the budget is checked between steps)."""
    usable = (seconds is not None and hasattr(signal, "setitimer") and
              threading.current_thread() is threading.main_thread() and
              signal.getitimer(signal.ITIMER_REAL)[0] == 0)
    if not usable:
        yield
        return
    armed = [True]

    def on_alarm(signum, frame):
        if armed[0]:
            armed[0] = False
            raise StepTimeout(f"{why} after {seconds:.1f} s in this step")

    old = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, max(float(seconds), 0.001))
        yield
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def on_sigterm():
    """Within the block SIGTERM raises Terminated in the main thread (then the previous handler is back)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
