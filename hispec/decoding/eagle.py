"""The EAGLE-3 drafter (`hispec.drafters.eagle3`) as level 0 of a round: hierarchies `eagle3>full` and `ngram|eagle3>full`.

The drafter reads the full model's residual stream at its aux layers, which verification computes anyway: the top
range's `run_layers` captures them (`capture`) for every position it runs, into `aux` (valid below done[K], like
the final states). The drafter keeps its own keys/values by position (`dk`, `dv`); its entry q is "token q with
the states of position q - 1" and predicts token q + 1 (the alignment of `speculators`, and of training).
Per row:
- `dctx`: entries below it are *context* entries, computed from the target's states of verified tokens;
- `dlen`: entries below it are valid now: the context plus this round's *draft* entries, computed from the
  drafter's own previous output state `dh` (the next step's input);
- a draft step computes the entries [dlen, seq): at a round's first step the context the full model verified
  since the last round (many positions, one pass), later one draft entry; the last entry's logits give the token
  at seq. After the full model verifies, draft entries are dropped (dlen = dctx): accepted tokens become context
  entries at the next step, recomputed from the target's states, exactly as training's step 0 sees them.
Lossless as every level 0: the full model verifies every drafted token (greedy: longest agreeing prefix; sampling:
speculative sampling with the drafter's warped distribution, zero outside its draft vocabulary, as proposal).
The drafter drafts directly for the full model only (its inputs are the full model's verified states).
"""

from __future__ import annotations

import torch

from ..drafters.eagle3 import KVBuffer
from ..sampling import logits_to_probs, rank_among, sample
from .stats import LevelStats


