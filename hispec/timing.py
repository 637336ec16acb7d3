"""Wall time that is right on any device: wait for the device's queued work before reading the clock.

Contract: `synchronize(device)` returns once the work queued on `device` is done (CUDA: `torch.cuda.synchronize`;
another accelerator: `torch.accelerator.synchronize` where this torch has it, else its own module's
`synchronize`); for the CPU, the meta device or None it does nothing, so CPU timings are what they were. `now(device)`
is the clock read after that wait, `Timer(device)` a context manager whose `seconds` is the synchronised wall time
of its block. Every timer whose seconds feed the latency model (`hispec.latency`), `GenerationStats`, `auto`'s plain
guard or the benchmark reads time through here: on a GPU kernels run asynchronously, and `time.perf_counter()` read
right after a call measures how long launching its kernels took, not their work.

`clock` (default `time.perf_counter`) is the clock every timer here reads; `device_type(device)` decides whether a
device needs a wait. Tests replace either (a fake clock; a CPU device taken for a CUDA one).
"""

from __future__ import annotations

import time

import torch

clock = time.perf_counter
_NO_QUEUE = (None, "cpu", "meta")  # device types whose work is done when the call returns


def device_type(device) -> str | None:
    """The type of `device` ("cpu", "cuda", ...; a torch.device, a string or an index), None for no device."""
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.type
    return torch.device(device).type


def synchronize(device=None) -> None:
    """Wait until the work queued on `device` is done; nothing to wait for on the CPU (or without a device)."""
    kind = device_type(device)
    if kind in _NO_QUEUE:
        return
    if kind == "cuda":
        torch.cuda.synchronize(device)
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        accelerator.synchronize(device)
        return
    getattr(torch, kind).synchronize()


def now(device=None) -> float:
    """`clock()` once the work queued on `device` is done."""
    synchronize(device)
    return clock()


class Timer:
    """`with Timer(device) as t: ...` -> `t.seconds`, the block's wall time with the device's work included."""

    __slots__ = ("device", "start", "seconds")

    def __init__(self, device=None):
        self.device, self.start, self.seconds = device, 0.0, 0.0

    def __enter__(self) -> "Timer":
        self.start = now(self.device)
        return self

    def __exit__(self, *exc) -> bool:
        self.seconds = now(self.device) - self.start
        return False
