"""A calibration's time budget (`Budget`): `calibrate` (`hispec.latency.measure`) does less work rather than run
past it, and records what it left out.

Contract: `Budget(max_seconds)` starts its clock (`hispec.timing.now`, synchronised) when made; None means no
limit. The steps of a calibration share it by cumulative deadlines (`STEPS`: a step may use what the steps before it
left over, up to its own share of the total); before each unit of work a step asks `fits(step, estimate)` (or
`units(step, each, wanted)` for repeated units) and notes with `skip(what, detail)` what it did not do; `report()`
is the record a `Calibration` keeps (`budget`: the limit, the seconds spent, what was skipped). A calibration cut
this way is still complete: fewer prompts, repeats or decoder runs make its figures noisier, never missing.
"""

from __future__ import annotations

import math

from .. import timing

DEFAULT_MAX_SECONDS = 300.0  # hispec-bench / hispec-export --calibration-max-seconds

# cumulative share of the budget by which each step should be done: greedy answers, acceptance counting, unit
# costs, the decoder's own draft step (the n-gram choice after it is host arithmetic and always runs)
STEPS = {"answers": 0.45, "acceptance": 0.6, "costs": 0.9, "decoder": 1.0}


class Budget:
    """Wall seconds a calibration may take, shared by its steps (see the module docstring)."""

    def __init__(self, max_seconds: float | None = DEFAULT_MAX_SECONDS, device=None):
        if max_seconds is not None and not max_seconds > 0:
            raise ValueError(f"max_seconds must be > 0 (or None: no limit), got {max_seconds!r}")
        self.max_seconds, self.device = max_seconds, device
        self.skipped: dict = {}
        self.start = timing.now(device)

    def elapsed(self) -> float:
        return timing.now(self.device) - self.start

    def left(self, step: str) -> float:
        """Seconds until `step`'s deadline (inf without a limit; <= 0 once it passed)."""
        if self.max_seconds is None:
            return math.inf
        return STEPS[step] * self.max_seconds - self.elapsed()

    def fits(self, step: str, estimate: float) -> bool:
        """Whether a unit of work of `estimate` seconds still ends before `step`'s deadline."""
        return estimate <= self.left(step)

    def units(self, step: str, each: float, wanted: int, least: int = 1) -> int:
        """How many units of `each` seconds fit before `step`'s deadline: between `least` and `wanted`."""
        left = self.left(step)
        if math.isinf(left):
            return wanted
        return max(least, min(wanted, int(left // each) if each > 0 else wanted))

    def skip(self, what: str, detail) -> None:
        self.skipped[what] = detail

    def report(self) -> dict:
        return {"max_seconds": self.max_seconds, "seconds": round(self.elapsed(), 3), "skipped": dict(self.skipped)}
