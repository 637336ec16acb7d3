"""Static trees drafted by the EAGLE-3 drafter: `eagle3>full` / `ngram|eagle3>full` with `tree=[k1, ..., kD]`.

The tree format, its acceptance and its rollback are `hispec.decoding.tree`'s (one draft level directly under the full
model); what differs is who drafts. One round, per row:
1. The drafter catches up the context the full model verified since its last step and proposes for position seq
   (`_EagleDrafting._eagle_advance`, a chain's first draft step). Depth 1 = its top-k1 (sampling: k1 draws without
   replacement from its warped distribution q; zero outside its draft vocabulary).
2. For d = 1..D-1, ONE drafter pass over all depth-d nodes. Node i at depth d is the drafter entry "token(i) at
   position seq + d - 1, with its parent's output state" (a depth-1 node: the state `dh` of the last context entry,
   as a chain's draft entry); it attends to every context entry and to its own ancestors and itself (siblings
   share a position, so an explicit mask separates them). Node i's keys go to slot seq + i of the drafter's
   buffer: past every context entry, and dropped after the round like a chain's draft entries (the buffer has
   N spare slots for it). Its logits give its children.
3. ONE full pass over the row's pending position(s) and all N nodes (a node sees itself and its ancestors among
   the tree's slots), capturing the drafter's aux layers on the way (`hispec.decoding.tree._allow`, `run_layers(capture=)`).
4. Acceptance as every static tree (`hispec.decoding.tree.accept_tree`); the accepted path and the full model's token are
   committed, the full model's cache keeps the path (`_keep_path`), and the aux states of the pending positions and
   of the path are stored, so the drafter's next catch-up recomputes the accepted tokens as context entries from
   the target's states, exactly as after a chain (and as training's step 0 sees them).
Lossless for the reasons `hispec.decoding.tree` gives: greedy commits only the full model's argmax given the committed
prefix (each node's full-model row was computed with exactly its ancestors as context); sampling is speculative
sampling per depth against the drafter's stored q, children drawn without replacement.
Under `auto` (which plans a drafter tree where the latency model predicts it faster than every chain), a row
switched to plain decoding (`gam[0]` 0), or to the lookup alone (`lookup_only`, where it missed), drafts nothing
and gets the full model's token from the same pass; the
drafting rows' top-1 and top-k at the root are observed, the plain rows' drafter is shadowed as in chains
(`_AutoPolicy.observe_tree`).
"""

from __future__ import annotations

import torch

from .. import sampling, timing
from ..drafters.eagle3 import KVBuffer
from .tree import (_count, _keep_path, _Layout, _lookup_first, _write_path, accept_tree, observe_tree,
                    verify_tree)


