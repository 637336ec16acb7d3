"""`auto`'s measured floor (`_PlainGuard`): a batch stops speculating where its own timed speculative rounds cost
more wall time per committed token than its own plain rounds.

Contract: `begin(run)` after the policy chose the round's gammas (it may zero them all: a plain round) and
`end(run)` after the round's last commit (it times the round on `clock`, replaceable, once the run's device has
finished its queued work: `hispec.timing.synchronize`, and counts the tokens committed). It changes only which rows
speculate, never how tokens are verified.
"""

from __future__ import annotations

import time

import torch

from .. import timing


class _PlainGuard:
    """`auto`'s measured floor: a batch does not keep speculating where its own speculative rounds, timed, cost more
    wall time per committed token than its own plain rounds.

    The rule above prices rounds with the calibration's single-row pass costs (scaled by `Calibration.at_batch`);
    that holds for one row but not for every batch: a verification pass spans the widest row's proposal for every
    row, and its attention runs over each row's own cache, so on a CPU a batch of 16 can pay several times the
    predicted cost for the positions one speculating row adds (tools/research/batch_speed.py measured auto at 0.77x of
    plain rows at batch 16 with the rule alone). The guard does not model that; it measures it. Two arms, per run:
    `spec` (the rule's choice, whenever it speculates for any row) and `plain` (every row one token, which is `ar`).
    Each round's wall time from `begin` (after the rule chose) to `end` (after its last commit) and the tokens it
    committed go to the arm it ran, as sums decayed over the arm's own rounds (each new round of an arm weighs its
    earlier ones by DECAY: about its last 1 / (1 - DECAY) rounds count, so conditions that changed, a longer cache,
    another batch, fade out of the arm in use; the other arm, measured once per exploration, takes several
    explorations to move); an arm's cost is seconds / tokens. While both arms are measured the round runs the
    cheaper one, speculation while it costs at most MARGIN more per token, except that the other arm is measured
    again (one round) once EXPLORE times its last round's seconds have gone to the one in use; while `plain` is not
    yet measured, the round after the setup round (below) and WARM measured speculative rounds is plain. So
    exploring takes at most ~1/EXPLORE of the time, and a user ends up within MARGIN of plain decoding's speed where
    speculation loses (the setup and warm-up rounds aside), whatever the calibration predicted.
    The first speculative round after rows start (the run's start; rows joining a server's run: `joined`) runs
    but is not measured: it carries their one-time setup, which plain rounds never pay and later speculative rounds
    do not repeat (an EAGLE-3 drafter's pass over the whole prompt, its context). Measured, it made speculation
    look dear from the start: on a 769-token Spec-Bench summarisation prompt (SmolLM2 bf16, the shipped drafter,
    one thread) the first round took 103 ms for 1 token against 37-45 ms for later ones and 41 ms for a plain
    round, and the guard, comparing after two speculative rounds, decoded 47 of the prompt's 95 rounds plainly.
    Why per arm and why a margin: a speculative round's yield varies widely (a lookup copies 8 tokens or none; a
    tree round commits 1 token or 5), plain rounds cost the same every time, and only the arm in use is measured
    often. Decayed per round of either arm, a single exploring round outweighed every speculative round before it,
    and with no margin noise alone flipped batches to plain: on the demo checkpoint (SmolLM2 fp32, one thread) one
    Spec-Bench prompt ran 3 of 4 rounds plain where speculating throughout was 1.35x faster; over 10 prompts
    (hispec-bench, two runs) `auto` went from 1.05-1.07x to 1.10x of `ar` with this and the lookup-alone choice.

    Only which rows speculate changes (a plain round is the rule's own all-plain choice), never how tokens are
    verified: output is unchanged. `clock` is replaceable (tests use a cost model instead of wall time).

    Plain rounds are measured again only while they could win soon: while speculation's measured cost per token is
    above NEAR times plain's. Below it, plain rounds would have to get 1 / NEAR times cheaper per token for the choice
    to change, and their cost moves only with the context (dearer as it grows); speculation's own cost is measured
    every round, so where its yield falls towards plain's the explorations resume. Measured without NEAR (SmolLM2
    bf16, the 3.16M-token drafter's lookup-first tree, one Zen 4 core, 10 Spec-Bench prompts x 128 tokens):
    the explorations were 30 of the 40 plain rounds in ~650, and `auto` ran 7.5% slower than the same tree without
    them (1.92 against 2.07 tokens per verification).

    Until EVIDENCE speculative rounds are measured, speculation is judged by its rounds' capacity (one token per
    row plus every token the full model was asked to verify: what they would have committed had every proposal been
    accepted), not by what they committed: it yields early only where no yield could pay. A round's yield is
    heavy-tailed (a lookup copies 9 tokens, most rounds commit 1 or 2), so one or two rounds say little about it,
    while the price of a wrong early "plain" is ~EXPLORE rounds of plain decoding before speculation is looked at
    again. Measured on the demo checkpoint (SmolLM2 fp32, one Zen 4 core, 10 Spec-Bench prompts): one prompt's first
    measured round took 83 ms for 1 token against 61 ms for a plain one, and the guard decoded 36 of the next 37
    rounds plainly, 8.5 s for 128 tokens against 7.3 s with the guard off (4 of 10 calls so). Replayed
    through the guard (that run's rounds with the guard off, reshuffled into 300 calls; speculative rounds' costs
    scaled to move the break-even), judging the first rounds by capacity took `auto` from 1.85x to 1.86x of `ar`
    as measured (1.90x unguarded), from 1.38x to 1.43x with rounds 1.3x dearer (1.46x unguarded), and changed
    nothing where speculation loses (1.04x both at 2x dearer, 0.95x unguarded; 0.85x both at 10x, where the first
    round's capacity already loses)."""

    DECAY = 0.9  # per later round of the same arm
    EXPLORE = 16  # the arm not in use is measured again once EXPLORE of its rounds' time went to the other
    NEAR = 0.8  # ... the plain arm only while speculation costs more than NEAR x plain per token
    WARM = 1  # measured speculative rounds (after the unmeasured setup round) before the first plain measurement
    EVIDENCE = 4  # measured speculative rounds before their yield, not only their cost, can send the batch plain
    MARGIN = 0.15  # speculation yields to plain rounds only when measured dearer per token by more than this
    clock = staticmethod(time.perf_counter)

    def __init__(self):
        self.sec = {"spec": 0.0, "plain": 0.0}
        self.tok = {"spec": 0.0, "plain": 0.0}
        self.cap = 0.0  # the speculative rounds' capacity, decayed like `tok`: tokens had every proposal been accepted
        self.last = {"spec": None, "plain": None}  # per arm: (round, elapsed seconds) of its last measurement
        self.round_sec = {"spec": 0.0, "plain": 0.0}  # per arm: its last round's seconds
        self.spec_rounds = 0
        self.round = 0
        self.elapsed = 0.0  # seconds of every measured round
        self._open = None  # (arm, start time, committed tokens at the start)
        self.setup = True  # the next speculative round carries new rows' one-time setup: not measured

    def joined(self) -> None:
        """Rows joined the run (continuous batching): their setup falls in the next speculative round."""
        self.setup = True

    def _now(self, run) -> float:
        """`clock()` once the run's device has done its queued work (a GPU's kernels run asynchronously)."""
        timing.synchronize(run.device)
        return self.clock()

    def cost(self, arm: str) -> float | None:
        """Measured seconds per committed token of `arm` (None: not measured yet)."""
        return self.sec[arm] / self.tok[arm] if self.tok[arm] > 0 else None

    def _arm(self, speculating: bool) -> str:
        if not speculating:
            return "plain"
        spec, plain = self.cost("spec"), self.cost("plain")
        if plain is None:
            return "plain" if self.spec_rounds >= self.WARM else "spec"
        if spec is None:
            return "spec"
        if self.spec_rounds < self.EVIDENCE:  # few rounds: judged by what they could yield, not what they did
            spec = self.sec["spec"] / max(self.cap, self.tok["spec"])
        best, other = ("spec", "plain") if spec <= plain * (1 + self.MARGIN) else ("plain", "spec")
        if best == "spec" and spec < self.NEAR * plain:  # plain cannot win soon: no exploration
            return best
        # exploring costs at most one round of the other arm per EXPLORE such rounds' time: <= 1/EXPLORE of the time
        due = self.elapsed - self.last[other][1] >= self.EXPLORE * self.round_sec[other]
        return other if due else best

    def begin(self, run) -> None:
        speculating = bool(torch.stack(run.gam).gt(0).any()) if run.gam else False  # (one wait, not one per level)
        arm = self._arm(speculating)
        if speculating and arm == "plain":
            rows = len(run.seq)
            was_plain = int((torch.stack([g.cpu() for g in run.gam]) == 0).all(0).sum()) if run.gam else rows
            run.gam = [torch.zeros_like(g) for g in run.gam]
            run.stats.plain_row_rounds += rows - was_plain
            run.stats.lookup_only_row_rounds -= int(run.lookup_only.sum())  # (counted by the rule: plain now)
            run.lookup_only = torch.zeros_like(run.lookup_only)
            run.stats.guarded_rounds += 1
        self._open = (arm, self._now(run), run.committed_tokens, len(run.seq), run.stats.top.proposed)

    def end(self, run) -> None:
        if self._open is None:
            return
        arm, t0, n0, rows, proposed0 = self._open
        self._open = None
        seconds, tokens = self._now(run) - t0, run.committed_tokens - n0
        # its capacity: one token per row plus every token the full model was asked to verify
        capacity = max(rows + run.stats.top.proposed - proposed0, tokens)
        if arm == "spec" and self.setup:
            self.setup = False
            return
        if tokens <= 0:
            return
        self.sec[arm] = self.DECAY * self.sec[arm] + seconds
        self.tok[arm] = self.DECAY * self.tok[arm] + tokens
        if arm == "spec":
            self.cap = self.DECAY * self.cap + capacity
        self.elapsed += seconds
        self.round_sec[arm] = seconds
        self.last[arm] = (self.round, self.elapsed)
        self.spec_rounds += arm == "spec"
        self.round += 1
