"""What a generation call returns: its tokens (`GenerationOutput`) and its counters (`GenerationStats`, one
`LevelStats` per level of the hierarchy).

Plain dataclasses, filled in by the round machinery (`hispec.decoding.rounds`) and read by callers, the bench and
the server; `as_dict()` gives their JSON form. Nothing here computes tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

@dataclass
class LevelStats:
    """Counters of one level, summed over the batch."""

    name: str
    proposed: int = 0  # tokens the level below asked this level to verify (level 0: tokens it drafted)
    accepted: int = 0  # of those, accepted
    rejections: int = 0  # row verifications that rejected one of their proposals (i.i.d. MLE: acc / (acc + rej))
    proposals: int = 0  # level 0: row draft steps that proposed anything (an n-gram may find nothing)
    lookups: int = 0  # level 0 `ngram|EXIT`: of those, the ones the n-gram lookup served (the rest: the exit)
    gated: int = 0  # level 0 eagle3 with a draft gate: drafts computed but not proposed (below the gate)
    passes: int = 0  # batched passes (draft steps at level 0, verifications above)
    row_passes: int = 0  # the same, counted per participating row
    layer_evals: int = 0  # decoder-layer evaluations of real tokens in this level's range (+ its head layer)
    seconds: float = 0.0

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["acceptance"] = self.acceptance
        return d


@dataclass
class GenerationStats:
    """Counters summed over the batch: one `LevelStats` per level of the hierarchy (bottom-up, the full model last).
    The flat fields below are derived from them for the common two- and three-level strategies."""

    levels: list[LevelStats] = field(default_factory=lambda: [LevelStats("full")])
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    strategy: str = ""
    verification: str = "token"  # the sampling acceptance rule ("token" | "hsd"; greedy decoding uses neither)
    plain_row_rounds: int = 0  # auto: rounds in which a row decoded plainly (all its speculation switched off)
    lookup_only_row_rounds: int = 0  # auto, lookup-first: rounds in which a row drafted by the n-gram lookup alone
    row_rounds: int = 0  # auto: rounds summed over rows
    guarded_rounds: int = 0  # auto: batch rounds `_PlainGuard` decoded plainly although the rule chose to speculate

    @property
    def top(self) -> LevelStats:
        return self.levels[-1]

    @property
    def layer_evals(self) -> int:
        return sum(lv.layer_evals for lv in self.levels)

    @property
    def target_passes(self) -> int:
        return self.top.passes  # the prefill included

    @property
    def target_row_passes(self) -> int:
        return self.top.row_passes

    @property
    def tokens_per_target_pass(self) -> float:
        return self.new_tokens / max(self.target_row_passes, 1)

    @property
    def drafted(self) -> int:
        return self.levels[0].proposed if len(self.levels) > 1 else 0

    @property
    def accepted_at_target(self) -> int:
        return self.top.accepted

    @property
    def proposed_to_target(self) -> int:
        return self.top.proposed

    @property
    def accepted_at_verify(self) -> int:
        return sum(lv.accepted for lv in self.levels[1:-1])

    @property
    def proposed_to_verify(self) -> int:
        return sum(lv.proposed for lv in self.levels[1:-1])

    @property
    def verify_passes(self) -> int:
        return sum(lv.passes for lv in self.levels[1:-1])

    @property
    def verify_acceptance(self) -> float:
        return self.accepted_at_verify / max(self.proposed_to_verify, 1)

    @property
    def target_acceptance(self) -> float:
        return self.accepted_at_target / max(self.proposed_to_target, 1)

    @property
    def seconds(self) -> dict:
        """Wall seconds by stage: prefill, draft (level 0), verify (intermediate levels), target (the full model)."""
        K = len(self.levels) - 1
        return {"prefill": self.prefill_seconds,
                "draft": self.levels[0].seconds if K else 0.0,
                "verify": sum(lv.seconds for lv in self.levels[1:-1]),
                "target": self.top.seconds}

    def as_dict(self) -> dict:
        return {
            "strategy": self.strategy, "verification": self.verification, "new_tokens": self.new_tokens,
            "levels": [lv.as_dict() for lv in self.levels],
            "seconds": self.seconds, "layer_evals": self.layer_evals, "drafted": self.drafted,
            "tokens_per_target_pass": self.tokens_per_target_pass, "target_passes": self.target_passes,
            "target_row_passes": self.target_row_passes,
            "accepted_at_verify": self.accepted_at_verify, "proposed_to_verify": self.proposed_to_verify,
            "accepted_at_target": self.accepted_at_target, "proposed_to_target": self.proposed_to_target,
            "verify_acceptance": self.verify_acceptance, "target_acceptance": self.target_acceptance,
            "plain_row_rounds": self.plain_row_rounds, "lookup_only_row_rounds": self.lookup_only_row_rounds,
            "row_rounds": self.row_rounds,
            "guarded_rounds": self.guarded_rounds,
        }


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [B, P + N]: the prompt as given, then new tokens, padded after a row finishes
    stats: GenerationStats
    new_tokens: list[list[int]]  # per row, the generated tokens (through EOS / stop string)

