"""The round machinery (`_Run`): the state and steps of one batched generation call over a hierarchy of levels
(`hispec.decoding.levels`), read top to bottom: prefill, draft, verify, commit, a round, the whole call.

The model layers form one *range* per level, `[e_{k-1}, e_k)` (an `ngram` level's range is empty); each range keeps
its own KV length, and the hidden state entering range k is kept for every position that passed range k-1 but not
range k (hidden-state reuse). A verification at level k "advances" ranges 0..k over exactly the positions still
pending for them, so KV written for a token that is later accepted is never recomputed (KV reuse); rejected
positions are rolled back in every range.

Per row (all tensors are `[B, ...]`; rows keep their own counts):
- `tok[b, i]` is the i-th real token of row b, its absolute position is i; `seq[b]` tokens are known.
- `ver[k][b]` tokens have been verified by level k (k >= 1); `ver[K]` are committed.
- `done[j][b]` positions have passed range j. Invariant for j >= 1: `done[j] == ver[j] - 1`.
- `gam[k][b]` (k < K): how many tokens level k gathers before level k+1 verifies them (for `ngram`: the longest
  proposal). 0 means the row does not use level k nor anything below it: level k+1 produces its tokens itself (a
  verification with nothing to verify yields one token, like a plain decoding step). So one batch can hold rows
  that speculate with different depths and lengths, and rows that decode plainly.
- `lookup_only[b]` (a lookup-first level 0, `ngram|EXIT`): the row drafts by the n-gram lookup alone, its exit or
  drafter off; where the lookup misses it gathers nothing (one plain token from the verification).

A round at level k, over the rows `active` for it: while some active row has gathered fewer than `gam[k-1]` tokens
(and is not at its length limit, and an `ngram` level below it still has proposals), run a round at level k-1 for
those rows only; then verify the active rows. The prompt is prefilled through all layers at once and the full
model picks the first new token. A `policy` (`hispec.decoding.auto`) may set `gam` and `lookup_only` per row before
every round;
rows leave and join between rounds (`hispec.decoding.batching`).

Lossless: greedy verification keeps the longest prefix equal to the level's argmax; sampling uses speculative
sampling at every level, with level k-1's stored probability rows as proposal and level k's as target (an `ngram`
proposal is a point mass: accepted with probability p(x), else resampled from p without x), so the tokens a level
accepts are exact samples of that level, and committed tokens are exact samples of the model. `verification="hsd"`
replaces the per-token rule at every level by the sequence-level one (`hispec.sampling.hsd_accept`), which is
exact for the same reason and accepts at least as many tokens; greedy decoding does not use either. How many tokens a
level gathers, and which levels a row uses, depend only on tokens already drawn, which keeps the argument valid.
"""

from __future__ import annotations

import torch

from .. import timing
from ..drafters.heads import ContextInputs
from ..drafters.ngram import NgramConfig, propose_batch
from ..sampling import greedy_accept, hsd_accept, logits_to_probs, sample, speculative_accept
from .dynamic_tree import dynamic_round
from .tree import DynamicTreeSpec, tree_round
from .eagle_tree import eagle_tree_round
from .batching import _RowSet
from .eagle import _EagleDrafting
from .handover import _Handover
from .stats import GenerationStats, LevelStats