class _EagleDrafting:
    """Level-0 drafting with an EAGLE-3 drafter, mixed into `hispec.decoding.rounds._Run`."""

    aux = dk = dv = dctx = dlen = dh = None
    drafter = None

    def _init_eagle(self, B: int, cap: int) -> None:
        """Per-row buffers for the drafter (only when level 0 is `eagle3`)."""
        d = self.model.drafter
        if d is None:
            raise ValueError("level 'eagle3' needs an EAGLE-3 drafter: load the checkpoint with one "
                             "(hispec.load(path, drafter=RUN) or hispec-export RUN --drafter DRAFTER_RUN)")
        if self.K < 1 or self.bounds[self.K - 1] != 0:
            raise ValueError("an eagle3 drafter drafts directly for the full model: use eagle3>full or "
                             "ngram|eagle3>full")
        c, dev, dt = d.config, self.adapter.device, self.adapter.dtype
        self.drafter, self.aux_layers = d, list(c.aux_layers)
        self.aux = torch.zeros(B, cap, len(c.aux_layers) * c.hidden_size, dtype=dt, device=dev)
        # the last slot is scratch: padding queries write there, and no mask reaches it; a drafter tree's nodes
        # take the slots past each row's context (`hispec.decoding.eagle_tree`): N more
        spare = self.tree.size if self.tree is not None else 0
        self.dk = torch.zeros(B, c.num_key_value_heads, cap + 1 + spare, c.head_dim, dtype=dt, device=dev)
        self.dv = torch.zeros_like(self.dk)
        self.dctx = torch.ones(B, dtype=torch.long, device=dev)  # entry 0 does not exist (no state before it)
        self.dlen = self.dctx.clone()
        self.dh = torch.zeros(B, c.hidden_size, dtype=dt, device=dev)

    def _eagle_capture(self, j: int) -> dict | None:
        """The aux layers to capture while range j runs (the top range, when level 0 is the drafter)."""
        return {i: None for i in self.aux_layers} if self.aux is not None and j == self.K else None

    def _eagle_store(self, idx: torch.Tensor, valid: torch.Tensor, captured: dict) -> None:
        """Keep the captured aux states `[B, T, H]` of positions `idx` `[B, T]` (real ones: `valid`)."""
        states = torch.cat([captured[i] for i in self.aux_layers], -1)
        r, c = valid.nonzero(as_tuple=True)
        self.aux[r, idx[r, c]] = states[r, c].to(self.aux.dtype)

    def _draft_eagle(self, grow: torch.Tensor, st: LevelStats) -> None:
        """One drafted token for each row of `grow` (see the module docstring). With a `draft_gate` g > 0, where
        the drafter's most likely token has a probability below g nothing is proposed: the row stops drafting
        this round (`gated`) and the full model verifies what it has (nothing: one plain step). Greedy: the
        drafter's softmax; sampling: its warped distribution. The rule reads the distribution BEFORE a token is
        drawn from it, never the drawn token: a token that is proposed is then an exact draw from the proposal
        that verification divides by, so sampling keeps the target distribution (a gate on the drawn token's own
        probability would propose from q cut to its likely tokens and bias the output: the chi-square test
        caught that). Greedy stays lossless either way (the full model verifies every proposed token)."""
        logits, n = self._eagle_advance(grow)
        if logits is None:
            return
        token, conf = self._eagle_token(logits, grow)
        low = torch.zeros_like(grow)
        if self.draft_gate > 0:
            low = grow & (conf < self.draft_gate)
            self.gated |= low
            grow = grow & ~low
        pos = self.seq.clamp(max=self.tok.shape[1] - 1)
        self.tok.scatter_(1, pos[:, None], torch.where(grow, token, self.tok.gather(1, pos[:, None])[:, 0])[:, None])
        self.seq = self.seq + grow.long()
        rows, entries, gated = torch.stack([grow.sum(), n.sum(), low.sum()]).tolist()  # (one read from the device)
        st.gated += gated
        st.proposed += rows
        st.proposals += rows
        st.passes += 1
        st.row_passes += rows
        st.layer_evals += entries  # one decoder layer per entry

    def _eagle_advance(self, grow: torch.Tensor):
        """The drafter over entries [dlen, seq) of the rows `grow` (context caught up, then at most one draft
        entry); returns (draft-vocabulary logits `[B, Vd]` of each row's last entry: its proposal for position
        seq, or None when no row has an entry to compute; entries computed per row `[B]`)."""
        start, end = self.dlen, self.seq
        n = torch.where(grow, end - start, torch.zeros_like(end))
        T = int(n.max())
        if T == 0:
            return None, n
        ar = torch.arange(T, device=n.device)
        valid = ar < n[:, None]
        idx = torch.where(valid, start[:, None] + ar, start[:, None])  # [B, T] entry positions
        step = self._eagle_step(idx, valid, grow, n)
        last = (n - 1).clamp(min=0)
        rows = torch.arange(len(n), device=n.device)
        self.dh = torch.where(grow[:, None], step.hidden[rows, last].to(self.dh.dtype), self.dh)
        self.dctx = torch.where(grow, torch.maximum(self.dctx, torch.minimum(end, self.done[self.K] + 1)), self.dctx)
        self.dlen = torch.where(grow, end, self.dlen)
        return step.logits[rows, last], n

    def _eagle_shadow(self, rows: torch.Tensor, new: torch.Tensor, probs, topk: int = 0):
        """For rows (bool `[B]`) decoding plainly, whose full model just produced `new` at position seq: the
        switched-off drafter's proposal there, compared with it (greedy: 1.0 where equal; sampling: the exact
        acceptance probability sum(min(p, q)) of one draft from the drafter's warped distribution q against the
        full model's `probs[:, 0]`) -> `[B]` float (rows outside `rows`: 0; None when no row had an entry to
        compute). The drafter's context entries are caught up on the way (the work its next draft step would do
        anyway; no random number is drawn). `topk` > 0 (greedy, for `auto`'s drafter trees): returns (that, the
        rank `[B]` of `new` among the drafter's top-`topk`, `topk` where it is not among them)."""
        logits, n = self._eagle_advance(rows)
        if logits is None:
            return (None, None) if topk else None
        self.stats.levels[0].layer_evals += int(n.sum())
        if probs is None:
            x = (self.drafter.to_target(logits.argmax(-1)) == new).double()
        else:
            x = torch.minimum(self._eagle_probs(logits), probs[:, 0]).sum(-1).double()
        x = torch.where(rows, x, torch.zeros_like(x))
        if not topk:
            return x
        return x, rank_among(self.drafter.to_target(logits.topk(topk, dim=-1).indices), new)

    def _eagle_step(self, idx: torch.Tensor, valid: torch.Tensor, grow: torch.Tensor, n: torch.Tensor):
        """The drafter over entries `idx`: context entries read the target's states of the position before, a
        draft entry (the last, past done[K]) the drafter's own previous state; keys go into the buffers."""
        d = self.drafter
        tokens = self.tok.gather(1, idx)
        embeds = self.model.base.get_input_embeddings()(tokens).to(self.aux.dtype)
        prev = (idx - 1).clamp(min=0)
        fused = d.fuse(self.aux.gather(1, prev[..., None].expand(-1, -1, self.aux.shape[-1])))
        context = (idx <= self.done[self.K][:, None])[..., None]
        hidden = torch.where(context, fused, self.dh[:, None, :].to(fused.dtype))
        S = int(torch.where(grow, self.seq, torch.ones_like(self.seq)).max())
        keys = torch.arange(S, device=idx.device)
        mask = (keys >= 1) & (keys <= idx[..., None])  # [B, T, S]: every valid entry up to the query's own
        mask = torch.where(valid[..., None], mask, keys == 0)  # padding queries read the empty slot 0
        write = torch.where(valid, idx, torch.full_like(idx, self.dk.shape[2] - 1))
        return d.step(embeds, hidden, idx, KVBuffer(self.dk, self.dv, write), mask)

    def _eagle_token(self, logits: torch.Tensor, grow: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft-vocabulary logits `[B, Vd]` -> (the drafted target token `[B]`, the largest probability of the
        drafter's distribution `[B]` when a `draft_gate` reads it, else None); the distribution is stored as
        level 0's rows when sampling."""
        gate = self.draft_gate > 0
        if not self.do_sample:
            best = logits.argmax(-1)
            conf = torch.softmax(logits.float(), -1).gather(1, best[:, None])[:, 0] if gate else None
            return self.drafter.to_target(best), conf
        probs = self._eagle_probs(logits)
        token = sample(probs, self.generator)
        self._store_rows(0, self.seq, probs[:, None], only=grow if self.levels[0].lookup else None)
        return token, probs.max(-1).values if gate else None

    def _eagle_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's warped distribution `[B, V]` over the target vocabulary (zero outside its draft
        vocabulary) from its draft-vocabulary logits `[B, Vd]`."""
        ids, full = self.drafter.draft_token_ids(), logits
        if ids is not None:
            full = logits.new_full((logits.shape[0], self.adapter.vocab_size), float("-inf"))
            full.scatter_(1, ids[None].expand(logits.shape[0], -1), logits)
        return logits_to_probs(full.float(), **self.warp)

    def _eagle_drop_drafts(self, part: torch.Tensor) -> None:
        """After the full model verified the rows `part`: their draft entries go; context stays where its states
        are still valid."""
        if self.dk is None:
            return
        self.dctx = torch.minimum(self.dctx, self.done[self.K] + 1)
        self.dlen = torch.where(part, torch.minimum(self.dlen, self.dctx), self.dlen)