def eagle_tree_round(run, spec) -> None:
    """One drafter-tree round for every row of `run` (a `hispec.decoding.rounds._Run` whose levels are
    [eagle3, full]); see the module docstring."""
    if run.levels[0].lookup and not _lookup_first(run) or run.verify_plainly_if_none_drafts():
        return
    lay = getattr(run, "_tree_layout", None)
    if lay is None:
        lay = run._tree_layout = _Layout(spec, run.seq.device)
    ad, cache, drafter = run.adapter, run.cache, run.drafter
    st0, st1 = run.stats.levels
    dev = run.seq.device
    B, N, D = len(run.seq), spec.size, spec.depth
    _, a1, L = run.bounds  # level 0 has no layers of the model: the full model's range is all of it
    V, Vd = ad.vocab_size, drafter.config.draft_vocab_size
    t0 = timing.now(run.device)

    seq = run.seq.clone()  # tokens [0, seq) are committed; seq - 1 has passed no range yet
    part = seq < run.limit  # rows that still decode
    # per row: drafts that can still be committed (none for a row `auto` switched to plain decoding or lookup only)
    depth_cap = (run.limit - seq).clamp(min=0, max=D)
    if run.policy is not None:
        depth_cap = depth_cap * run.drafting_rows()
    grow = depth_cap > 0
    run._advance(0, seq)  # the pending tokens' embeddings (range 0 is empty) into hid[1]
    # ---------------------------------------------------------------- drafting
    logits, n_ctx = run._eagle_advance(grow)  # [B, Vd]: each row's proposal for position seq
    if logits is None:  # (no row drafts: every one is at its limit)
        logits = torch.zeros(B, Vd, dtype=run.aux.dtype, device=dev)
    ntok = torch.zeros(B, N, dtype=torch.long, device=dev)
    nvalid = torch.zeros(B, N, dtype=torch.bool, device=dev)
    nh = torch.zeros(B, N, drafter.config.hidden_size, dtype=run.dh.dtype, device=dev)  # each node's output state
    qrows = torch.zeros(B, 1 + N, V, dtype=torch.float32, device=dev) if run.do_sample else None  # 0: the root
    scratch = run.dk.shape[2] - 1
    embed = run.model.base.get_input_embeddings()
    S0 = int(seq.max())  # (one read from the device for the whole round: each pass's keys run to S0 + its nodes)

    def children(d: int, parent_logits: torch.Tensor, parent_valid: torch.Tensor) -> None:
        """Depth d's tokens from their parents' draft-vocabulary logits `[B, n_{d-1}, Vd]`."""
        k, sl = spec.widths[d - 1], lay.nodes(d)
        if run.do_sample:
            q = run._eagle_probs(parent_logits.reshape(-1, Vd)).reshape(B, -1, V)
            first = 0 if d == 1 else 1 + lay.offset[d - 2]
            qrows[:, first: first + q.shape[1]] = q
            tk, ok = sampling.sample_without_replacement(q.reshape(-1, V), k, run.generator)
            tk, ok = tk.reshape(B, -1), ok.reshape(B, -1)
        else:
            tk = drafter.to_target(parent_logits.topk(k, dim=-1).indices).reshape(B, -1)
            ok = torch.ones_like(tk, dtype=torch.bool)
        ntok[:, sl] = tk
        nvalid[:, sl] = ok & parent_valid.repeat_interleave(k, dim=1) & (d <= depth_cap)[:, None]

    def draft(d: int) -> torch.Tensor:
        """One drafter pass over the depth-d nodes -> their draft-vocabulary logits `[B, n_d, Vd]`."""
        sl = lay.nodes(d)
        q_nodes = torch.arange(sl.start, sl.stop, device=dev)
        valid = nvalid[:, sl]
        hidden = run.dh[:, None].expand(-1, len(q_nodes), -1) if d == 1 else nh[:, lay.parent[sl]]
        pos = (seq + d - 1)[:, None].expand(-1, len(q_nodes))
        write = torch.where(valid, seq[:, None] + q_nodes, torch.full_like(pos, scratch))
        keys = torch.arange(S0 + sl.stop, device=dev)
        rel = keys[None] - seq[:, None]  # [B, S]: a key's node id (slot seq + i holds node i)
        in_tree = (rel >= 0) & (rel < sl.stop)
        anc = lay.anc[q_nodes][None].expand(B, -1, -1).gather(2, rel.clamp(0, N - 1)[:, None].expand(-1, len(q_nodes), -1))
        mask = ((keys >= 1) & (rel < 0))[:, None] | (in_tree[:, None] & anc)  # [B, n_d, S]: context + ancestry
        mask = torch.where(valid[..., None], mask, (keys == 0)[None, None])  # padding queries read empty slot 0
        step = drafter.step(embed(ntok[:, sl]).to(run.aux.dtype), hidden.to(run.aux.dtype), pos,
                            KVBuffer(run.dk, run.dv, write), mask)
        nh[:, sl] = step.hidden.to(nh.dtype)
        return step.logits

    children(1, logits[:, None], grow[:, None])
    for d in range(1, D):
        children(d + 1, draft(d), nvalid[:, lay.nodes(d)])
    rows_per_depth = [nvalid[:, lay.nodes(d)].any(1).sum() for d in range(1, D)]  # rows each inner pass ran for
    proposed, drafted, entries, inner, *rows_d = torch.stack(
        [nvalid.sum(), grow.sum(), n_ctx.sum(), nvalid[:, : lay.offset[D - 1]].sum(), *rows_per_depth]).tolist()
    st0.passes += D
    st0.row_passes += drafted + sum(rows_d)
    st0.layer_evals += entries + inner  # one drafter layer per entry: the catch-up, then every inner node
    st0.proposed += proposed
    st0.proposals += drafted
    st0.seconds += timing.now(run.device) - t0
    t1 = timing.now(run.device)

    # ---------------------------------------------------------------- verification (one pass of the full model)
    capture = run._eagle_capture(run.K)  # the drafter's aux layers, for the pending positions and the path
    _, flog, P, pvalid, ppos, T0 = verify_tree(run, lay, seq, ntok, nvalid, capture)  # (from the embeddings)

    # ---------------------------------------------------------------- acceptance, commit, rollback
    path, bonus, prow, pred = accept_tree(run, spec, lay, flog, ntok, nvalid, qrows)
    observe_tree(run, spec, grow, part, ntok, qrows, prow, pred, bonus)  # (`auto`: its rows' estimates, shadows)
    a, keep, newpos, has_new = _write_path(run, path, ntok, bonus, seq, D)
    pidx = path.clamp(min=0)
    # the drafter's inputs for its next catch-up: the aux states of the pending positions and of the path
    run._eagle_store(ppos, pvalid, {i: s[:, :P] for i, s in capture.items()})
    at = (P + pidx)[..., None].expand(-1, -1, capture[run.aux_layers[0]].shape[-1])
    run._eagle_store(seq[:, None] + torch.arange(D, device=dev), keep,
                     {i: s.gather(1, at) for i, s in capture.items()})
    _keep_path(run, cache, None, (a1, a1, L), {0: 0, 1: T0}, pidx, pidx, keep, newpos, has_new)
    run._eagle_drop_drafts(torch.ones_like(grow))  # the tree's entries go; the path comes back as context
    _count(run, a, depth_cap, B, t1)