class _Run(_Handover, _EagleDrafting, _RowSet):
    """State and steps of one batched generation call."""

    def __init__(self, model, levels, prompts, limits, *, do_sample, warp, eos, generator, stop_check, streamer,
                 ngram: NgramConfig, policy=None, tree=None, verification: str = "token", cache=None, ids=None,
                 draft_gate: float = 0.0):
        self.model, self.adapter, self.levels = model, model.adapter, levels
        # an eagle3 chain stops at a draft the drafter gives less (eagle.py); `auto`: its policy's (calibrated) gate
        self.draft_gate = float(getattr(policy, "draft_gate", draft_gate))
        self.tree = tree  # a hispec.decoding.tree.TreeSpec: level 0 drafts trees (hispec/decoding/tree.py), else chains
        self.K = len(levels) - 1
        self.bounds = [0] + [lv.exit_layer for lv in levels]
        self.do_sample, self.warp, self.generator = do_sample, warp, generator
        self.eos = eos  # LongTensor of EOS ids (may be empty)
        self.stop_check, self.streamer = stop_check, streamer
        self.ngram, self.policy = ngram, policy
        self.verification = verification
        self.committed_tokens = 0  # new tokens handed over so far, all rows (`_PlainGuard` counts rounds by it)
        self.stats = GenerationStats(levels=[LevelStats(lv.name) for lv in levels], verification=verification)
        dev = self.device = self.adapter.device  # (its timers wait for this device's queued work: hispec.timing)
        B = len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        self.limit = torch.as_tensor(limits, device=dev)
        cap = int(self.limit.max()) + sum(lv.threshold for lv in levels) + max(ngram.max_len, 8) + len(levels) + 2
        self._init_counts(prompts, lens, cap)
        self._init_buffers(B, cap, cache)
        # each row's id in `results` (continuous batching gives its request ids; rows leave and join by id)
        self.orig = torch.arange(B, device=dev) if ids is None else torch.as_tensor(ids, dtype=torch.long, device=dev)
        self.results: dict[int, list[int]] = {}
        self._init_handover(levels, eos)
        self.row_stop: dict[int, object] = {}  # per-row stop checkers by id (continuous batching), else stop_check
        self._pre = None  # chunked prefill: each row's final state at its last prompt position
        # Sampling: probability rows of each level (except the top) by position, offset by `base`.
        self.rows: list[torch.Tensor | None] = [None] * self.K
        self.base = lens.clone()

    def _init_counts(self, prompts, lens: torch.Tensor, cap: int):
        """The prompts' tokens (`tok`, `cap` positions per row) and every row's counts, all at its prompt length."""
        B, dev = len(prompts), self.adapter.device
        self.tok = torch.zeros(B, cap, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            self.tok[b, : len(p)] = torch.as_tensor(p, device=dev)
        self.prompt_len = lens.clone()
        self.seq = lens.clone()
        self.ver = [None] + [lens.clone() for _ in range(self.K)]
        self.done = [torch.zeros_like(lens) for _ in range(self.K + 1)]
        self.gam = [torch.full_like(lens, lv.threshold) for lv in self.levels[:-1]]
        # an ngram level 0 has no more proposals, or (`ngram|EXIT`) its lookup proposed: verify them now
        self.exhausted = torch.zeros(B, dtype=torch.bool, device=dev)
        # `ngram|EXIT` rows whose exit (or drafter) `auto` switched off: the lookup alone drafts for them, and where
        # it misses they decode plainly that round (`ngram>full` per row, without a second hierarchy)
        self.lookup_only = torch.zeros(B, dtype=torch.bool, device=dev)
        # rows whose drafter stopped this round at a draft below `draft_gate`: verify what they have
        self.gated = torch.zeros(B, dtype=torch.bool, device=dev)

    def _init_buffers(self, B: int, cap: int, cache):
        """The hidden states kept between ranges (`hid`, `fin`), the KV cache and the stateful heads' slots."""
        model, levels, dev = self.model, self.levels, self.adapter.device
        H = self.adapter.hidden_size
        self.hid = [None] + [torch.zeros(B, cap, H, dtype=self.adapter.dtype, device=dev) for _ in range(self.K)]
        # `context` heads read the final layer's states of verified positions: kept per row (valid below done[K])
        self.fin = (torch.zeros(B, cap, H, dtype=self.adapter.dtype, device=dev)
                    if any(lv.kind == "exit" and model.heads[lv.head].needs_context for lv in levels) else None)
        # `layer` heads keep their own KV as extra cache layers, advanced and rolled back with their exit's range
        self.cache = self.adapter.new_cache(B, extra=model.extra_cache_layers) if cache is None else cache
        self.state_heads = [None] * (self.K + 1)
        for j, lv in enumerate(levels[:-1]):
            if lv.kind == "exit" and model.heads[lv.head].stateful:
                self.state_heads[j] = model.heads[lv.head]
        if levels[0].kind == "eagle3":  # the drafter's state (hispec.decoding.eagle)
            self._init_eagle(B, cap)

    # ------------------------------------------------------------------ machinery
    def _advance(self, j: int, end: torch.Tensor, T: int | None = None):
        """Run range j over positions [done[j], end) of every row; returns (output [B, T, H] or None, start,
        head features [B, T, H] of level j's stateful head or None). `T`: the most positions of any row, when the
        caller already read it from the device."""
        start = self.done[j]
        n = (end - start).clamp(min=0)
        if T is None:
            T = int(n.max()) if n.numel() else 0
        if T == 0:
            return None, start, None
        ar = torch.arange(T, device=start.device)
        idx = start[:, None] + ar  # [B, T] absolute positions
        valid = ar < n[:, None]
        idx = torch.where(valid, idx, start[:, None]).clamp(max=self.tok.shape[1] - 1)
        a, b = self.bounds[j], self.bounds[j + 1]
        if j == 0:
            inp = self.adapter.embed(self.tok.gather(1, idx), idx)
        else:
            inp = self.hid[j].gather(1, idx[..., None].expand(-1, -1, self.adapter.hidden_size))
        capture = self._eagle_capture(j)
        out = inp if a == b else self.adapter.run_layers(inp, a, b, position_ids=idx, cache=self.cache, valid=valid,
                                                         capture=capture)
        if capture:
            self._eagle_store(idx, valid, capture)
        self._count(j, "layer_evals", n.sum() * (b - a))
        dest = self.hid[j + 1] if j + 1 <= self.K else self.fin
        if dest is not None:  # (padding goes to the last column, never a real position: no host read of `valid`)
            at = torch.where(valid, idx, dest.shape[1] - 1)[..., None].expand(-1, -1, dest.shape[-1])
            dest.scatter_(1, at, out.to(dest.dtype))
        feats = None
        head = self.state_heads[j]
        if head is not None:  # the head's own layer sees exactly the positions its exit's range saw
            def run_layer(module, hidden):
                return self.adapter.run_module(module, head.layer_type, hidden, cache_index=head.cache_index,
                                               position_ids=idx, cache=self.cache, valid=valid)

            feats = head(out, run_layer)
            self._count(j, "layer_evals", n.sum())
        self.done[j] = torch.maximum(start, end)
        return out, start, feats

    def _logits(self, k: int, hidden: torch.Tensor, head_feats: torch.Tensor | None = None,
                pos: torch.Tensor | None = None) -> torch.Tensor:
        """Level k's logits for its states `hidden` `[B, T, H]` at positions `pos` `[B, T]` (context heads)."""
        head = self.levels[k].head
        if head is None:
            return self.adapter.final_logits(hidden)
        if head_feats is not None:  # a stateful head already ran while its range advanced
            return self.model.project_exit(head, head_feats)
        ctx = self._context(k, pos) if self.model.heads[head].needs_context else None
        return self.model.exit_logits(head, hidden, context=ctx)

    def _context(self, k: int, pos: torch.Tensor) -> ContextInputs:
        """What level k's `context` head may read for queries at `pos`: for each layer it reads, the decoder's
        buffer of that layer's states and, per row, the positions below which they are valid (the final layer's:
        what the full model verified, done[K]; an exit's: what its range has run, done of the range below it). A
        layer this hierarchy does not run is never available."""
        head = self.model.heads[self.levels[k].head]
        states, avail = [], []
        for L in head.context_layers:
            if L == self.adapter.num_layers:
                buf, ok = self.fin, self.done[self.K]
            elif L in self.bounds[1:self.K + 1]:
                i = self.bounds.index(L, 1)  # hid[i] holds the output of range i - 1, i.e. the state at bounds[i]
                buf, ok = self.hid[i], self.done[i - 1]
            else:
                buf, ok = self.hid[k + 1], torch.zeros_like(self.seq)
            states.append(buf)
            avail.append(ok)
        return ContextInputs(states=states, avail=avail, query_pos=pos, layers=list(head.context_layers))

    def _stop_pos(self) -> torch.Tensor:
        """Per row, the first position that must not be extended: min(limit, first EOS after the prompt + 1).
        Computed once per state (the tensors it reads, and `tok`'s version: every write to it counts), as a round
        asks several times between changes, and finding the EOS waits for the device."""
        committed = self.ver[self.K] if self.K else self.seq
        key = (self.seq, committed, self.limit, self.eos, self.tok)
        memo = self._stop_memo
        if memo is not None and memo[2] == self.tok._version and all(x is y for x, y in zip(memo[0], key)):
            return memo[1]
        end = self._first_stop(committed)
        self._stop_memo = (key, end, self.tok._version)
        return end

    def _first_stop(self, committed: torch.Tensor) -> torch.Tensor:
        """`_stop_pos` computed: an EOS among each row's tokens past `committed`, which are at most `_pending` (a
        bound the host keeps, so finding the window does not wait for the device)."""
        end = self.limit.clone()
        if self.eos.numel() and committed is not self.seq:  # (plain decoding: nothing pending past `committed`)
            width = min(self._pending, self.tok.shape[1]) if self.seq.numel() else 0
            if width > 0:
                idx = committed[:, None] + torch.arange(width, device=end.device)
                inside = idx < self.seq[:, None]
                t = self.tok.gather(1, idx.clamp(max=self.tok.shape[1] - 1))
                is_eos = torch.isin(t, self.eos) & inside
                first = torch.where(is_eos.any(1), idx[torch.arange(len(idx)), is_eos.float().argmax(1)] + 1, end)
                end = torch.minimum(end, first)
        return end

    def _ensure_rows(self, k: int, width: int, V: int, like: torch.Tensor):
        r = self.rows[k]
        if r is None or r.shape[1] < width:
            new = torch.zeros(like.shape[0], max(width, 2 * (0 if r is None else r.shape[1])), V,
                              dtype=like.dtype, device=like.device)
            if r is not None:
                new[:, : r.shape[1]] = r
            self.rows[k] = new
        return self.rows[k]

    def _store_rows(self, k: int, first_pos: torch.Tensor, probs: torch.Tensor, only: torch.Tensor | None = None):
        # probs [B, W, V] are level k's rows predicting positions first_pos + 0..W-1 (for the rows `only`, else all)
        off = first_pos - self.base
        W = probs.shape[1]
        rows = self._ensure_rows(k, int(off.max()) + W, probs.shape[-1], probs)
        idx = (off[:, None] + torch.arange(W, device=off.device))[..., None].expand(-1, -1, probs.shape[-1])
        if only is not None:
            probs = torch.where(only[:, None, None], probs.to(rows.dtype), rows.gather(1, idx))
        rows.scatter_(1, idx, probs)

    def _read_rows(self, k: int, first_pos: torch.Tensor, W: int) -> torch.Tensor:
        off = first_pos - self.base
        rows = self.rows[k]
        idx = (off[:, None] + torch.arange(W, device=off.device)).clamp(max=rows.shape[1] - 1)
        return rows.gather(1, idx[..., None].expand(-1, -1, rows.shape[-1]))

    # ------------------------------------------------------------------ steps
    def prefill(self, chunk: int | None = None) -> bool:
        """All prompt tokens through all layers in one call per range (the same chunking as a plain forward, so
        low-precision numerics match transformers), then the first new token from the full model.

        `chunk` (continuous batching, `hispec.serve`): at most that many prompt positions per row and call, so a
        long prompt is prefilled over several engine steps while other rows decode; returns True once every row's
        prompt is in and its first token is picked (always, without `chunk`)."""
        t0 = timing.now(self.device)
        end = self.prompt_len if chunk is None else torch.minimum(self.prompt_len, self.done[0] + chunk)
        out = start = None
        for j in range(self.K + 1):
            out, start, _ = self._advance(j, end)
        if out is not None:  # keep the final state at the last prompt position of rows whose prompt just ended
            rows = torch.arange(len(end), device=end.device)
            feats = out[rows, (end - 1 - start).clamp(min=0, max=out.shape[1] - 1)]  # [B, H]
            got = (end == self.prompt_len) & (end > start)
            self._pre = feats if self._pre is None else torch.where(got[:, None], feats, self._pre)
        if not bool((self.done[self.K] >= self.prompt_len).all()):
            self.stats.prefill_seconds += timing.now(self.device) - t0
            return False
        end = self.prompt_len
        logits = self._logits(self.K, self._pre[:, None])[:, 0]
        self._pre = None
        token = sample(logits_to_probs(logits, **self.warp), self.generator) if self.do_sample else logits.argmax(-1)
        self.tok.scatter_(1, end[:, None], token[:, None])
        self.seq = end + 1
        self.ver = [None] + [self.seq.clone() for _ in range(self.K)]
        self.base = self.seq.clone()
        self.stats.levels[-1].passes += 1
        self.stats.levels[-1].row_passes += len(end)
        self.stats.prefill_seconds += timing.now(self.device) - t0
        return True

    def draft_step(self, active: torch.Tensor):
        """Level 0 proposes for the active rows that may still grow: one token (an exit, or the full model for
        `ar`, where it is committed), or a whole n-gram continuation of up to gam[0] tokens; `ngram|EXIT`: the
        lookup's continuation (up to ngram.max_len) where it matches, else the exit's token (none for
        `lookup_only` rows: they are verified with nothing gathered, i.e. decode one token plainly)."""
        t0 = timing.now(self.device)
        st = self.stats.levels[0]
        stop = self._stop_pos()
        grow = active & (self.seq < stop) & ~self.gated
        if self.levels[0].kind == "ngram":
            self._draft_ngram(grow, stop, st)
        else:
            if self.levels[0].lookup:  # `ngram|EXIT`: rows the lookup serves skip the exit and are verified next
                grow = self._draft_lookup(grow, stop, st)
                off = grow & self.lookup_only  # the lookup missed and the exit is off: plain this round
                self.exhausted |= off
                grow = grow & ~off
            if self.levels[0].kind == "eagle3":
                self._draft_eagle(grow, st)
            else:
                self._draft_exit(grow, st)
            self._pending += 1  # (one token a row at most)
        st.seconds += timing.now(self.device) - t0

    def drafting_rows(self) -> torch.Tensor:
        """Rows whose level-0 model (exit or drafter) drafts this round: level 0 on (`gam[0]` > 0) and, under a
        lookup-first level 0, its model not switched off (`lookup_only`). Tree rounds cap the others' depth at 0."""
        return (self.gam[0] > 0) & ~self.lookup_only

    def verify_plainly_if_none_drafts(self) -> bool:
        """At a tree round's start (under `auto`): where no row still decoding drafts this round (each plain, or
        `lookup_only` with its lookup missed), one plain verification instead of the tree machinery, as a chain
        round of plain rows (the full model's token for every row). Returns whether it ran."""
        if self.policy is None or bool((self.drafting_rows() & (self.seq < self.limit)).any()):
            return False
        self.verify(self.K, torch.ones_like(self.seq, dtype=torch.bool))
        return True

    def _draft_ngram(self, grow: torch.Tensor, stop: torch.Tensor, st: LevelStats):
        """An `ngram` level 0: the lookup's continuation, up to gam[0] tokens, for the rows `grow`."""
        n = self._propose_ngram(grow, torch.minimum(self.gam[0], stop - self.seq))
        self.exhausted |= grow
        self._count(0, "proposed", n.sum())
        self._count(0, "proposals", (n > 0).sum())
        self._count(0, "passes", grow.any())
        self._count(0, "row_passes", grow.sum())

    def _draft_lookup(self, grow: torch.Tensor, stop: torch.Tensor, st: LevelStats) -> torch.Tensor:
        """`ngram|EXIT`'s first try, the lookup (up to ngram.max_len tokens); returns the rows it left to the exit."""
        n = self._propose_ngram(grow, torch.minimum(torch.full_like(stop, self.ngram.max_len), stop - self.seq))
        hit = n > 0
        self.exhausted |= hit
        hits = hit.sum()
        self._count(0, "proposed", n.sum())
        self._count(0, "proposals", hits)
        self._count(0, "lookups", hits)
        return grow & ~hit

    def _draft_exit(self, grow: torch.Tensor, st: LevelStats):
        """Level 0's model (an exit, or the full model for `ar`) appends one token to each of the rows `grow`."""
        end = torch.where(grow, self.seq, self.done[0])
        T, self._draft_width = self._draft_width, None  # (read with the round's check, `_more_to_draft`)
        out, start, hf = self._advance(0, end, T)
        if out is not None:
            token = self._draft_token(out, start, hf, end, grow)
            pos = self.seq.clamp(max=self.tok.shape[1] - 1)
            self.tok.scatter_(1, pos[:, None], torch.where(grow, token, self.tok.gather(1, pos[:, None])[:, 0])[:, None])
            self.seq = self.seq + grow.long()
            rows = grow.sum()
            if self.K:
                self._count(0, "proposed", rows)
                self._count(0, "proposals", rows)
            st.passes += 1
            self._count(0, "row_passes", rows)

    def _draft_token(self, out, start, hf, end, grow) -> torch.Tensor:
        """Level 0's next token [B] from its states at each row's last position (stored as rows when sampling)."""
        last = (end - start - 1).clamp(min=0)
        rows = torch.arange(len(last))
        feats = out[rows, last][:, None]  # [B, 1, H]
        logits = self._logits(0, feats, None if hf is None else hf[rows, last][:, None],
                              pos=(start + last)[:, None])[:, 0]
        if self.do_sample:
            probs = logits_to_probs(logits, **self.warp)
            token = sample(probs, self.generator)
            if self.K:  # (`ngram|EXIT`: only the exit's rows; the lookup's rows hold their point masses)
                self._store_rows(0, self.seq, probs[:, None], only=grow if self.levels[0].lookup else None)
        else:
            token = logits.argmax(-1)
        return token

    def _propose_ngram(self, rows: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
        """The n-gram lookup for `rows` (an `ngram` level 0, or the first try of `ngram|EXIT`): writes up to `room`
        proposed tokens after each row's known ones (as point masses when sampling) and advances `seq`; returns
        the proposal lengths (0 where nothing matched)."""
        props, n = propose_batch(self.tok, self.seq, rows, room.clamp(min=0), self.ngram)
        hit = n > 0
        if bool(hit.any()):
            W = props.shape[1]
            pos = (self.seq[:, None] + torch.arange(W, device=n.device)).clamp(max=self.tok.shape[1] - 1)
            put = torch.arange(W, device=n.device) < n[:, None]
            self.tok.scatter_(1, pos, torch.where(put, props, self.tok.gather(1, pos)))
            if self.do_sample and self.K:  # an n-gram proposal is a point mass
                onehot = torch.nn.functional.one_hot(props, self.adapter.vocab_size).float()
                self._store_rows(0, self.seq, onehot, only=hit)
            self.seq = self.seq + n
            self._pending += W
        return n

    def _ready(self, k: int) -> torch.Tensor:
        """Rows for which level k may verify now: gathered gam[k-1] tokens, at their limit/EOS, or (ngram below)
        out of proposals."""
        stop = self._stop_pos()
        count = torch.minimum(self.seq, stop) - self.ver[k]
        ready = (count >= self.gam[k - 1]) | (self.seq >= stop)
        if k == 1 and (self.levels[0].kind == "ngram" or self.levels[0].lookup):
            ready |= self.exhausted
        if k == 1:
            ready |= self.gated
        return ready

    def verify(self, k: int, active: torch.Tensor):
        """Level k verifies, for the active rows, the tokens level k-1 gathered beyond ver[k]; a row with nothing
        gathered (its level k-1 is switched off, or an n-gram found nothing) gets one token of level k's own."""
        t0 = timing.now(self.device)
        stop = self._stop_pos()
        m = (torch.minimum(self.seq, stop) - self.ver[k]).clamp(min=0)
        part = active & ((m > 0) | (self.seq < stop))
        m = torch.where(part, m, torch.zeros_like(m))
        if not len(m):
            return
        anyone, M = torch.stack([part.any().long(), m.max()]).tolist()  # one wait for the device, not two
        if not anyone:
            return
        a, new, probs = self._judge(k, part, m, M)
        if self.policy is not None:
            self.policy.observe(self, k, part, m, a, new, probs)
        new_seq = self._settle(k, part, a, new, stop)
        st = self.stats.levels[k]
        self._count(k, "accepted", a.sum())
        self._count(k, "proposed", m.sum())
        self._count(k, "rejections", (part & (a < m)).sum())
        st.passes += 1
        self._count(k, "row_passes", part.sum())
        if k < self.K:
            self._pending += 1  # (its own token, past what it accepted)
        if k == self.K:
            self.base = torch.where(part, new_seq, self.base)
        st.seconds += timing.now(self.device) - t0

    def _judge(self, k: int, part: torch.Tensor, m: torch.Tensor, M: int | None = None):
        """Advance ranges 0..k over the pending positions of the rows `part` and apply level k's acceptance rule to
        their `m` candidates (M: the most of any row, when known) -> (accepted [B], 0 outside `part`; level k's
        next token [B]; its rows or None)."""
        out = hf = start = None
        for j in range(k + 1):
            out, start, hf = self._advance(j, torch.where(part, self.seq, self.done[j]))
        M = int(m.max()) if M is None else M
        feats = out[:, : M + 1]  # range k started at ver[k] - 1 for participating rows
        pos = start[:, None] + torch.arange(M + 1, device=start.device)
        logits = self._logits(k, feats, None if hf is None else hf[:, : M + 1], pos=pos)  # [B, M+1, V]
        cidx = (self.ver[k][:, None] + torch.arange(M, device=m.device)).clamp(max=self.tok.shape[1] - 1)
        cands = self.tok.gather(1, cidx)
        probs = None
        if self.do_sample:
            probs = logits_to_probs(logits, **self.warp)
            q = self._read_rows(k - 1, self.ver[k], M) if M else probs[:, :0]
            accept = hsd_accept if self.verification == "hsd" else speculative_accept
            a, new = accept(cands, m, q, probs, self.generator)
            if k < self.K:
                self._store_rows(k, self.ver[k], probs)
        else:
            a, new = greedy_accept(cands, m, logits)
        return torch.where(part, a, torch.zeros_like(a)), new, probs

    def _settle(self, k: int, part: torch.Tensor, a: torch.Tensor, new: torch.Tensor, stop: torch.Tensor):
        """Keep the `a` accepted tokens of the rows `part` and append level k's own `new` one (below `stop`), roll
        every range back past them, and mark them verified by levels 1..k; returns the new `seq`."""
        newpos = self.ver[k] + a
        has_new = part & (newpos < stop)
        pos = newpos.clamp(max=self.tok.shape[1] - 1)
        keep_tok = self.tok.gather(1, pos[:, None])[:, 0]
        self.tok.scatter_(1, pos[:, None], torch.where(has_new, new, keep_tok)[:, None])
        # Roll back every range past the last kept position of participating rows.
        big = torch.full_like(newpos, torch.iinfo(torch.long).max)
        self._roll_back(torch.where(part, newpos, big))
        new_seq = torch.where(part, newpos + has_new.long(), self.seq)
        self.seq = new_seq
        for i in range(1, k + 1):
            self.ver[i] = torch.where(part, new_seq, self.ver[i])
        if k == 1:
            self.exhausted &= ~part
            self.gated &= ~part
        if k == self.K:
            self._eagle_drop_drafts(part)
        return new_seq

    def _roll_back(self, keep_below: torch.Tensor):
        """Forget, in every range (and stateful head), the KV and progress at positions >= keep_below [B]."""
        ranges = []
        for j in range(self.K + 1):
            ranges.append((self.bounds[j], self.bounds[j + 1]))
            if self.state_heads[j] is not None:
                c = self.state_heads[j].cache_index
                ranges.append((c, c + 1))
            self.done[j] = torch.minimum(self.done[j], keep_below)
        self.cache.truncate_ranges(ranges, keep_below)

    def run_level(self, k: int, active: torch.Tensor):
        """One round at level k for the active rows (see the module docstring: a round)."""
        if k == 0:
            self.draft_step(active)
            return
        while True:
            todo = active & ~self._ready(k)
            if not self._more_to_draft(k, todo):
                break
            self.run_level(k - 1, todo)
        self.verify(k, active)

    def _more_to_draft(self, k: int, todo: torch.Tensor) -> bool:
        """Whether any row of `todo` still gathers for level k. Where level k-1 is an exit's draft step (level 0
        under level 1, no lookup), the width of that step's pass is read in the same copy from the device and kept
        for it (`_draft_width`): one wait for the device per draft step, not two."""
        lv = self.levels[0]
        if k != 1 or lv.kind not in ("exit", "full") or lv.lookup or not len(todo):
            return bool(todo.any())
        grow = todo & (self.seq < self._stop_pos())  # what `draft_step` computes, from the same state
        n = (torch.where(grow, self.seq, self.done[0]) - self.done[0]).clamp(min=0)
        anyone, width = torch.stack([todo.any().long(), n.max()]).tolist()
        self._draft_width = width if anyone else None
        return bool(anyone)

    def begin_round(self) -> None:
        """Before a round: the policy (if any) sets every row's gammas; `auto`'s guard may then make the round
        plain (`_PlainGuard`)."""
        if self.policy is None:
            return
        self.policy.choose(self)
        guard = getattr(self.policy, "guard", None)
        if guard is not None:
            guard.begin(self)

    def end_round(self) -> None:
        """After a round's last commit: the guard times it."""
        guard = getattr(self.policy, "guard", None) if self.policy is not None else None
        if guard is not None:
            guard.end(self)

    def run(self):
        """The whole call: prefill, then rounds (chains, or trees: `hispec.decoding.tree`) until every row is finished;
        returns each row's new tokens by id."""
        self.prefill()
        alive = self.commit()
        while alive:
            self.begin_round()
            if self.tree is not None and (self.policy is None or bool((self.gam[0] > 0).any())):
                if self.drafter is not None:
                    eagle_tree_round(self, self.tree)
                else:
                    (dynamic_round if isinstance(self.tree, DynamicTreeSpec) else tree_round)(self, self.tree)
            else:  # a chain round (with trees: every row plain this round)
                self.run_level(self.K, torch.ones_like(self.seq, dtype=torch.bool))
            alive = self.commit()
            self.end_round()
        self.stats.new_tokens = sum(len(t) for t in self.results.values())
        return self.results
