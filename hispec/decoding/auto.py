"""`strategy="auto"` (`_AutoPolicy`): per row and per round, how much of the hierarchy to use, by the latency model
(`hispec.latency`) under the row's own acceptance estimates, measured online.

Contract (the `policy` protocol of `hispec.decoding.rounds._Run`): `choose(run)` before every round writes the
per-row gammas `run.gam` (0 below the lowest level a row uses; all 0: plain decoding) and, under a lookup-first
level 0, `run.lookup_only` (the lookup alone); `observe(run, k, ...)` is
called by every verification, `observe_tree(...)` / `lookup_missed(...)` by tree rounds (`hispec.decoding.tree`), all before
the state moves on; `keep_rows` / `extend` follow the run's rows (continuous batching); `guard` is the measured
floor (`hispec.decoding.guard`). It only changes what drafts (gammas, the lookup alone), from tokens already drawn:
output is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import latency
from ..latency import LOOKUP, level_pairs, plain_seconds_per_token
from ..drafters.ngram import propose_batch
from ..sampling import logits_to_probs, rank_among
from .guard import _PlainGuard
from .levels import Level

if TYPE_CHECKING:
    from .rounds import _Run

class _AutoPolicy:
    """`strategy="auto"`: per-row online choice of how much of the hierarchy to use, by the latency model.

    The hierarchy (`chain`, bottom-up, the full model last) is the latency-optimal speculative one for the
    checkpoint's calibration. Each row keeps, for every adjacent pair of levels (i -> i+1), a decayed count of
    accepted tokens and of rejections (each observation round: `acc = DECAY * acc + accepted`, `rej = DECAY * rej +
    (accepted < proposed)`), started from the calibration's acceptance with the weight of PRIOR rounds; its
    acceptance estimate is the i.i.d. maximum-likelihood `acc / (acc + rej)` (`latency.acceptance_from_counts`), and
    for an n-gram level 0 also its match rate. A lookup-first level 0 (`ngram|EXIT`) has two rates, counted apart by
    who proposed a row's round (its exit's, like any exit, and its n-gram's), and the lookup's match rate. Before
    every round the rule picks, per row, the lowest level s the row uses (s = K: plain decoding) and the gammas of
    levels s..K-1 minimising the latency model's predicted time per token (`latency.best_gammas`) under the row's
    own estimates, and writes them into `gam` (0 below s).
    A row that has switched level s-1 off keeps measuring it almost for free: when level s produces a token itself,
    the switched-off level's proposal for that position (its head on the exit state the pass just computed, every
    SHADOW_EVERY-th such pass, or an EAGLE-3 drafter's step, its context caught up on the way; or an n-gram
    lookup, every time) is compared with it (greedy: equal top-1;
    sampling: the exact acceptance probability sum(min(p, q)), or p(x) for an n-gram point mass). So a row drops
    to cheaper hierarchies, down to plain decoding, when speculation stops paying, and climbs back when it pays
    again. Under a lookup-first level 0 directly below the full model a row has a third choice besides the exit
    (or drafter) with the lookup first and plain decoding: the lookup alone (`run.lookup_only`: where it misses the
    row decodes plainly that round), chosen where `ngram>full` is predicted faster than both under the row's own
    n-gram rate and match rate; the switched-off exit is shadowed where the lookup missed, so the row climbs back.
    Hysteresis: a row decoding plainly starts speculating only when the predicted time per token is more
    than MARGIN below plain decoding's (within the latency model's measured error a gain is not a gain); a row
    already speculating keeps doing so while any gain is predicted.

    The rule only changes how many tokens a level gathers and which levels a row uses, from tokens already drawn;
    every token is still verified by the full model exactly as in a fixed hierarchy, so output is unchanged.
    """

    DECAY = 0.85
    PRIOR = 2.0
    together = True  # `_batch_pays`: the rows return together (`generate`), or each when done (a server: False)
    SHADOW_EVERY = 3  # plain verifications per shadow measurement of a switched-off exit or drafter (lookups: each)
    SHADOW_SHARE = 0.05  # a switched-off drafter's measurements may cost this share of the rounds' plain time / rows
    REDECIDE_PLAIN = 3  # a batch whose every row was chosen plain chooses again every this many rounds (`choose`)
    MARGIN = 0.05  # a plain row starts speculating only for a predicted gain over 5% (the latency model's error)

    def __init__(self, chain: list[Level], cal, B: int, device, *, max_gamma: int = 8, tree=None):
        self.latency, self.cal, self.chain, self.max_gamma = latency, cal, chain, max_gamma
        self.tree = tree  # a TreeSpec: level 0 drafts this tree (or, per row, nothing: plain), see `_choose_tree`
        self.names = [lv.name for lv in chain]
        K = len(chain) - 1
        # per adjacent pair (i -> i+1) the rates its verification depends on: its own, or for a lookup-first level 0
        # its exit's (estimated in acc/rej, like any exit) and the n-gram's (in lacc/lrej)
        self.pairs = [level_pairs(a, b) for a, b in zip(self.names, self.names[1:])]
        self.lookup = bool(chain[0].lookup)
        prior = [float(cal.rate(p[0]) or 0.0) for p in self.pairs]  # (the drafter's: at the calibration's gate)
        self.acc = torch.tensor([[self.PRIOR * p for p in prior]] * B, dtype=torch.float64).reshape(B, K)
        self.rej = torch.tensor([[self.PRIOR * (1 - p) for p in prior]] * B, dtype=torch.float64).reshape(B, K)
        p_ng = float(cal.rate(self.pairs[0][1]) or 0.0) if self.lookup else 0.0
        self.lacc = torch.full((B,), self.PRIOR * p_ng, dtype=torch.float64)
        self.lrej = torch.full((B,), self.PRIOR * (1 - p_ng), dtype=torch.float64)
        match = float(getattr(cal, "ngram_match", 0.0) or 0.0)
        self.hit = torch.full((B,), self.PRIOR * match, dtype=torch.float64)
        self.miss = torch.full((B,), self.PRIOR * (1 - match), dtype=torch.float64)
        # per row, the lowest level it used in the last round; rows start as plain, so the first round needs MARGIN
        self.lowest = torch.full((B,), K, dtype=torch.long)
        self._shadow_tick = 0
        # the drafter's shadow budget, in the latency model's seconds: what the rounds so far would cost plainly,
        # and what the drafter's shadow passes cost (`_shadow_drafter`)
        self.rounds_seconds = self.shadow_seconds = 0.0
        self.plain_batch = 0  # consecutive rounds every row of the batch (B > 1) was chosen plain
        # trees, greedy: per row a decayed count of rounds whose model token is among the exit's top-k at the root,
        # for each distinct width k of the tree (`khit`, out of `kseen` rounds; prior: the calibration's r(k))
        self.kwidths = sorted(set(tree.widths)) if tree is not None else []
        r = cal.topk.get(self.latency.pair_key(self.names[0].removeprefix(LOOKUP), "full")) if self.kwidths else []
        self.khit = torch.tensor([[self.PRIOR * float(r[min(k, len(r)) - 1]) for k in self.kwidths]] * B,
                                 dtype=torch.float64).reshape(B, len(self.kwidths))
        self.kseen = torch.full((B,), self.PRIOR, dtype=torch.float64)
        self.guard = _PlainGuard()  # measured floor: the batch decodes plainly where its speculation loses

    ROW_STATE = ("acc", "rej", "lacc", "lrej", "hit", "miss", "lowest", "khit", "kseen")

    @property
    def draft_gate(self) -> float:
        """The confidence gate the run's drafter chains stop at (`_Run.draft_gate`): the calibration's, which its
        latency model prices them with (`Calibration.drafter_gate`), for chains of an EAGLE-3 drafter; else 0.
        The drafter's acceptance counted here is then its gated chains', as the calibration's rate at that gate
        is (a switched-off drafter's shadow step is not gated: a row climbs back a little later than it could)."""
        return self.cal.drafter_gate if self.chain[0].kind == "eagle3" and self.tree is None else 0.0

    # ---------------------------------------------------------------- estimates
    def _update(self, i: int | None, rows: torch.Tensor, accepted: torch.Tensor, rejected: torch.Tensor):
        """Decay and count, for pair i (None: the lookup-first level's n-gram)."""
        if rows.numel():
            acc, rej = (self.lacc, self.lrej) if i is None else (self.acc[:, i], self.rej[:, i])
            acc[rows] = self.DECAY * acc[rows] + accepted.double()
            rej[rows] = self.DECAY * rej[rows] + rejected.double()

    def _match(self, rows: torch.Tensor, hit: torch.Tensor):
        if rows.numel():
            self.hit[rows] = self.DECAY * self.hit[rows] + hit.double()
            self.miss[rows] = self.DECAY * self.miss[rows] + (1 - hit.double())

    def observe(self, run: _Run, k: int, part, m, a, new, probs):
        """Called by `verify(k)` with its outcome, before the state moves on."""
        i = k - 1
        lower = run.levels[i]
        # what the rule reads, in one copy from the device (not one per tensor)
        part, m, a, gam, exhausted, only = torch.stack(
            [part.long(), m, a, run.gam[i], run.exhausted.long(), run.lookup_only.long()]).cpu()
        part = part.bool()
        gam_off = gam == 0
        spoke = part & (m > 0)
        tried = part & ~gam_off  # level i was asked to propose
        if lower.lookup:  # the rows the lookup served count for the n-gram's rate, the others for the exit's
            served = spoke & exhausted.bool()
            for pair, rows in ((None, served), (i, spoke & ~served)):
                rows = rows.nonzero().flatten()
                self._update(pair, rows, a[rows].double(), (a[rows] < m[rows]).double())
            # (a lookup-only row it missed gathered nothing: counted here when a chain round marked it exhausted,
            # not when a tree round verifies it plainly, which counted its miss already: `lookup_missed`)
            tried = tried & (spoke | exhausted.bool())
            self._match(tried.nonzero().flatten(), served[tried].double())
        else:
            rows = spoke.nonzero().flatten()
            self._update(i, rows, a[rows].double(), (a[rows] < m[rows]).double())
            if lower.kind == "ngram":
                self._match(rows, torch.ones(len(rows)))
                nothing = (tried & (m == 0)).nonzero().flatten()  # the n-gram was asked and found nothing
                self._match(nothing, torch.zeros(len(nothing)))
        shadow = (part & (m == 0) & gam_off).nonzero().flatten()
        if shadow.numel() and (lower.kind == "ngram" or lower.lookup):
            self._shadow_lookup(run, None if lower.lookup else i, shadow, new, probs)
        if lower.lookup:  # rows drafting by the lookup alone that it missed: their exit / drafter is shadowed too
            alone = part & (m == 0) & ~gam_off & only.bool()
            shadow = torch.cat([shadow, alone.nonzero().flatten()]).sort().values
        if not shadow.numel():
            return
        if lower.kind == "exit":
            self._shadow_exit(run, k, shadow, new, probs)
        if lower.kind == "eagle3":
            self._shadow_drafter(run, shadow, new, probs)

    def _shadow_lookup(self, run: _Run, pair: int | None, shadow, new, probs):
        """A switched-off lookup's first proposed token at the position the verifier just produced (every time)."""
        dev_rows = shadow.to(run.seq.device)
        ones = torch.ones_like(dev_rows)
        props, n = propose_batch(run.tok[dev_rows], run.seq[dev_rows], ones.bool(), ones, run.ngram)
        has = n.cpu() > 0
        self._match(shadow, has.double())
        if probs is not None:
            x = probs[dev_rows, 0].gather(-1, props[:, :1])[:, 0]
        else:
            x = (props[:, 0] == new[dev_rows]).double()
        x = x.detach().cpu().double()[has]
        self._update(pair, shadow[has], x, 1 - x)

    def _shadow_exit(self, run: _Run, k: int, shadow, new, probs):
        """A switched-off exit's proposal at that position (every SHADOW_EVERY-th time)."""
        i = k - 1
        if run.state_heads[i] is not None:  # a `layer` head needs its own KV: no free shadow, keep the estimate
            return
        self._shadow_tick += 1
        if self._shadow_tick % self.SHADOW_EVERY:  # an exit head costs a few % of a plain step: sample, not always
            return
        dev_rows = shadow.to(run.seq.device)
        # the switched-off exit's state at each row's last known position (all rows: one batched head call)
        last = (run.seq - 1).clamp(min=0)
        h = run.hid[k][torch.arange(len(last), device=last.device), last][:, None]
        logits = run._logits(i, h, pos=last[:, None])[:, 0][dev_rows]
        if probs is not None:
            q = logits_to_probs(logits, **run.warp)
            x = torch.minimum(q, probs[dev_rows, 0]).sum(-1)
        else:
            x = (logits.argmax(-1) == new[dev_rows]).double()
            if self.kwidths and i == 0:  # a tree's exit: the top-k counts too
                self._topk(shadow, rank_among(logits.topk(max(self.kwidths), dim=-1).indices, new[dev_rows]))
        x = x.detach().cpu().double()
        self._update(i, shadow, x, 1 - x)

    def _shadow_drafter(self, run: _Run, shadow, new, probs):
        """A switched-off EAGLE-3 drafter's proposal at that position (every SHADOW_EVERY-th time, within its
        budget): its context entries since it last ran are caught up on the way, work its next draft step would
        otherwise do. The budget: the shadow passes' predicted cost stays within SHADOW_SHARE / B of what the
        rounds so far cost plainly (`choose` counts them; B: the batch's rows), so a drafter that never runs costs
        plain decoding at most that. A pass over a row's whole prompt, the drafter's context before it first ran,
        is the dear one: it runs over every row of the batch padded to the longest catch-up. Measured without a budget
        (SmolLM2 bf16, the 2.01M-token drafter, batch 4, one thread on a Zen 4 core, 16 Spec-Bench prompts x 64
        tokens; docs/results.md), `auto` decoded 99% of its rows plainly (the drafter at batch 4 runs at 0.57x of
        `ar`) and its drafter shadows alone took 11% of `ar`'s decode time (auto 0.82x of `ar`, 0.93x without them).
        Why the share falls with the rows: a batch's round speculates only when its rows' rates clear a bar that rises
        with B (the latency model's per-row rule, SmolLM2 bf16: the drafter's chain pays from a rate of 0.15 alone or
        in two rows, 0.25 in four, 0.4 in eight, 0.7 in sixteen), so a measurement is worth less there while each
        still costs a pass; with 5% at every size, batch 4 with the shipped drafter decoded at 0.908x of `ar` with its
        shadows and 0.956x without (all rows plain, 8 prompts x 64 tokens, interleaved, one thread on a Zen 4 core;
        docs/results.md)."""
        self._shadow_tick += 1
        if self._shadow_tick % self.SHADOW_EVERY:
            return
        rows = torch.zeros(run.seq.shape[0], dtype=torch.bool, device=run.seq.device)
        rows[shadow.to(run.seq.device)] = True
        entries = int(torch.where(rows, run.seq - run.dlen, 0).max())  # the pass's width: the longest catch-up
        c = self.cal
        cost = c.head_cost(self.latency.EAGLE, len(rows) * max(entries, 1)) + c.drafter_overhead + c.step_overhead
        if self.shadow_seconds + cost > self.SHADOW_SHARE / len(rows) * self.rounds_seconds:
            return
        self.shadow_seconds += cost
        if self.kwidths and probs is None:  # a drafter tree (greedy): its top-k counts too
            x, rank = run._eagle_shadow(rows, new, probs, max(self.kwidths))
            if rank is not None:
                self._topk(shadow, rank.cpu()[shadow])
        else:
            x = run._eagle_shadow(rows, new, probs)
        if x is not None:
            x = x.cpu()[shadow]
            self._update(0, shadow, x, 1 - x)

    def _topk(self, rows: torch.Tensor, rank: torch.Tensor):
        """One observation, for each of `rows`, of whether the model's token is among the exit's top-k, for every
        width k of the tree (`rank` [len(rows)]: its rank among the exit's top choices, >= k when not in them)."""
        if rows.numel():
            hits = (rank.detach().cpu()[:, None] < torch.tensor(self.kwidths)).double()
            self.khit[rows] = self.DECAY * self.khit[rows] + hits
            self.kseen[rows] = self.DECAY * self.kseen[rows] + 1

    def observe_tree(self, run: _Run, drafted, top1, part, new, probs, rank=None):
        """Called by a tree round (`hispec.decoding.tree`, `hispec.decoding.eagle_tree`) after its verification, before the
        state moves on. `top1` is one observation of level 0's top-1 rate at the root (greedy: whether the full
        model's token is its top-1; sampling: the exact acceptance probability sum(min(p, q)) of one draft from its
        q) for every row of `part` (still decoding) under an exit (the pass computes the exit's root logits for
        every row, so rows decoding plainly, not `drafted`, are measured exactly and for free, `layer` heads too),
        for the `drafted` rows under the EAGLE-3 drafter (it runs for those only: plain rows are shadowed as in a
        chain, `_shadow_drafter`). Greedy, `rank` [B] is the model token's rank among the root's children (level
        0's top-k_1; k_1 when not among them): one observation of the row's top-k rate for each width of the tree.
        Switched-off rows' lookup is shadowed as in `observe` (`new`, probabilities `probs[:, 0]`)."""
        cpu = lambda t: t.detach().cpu()  # noqa: E731
        drafted, part = cpu(drafted), cpu(part)
        drafter = self.chain[0].kind == "eagle3"
        rows = (part & drafted if drafter else part).nonzero().flatten()
        x = cpu(top1).double()[rows]
        self._update(0, rows, x, 1 - x)
        if rank is not None and self.kwidths:
            self._topk(rows, cpu(rank)[rows])
        shadow = (part & ~drafted).nonzero().flatten()
        plain = (part & ~drafted & (cpu(run.gam[0]) == 0)).nonzero().flatten()  # (lookup-only rows tried it)
        if plain.numel() and self.lookup:
            self._shadow_lookup(run, None, plain, new, probs)
        if shadow.numel() and drafter:
            self._shadow_drafter(run, shadow, new, probs)

    def lookup_missed(self, rows: torch.Tensor):
        """Rows (bool [B]) whose lookup-first exit tried the n-gram before a tree round and found nothing (the rows
        it served are counted by `observe`, when their chain is verified)."""
        rows = rows.detach().cpu().nonzero().flatten()
        self._match(rows, torch.zeros(len(rows)))

    # ---------------------------------------------------------------- choice
    def _choose_tree(self, run: _Run, cal, alphas, lookup, match):
        """Per row: the tree, plain decoding (gam 0) or, under a lookup-first exit, the lookup alone (gam 1,
        `lookup_only`), whichever the latency model predicts fastest under the row's
        own estimates (greedy: its top-k rates at the tree's widths, counted by `observe_tree`; sampling, where only
        the top-1 acceptance is observed exactly: the calibration's top-k rates scaled to the row's, by
        `latency.scaled_topk`; for a lookup-first exit also the n-gram's rate and match rate), with the same
        hysteresis as chains."""
        exit_level = self.names[0].removeprefix(LOOKUP)
        key = self.latency.pair_key(exit_level, "full")
        rates, widths = cal.topk[key], list(self.tree.widths)
        plain = plain_seconds_per_token(cal)
        own = None if run.do_sample else (self.khit / self.kseen[:, None].clamp(min=1e-9)).tolist()
        gam, only = [0] * alphas.shape[0], [False] * alphas.shape[0]
        for b in range(alphas.shape[0]):
            margin = self.MARGIN if int(self.lowest[b]) == 1 else 0.0
            row = self.latency.scaled_topk(rates, float(alphas[b, 0]))
            for k, r in zip(self.kwidths, own[b] if own is not None else ()):
                row[k - 1] = r
            topk = {key: row}
            ng = {self.pairs[0][1]: float(lookup[b])} if self.lookup else None  # the row's n-gram rate
            t = self.latency.tree_time_per_token(widths, cal, exit_level, topk, lookup=self.lookup,
                                                 acceptance=ng, match=float(match[b]))
            on = t < plain * (1 - margin)
            only[b] = self.lookup and self._lookup_alone(cal, t if on else plain, plain * (1 - margin),
                                                         float(lookup[b]), float(match[b]))
            gam[b] = 1 if on or only[b] else 0
            self.lowest[b] = 0 if gam[b] else 1
        run.gam = [torch.tensor(gam, dtype=run.gam[0].dtype, device=run.gam[0].device)]
        run.lookup_only = torch.tensor(only, dtype=torch.bool, device=run.gam[0].device)
        return sum(only)

    def _choose_chain(self, run: _Run, cal, alphas, lookup, match):
        """Per row: the lowest level it uses and the gammas above it that the latency model predicts fastest under
        the row's own estimates (`latency.best_gammas`), with hysteresis towards plain decoding."""
        K = len(self.chain) - 1
        gam = [[0] * alphas.shape[0] for _ in range(K)]  # (every row's every gamma is set below)
        only = [False] * alphas.shape[0]
        plain = plain_seconds_per_token(cal)
        for b in range(alphas.shape[0]):
            margin = self.MARGIN if int(self.lowest[b]) == K else 0.0  # hysteresis: climbing needs a clear gain
            rates = {p[0]: a for p, a in zip(self.pairs, alphas[b].tolist())}
            if self.lookup:
                rates[self.pairs[0][1]] = float(lookup[b])
            gs = self.latency.best_gammas(self.names, cal, rates, max_gamma=self.max_gamma,
                                          ngram_match=float(match[b]), margin=margin)
            if self.lookup and K == 1:  # the lookup alone, where it beats what the rule chose
                now = self.latency.time_per_token(self.names, gs, cal, rates, float(match[b])) if gs[0] else plain
                if self._lookup_alone(cal, now, plain * (1 - margin), float(lookup[b]), float(match[b])):
                    only[b], gs = True, [1]
            self.lowest[b] = next((i + 1 for i in range(K - 1, -1, -1) if gs[i] == 0), 0)
            for i in range(K):
                gam[i][b] = gs[i]
        like = run.gam[0]
        run.gam = list(torch.tensor(gam, dtype=like.dtype, device=like.device).unbind(0))  # one copy to the device
        if self.lookup:
            run.lookup_only = torch.tensor(only, dtype=torch.bool, device=like.device)
        return sum(only)

    def _batch_pays(self, run: _Run, alphas, lookup, match) -> bool:
        """Whether the rows' choices, speculating together, are predicted to beat one plain round of the batch per
        token. The per-row rule prices a row at its share of a pass as wide as its own proposal (`at_batch`: as
        if every row drafted alike); but one pass verifies every row at the widest row's width, so where a few
        rows propose (an n-gram row only where its lookup matched) the whole batch pays their width. Here the
        round is priced as the batch runs it (`latency.batch_pass_seconds`, the one-row curves): the verification
        over rows x W positions (W = 1 + the widest proposal) where any row proposes, else over the rows alone, the
        layers below an exit over the newest tokens unless a lookup served some row, plus the draft steps at the
        batch's rows; its tokens are the rows' expected ones (`expected_tokens` under each row's own rates: the
        lookup's where it matches, else one, or the exit's / drafter's). What those tokens are worth depends on
        who waits for them. A server's rows each return when done (`together` False): a token is worth a plain
        round's share, B tokens a round (each request's latency; with requests queued, throughput). `generate`
        returns when its last row is done (`together`): a finished row only leaves the batch, so with a plain
        round costing `fixed` + B x `row` (one row less saves `row`, from the one-row curves) a token saves its
        row's `row` in later rounds, and `fixed` comes off only when every row is ahead: per the round's slowest
        row's expected tokens (rows of one length finish after as many rounds as the slowest needs). So at batch 4
        on the demo checkpoint one lookup row's 8-token proposal would have to save more than the wide pass costs
        at a row's marginal share (~2 ms of a ~35 ms round), not at the batch's average (~9 ms): it never does;
        rows that all expect the same tokens are priced as before. Approximations, all small: the widest proposal
        is assumed every round; a lookup-first row is charged one lookup (the decoder may retry it before each
        draft step) and width 1 + max(n, gamma); the drafter's context intake is left out. Chains with one
        level under the full model (what `auto` plans); deeper chains and trees keep the per-row rule. Measured
        with `ngram>full` only (docs/results.md)."""
        lt, c, lv = self.latency, self.cal, self.chain[0]
        gam = run.gam[0].tolist()
        on = [b for b, g in enumerate(gam) if g > 0]
        if not on:
            return True
        B, n = len(gam), c.ngram_max_len
        only = run.lookup_only.tolist() if self.lookup else [False] * B
        unserved, width, tokens, lookups, steps = 1.0, 1, float(B - len(on)), 0, 0  # unserved: no lookup matched
        slowest = 1.0 if len(on) < B else float("inf")  # the fewest tokens a row expects (a plain row: one)
        for b in on:
            g, m, a = int(gam[b]), float(match[b]), float(alphas[b, 0])
            if lv.kind == "ngram" or only[b]:  # proposes only where the lookup matches
                rate, L = (float(lookup[b]), n) if self.lookup else (a, g)
                mine = m * lt.expected_tokens(rate, L) + (1 - m)
                width = max(width, 1 + L)
            elif self.lookup:  # the lookup where it matches, the exit / drafter where it does not
                mine = m * lt.expected_tokens(float(lookup[b]), n) + (1 - m) * lt.expected_tokens(a, g)
                width, steps = max(width, 1 + max(n, g)), max(steps, g)
            else:
                mine = lt.expected_tokens(a, g)
                width, steps = max(width, 1 + g), max(steps, g)
            tokens += mine
            slowest = min(slowest, mine)
            if lv.kind == "ngram" or self.lookup:
                unserved *= 1 - m
                lookups += 1
        exit_level = self.names[0].removeprefix(LOOKUP) if lv.kind == "exit" else None
        if lv.kind == "eagle3":
            draft = c.head_cost(lt.EAGLE, B) + c.drafter_overhead
        elif exit_level is not None:
            draft = c.depth(exit_level) * c.layer_cost(B) + c.head_cost(exit_level, B)
        else:
            draft = 0.0
        served = lt.batch_pass_seconds(c, B, width)  # some row's proposal came from nowhere: every layer at W
        quiet = lt.batch_pass_seconds(c, B, width, exit_level) if steps else lt.batch_pass_seconds(c, B, 1)
        verify = (1 - unserved) * served + unserved * quiet
        if steps and lv.kind == "eagle3":
            verify += c.drafter_verify_overhead
        plain = c.step_overhead + lt.batch_pass_seconds(c, B, 1)
        spec = c.step_overhead + lookups * c.ngram_cost + steps * (draft + c.step_overhead) + verify
        if not self.together:  # each row returns when done: every token is worth a plain round's share
            return spec / tokens <= plain / B
        # the call returns with its last row: a plain round is `fixed` (what it costs whatever its rows) plus `row`
        # per row; a token saves its row's share of later rounds, and the fixed part comes off only as fast as
        # the slowest row advances (rows of one length: how many rounds remain is set by the fewest tokens a row
        # expects per round)
        row = max(plain - c.step_overhead - lt.batch_pass_seconds(c, B - 1, 1), 0.0)
        fixed = plain - B * row
        return spec <= row * tokens + fixed * slowest

    def _lookup_alone(self, cal, now: float, below: float, rate: float, match: float) -> bool:
        """Whether a row of a lookup-first level 0 drafts faster by the lookup alone (`ngram>full`, under the row's
        n-gram rate and match rate: `latency.lookup_alone_seconds`) than by what the rule chose (`now`, seconds
        per token) and in less than `below` (plain decoding's time, less the hysteresis margin)."""
        t = self.latency.lookup_alone_seconds(cal, rate, match)
        return t < now and t < below

    def choose(self, run: _Run):
        """Before a round: every row's gammas `run.gam` (and `run.lookup_only`), from its estimates (a tree's rows: the
        tree, the lookup alone under a lookup-first exit, or plain). A batch (B > 1) whose every row was chosen
        plain chooses again only every REDECIDE_PLAIN-th round, or at once when rows leave or join: its
        estimates move only by shadow measurements, a little per round, while the choice per row (`best_gammas`
        for every row) grows with the batch (SmolLM2 bf16 with the drafter, batch 4, 16 prompts x 64 tokens, one
        Zen 4 core, timed: `choose` 0.18 s of 8.9 s decoding, 0.07 s with this); climbing back waits at most
        REDECIDE_PLAIN - 1 rounds. One row alone chooses every round."""
        B, K = self.acc.shape[0], len(self.chain) - 1
        if self.chain[0].kind == "eagle3":  # the drafter's shadow budget grows by this round at plain cost
            self.rounds_seconds += self.cal.step_overhead + self.latency.batch_pass_seconds(self.cal, B, 1)
        if self.plain_batch % self.REDECIDE_PLAIN:  # (0: not plain, or its turn to choose again)
            self.plain_batch += 1
            self._all_plain(run)
            run.stats.row_rounds += B
            run.stats.plain_row_rounds += B
            return
        alphas = self.acc / (self.acc + self.rej).clamp(min=1e-9)  # [B, K]: latency.acceptance_from_counts
        lookup = self.lacc / (self.lacc + self.lrej).clamp(min=1e-9)
        match = self.hit / (self.hit + self.miss).clamp(min=1e-9)
        cal = self.cal.at_batch(B)  # priced at this batch's costs (`Calibration.at_batch`)
        choose = self._choose_tree if self.tree is not None else self._choose_chain
        alone = choose(run, cal, alphas, lookup, match)  # (how many rows draft by the lookup alone)
        if self.tree is None and K == 1 and B > 1 and not self._batch_pays(run, alphas, lookup, match):
            self._all_plain(run)  # the batch's round: plain for every row
            self.lowest.fill_(K)
            alone = 0
        self.plain_batch = self.plain_batch + 1 if B > 1 and bool((self.lowest == K).all()) else 0
        run.stats.row_rounds += alphas.shape[0]
        run.stats.plain_row_rounds += int((self.lowest == K).sum())
        run.stats.lookup_only_row_rounds += alone

    @staticmethod
    def _all_plain(run: _Run):
        """Every row decodes plainly this round."""
        run.gam = [torch.zeros_like(g) for g in run.gam]
        run.lookup_only = torch.zeros_like(run.lookup_only)

    def extend(self, other: "_AutoPolicy"):  # (the guard's timings stay: they are per token, not per row)
        for name in self.ROW_STATE:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        self.guard.joined()
        self.plain_batch = 0  # another batch: choose again now

    def keep_rows(self, idx: torch.Tensor):
        idx = idx.cpu()
        for name in self.ROW_STATE:
            setattr(self, name, getattr(self, name).index_select(0, idx))
        self.plain_batch = 0
