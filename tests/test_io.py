"""hispec.io helpers that are not covered where they are used: the heap trimmer."""

import ctypes.util
import sys

import pytest

from hispec.io import HeapTrimmer


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_heap_trimmer_trims_at_most_once_per_interval(monkeypatch):
    calls = []
    clock = _Clock()
    trim = HeapTrimmer(interval_s=10.0, clock=clock)
    monkeypatch.setattr(trim, "_trim", lambda pad: calls.append(pad))
    assert not trim()  # nothing has passed since it was made
    clock.now = 9.9
    assert not trim() and calls == []
    clock.now = 10.0
    assert trim() and calls == [0]
    clock.now = 15.0
    assert not trim()  # the interval counts from the last trim
    assert trim(force=True) and calls == [0, 0] and trim.trims == 2
    clock.now = 24.9
    assert not trim()
    clock.now = 25.0
    assert trim() and trim.trims == 3


def test_heap_trimmer_is_a_no_op_without_malloc_trim(monkeypatch):
    trim = HeapTrimmer(interval_s=0.0)
    monkeypatch.setattr(trim, "_trim", None)
    assert not trim.available and not trim(force=True) and trim.trims == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or "musl" in (ctypes.util.find_library("c") or ""),
                    reason="glibc only")
def test_heap_trimmer_calls_glibc_for_real():
    trim = HeapTrimmer(interval_s=0.0)
    assert trim.available
    blocks = [bytearray(100_000 + i) for i in range(64)]  # some heap churn to hand back
    del blocks[::2]
    assert trim() and trim.trims == 1
