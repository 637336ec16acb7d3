"""Tree drafts at level 0: branch on the draft head's top candidates, verify the whole tree in one full pass.

Format. `tree=[k1, k2, ..., kD]` (or the string `"k1x k2x...xkD"`, e.g. `"4x2x1"`): a static tree of depth D in
which every node at depth d-1 has k_d children (the root is the last committed token), so depth d holds
k1*...*kd nodes and the tree N = sum of those. Greedy: a node's children are the draft head's top-k_d tokens at
that node. Sampling: they are k_d draws *without replacement* from the draft distribution q at that node.
`tree=[1]*gamma` is a chain of gamma drafts (the same tokens as `self-spec`, verified by the tree machinery).
`tree="dyn-D-K-B-N"` is a dynamic EAGLE-2-style tree, greedy only (`DynamicTreeSpec`; its round:
`hispec.decoding.dynamic_tree.dynamic_round`).

One round, for every row of the batch (rows keep their own trees; a row's depth is cut to the tokens it may
still produce, deeper nodes are invalid slots for it):
1. Range 0 (the draft exit's layers) runs over the row's pending committed position(s), as in a chain round; its
   draft logits give depth 1. Then, for d = 1..D-1, one batched pass of range 0 (+ a `layer` head's own layer)
   over all depth-d nodes gives depth d+1. All nodes at depth d share the absolute position seq + d - 1.
2. Range 0 over the depth-D nodes, then ONE pass of the verifier's range (the rest of the model) over the
   row's pending position(s) and all N nodes gives the full model's row at the root and at every node.
3. Greedy: the deepest path whose every token equals the full model's argmax at its parent, then the full
   model's token at the end of the path. Sampling: per depth, recursive rejection sampling over the current
   node's children (`hispec.sampling.recursive_accept`); a residual sample when all are rejected, else the next
   depth; the full model's own sample after the deepest accepted node. An accepted EOS ends the path.

Lookup first (`ngram|EXIT`, `strategy="self-spec-lookup"`): every row tries the n-gram lookup first; rows it serves
are verified as a chain, then every row still decoding drafts the tree (`_lookup_first`). Under `auto` a row whose
`gam[0]` is 0 decodes plainly (no lookup, no nodes; the full model's token from the same pass), a `lookup_only`
row tries the lookup but drafts no tree where it misses, and the policy observes each round (`observe_tree`).
The EAGLE-3 drafter drafts static trees too (`hispec.decoding.eagle_tree`); dynamic trees: `hispec.decoding.dynamic_tree`.

Masks. Attention masks come from each slot's (valid, position) as everywhere in hispec; a tree pass adds an
explicit `allow` mask (`DecoderAdapter.run_layers(allow=...)`): among this round's tree slots a node sees only
itself and its ancestors (siblings share a position, so position alone cannot separate them); every slot before
the tree is decided by (valid, position) as usual.

Rollback. The tree's slots sit at the end of each range's cache (range 0, the verifier's range, a `layer` head's
extra layer), in node order. Afterwards `KVCache.compact` moves each row's accepted path to the front of that
tail and drops the rest, and `KVCache.truncate` cuts everything at the new length, so the cache holds exactly
what a chain that drafted the accepted tokens would hold (KV of accepted nodes is reused, never recomputed).
The exit states (`hid[1]`) and, for `context` heads, the final states (`fin`) of the accepted positions are
written to their per-position buffers; `done[0] = done[1] = ver[1] - 1` as after a chain verification.

Why it is lossless: greedy commits only tokens equal to the full model's argmax given the committed prefix (each
path node was computed with exactly its ancestors as context), plus the full model's own token; sampling is
ordinary speculative sampling per step with a draft that is distributed as the stored q given everything
before it (children without replacement: the renormalised q), so each committed token is an exact sample of p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import sampling, timing

MAX_TREE_NODES = 256  # one verification pass over this many positions (the cost stops being flat far below)


@dataclass(frozen=True)
class TreeSpec:
    widths: tuple[int, ...]

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def counts(self) -> list[int]:  # nodes per depth 1..D
        out, n = [], 1
        for k in self.widths:
            n *= k
            out.append(n)
        return out

    @property
    def size(self) -> int:
        return sum(self.counts)

    def __str__(self) -> str:
        return "x".join(str(k) for k in self.widths)


def parse_tree(tree):
    """`None` -> None (chains); `[k1, ..., kD]`, `(k1, ...)` or `"k1xk2x..."` / `"k1,k2,..."` -> TreeSpec;
    `"dyn-D-K-B-N"` -> DynamicTreeSpec (greedy only); anything else -> ValueError."""
    if tree is None:
        return None
    if isinstance(tree, (TreeSpec, DynamicTreeSpec)):
        return tree
    if isinstance(tree, str) and tree.strip().lower().startswith("dyn"):
        return parse_dynamic(tree.strip().lower())
    if isinstance(tree, str):
        parts = [p.strip() for p in tree.replace(",", "x").lower().split("x")]
        try:
            widths = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"tree {tree!r}: expected widths per depth such as '4x2x1' or [4, 2, 1]") from None
    elif isinstance(tree, (list, tuple)):
        widths = list(tree)
    else:
        raise ValueError(f"tree must be a list of widths per depth (e.g. [4, 2, 1]) or a string '4x2x1', "
                         f"got {tree!r}")
    if not widths:
        raise ValueError("tree is empty: give at least one depth, e.g. [4, 2, 1]")
    for k in widths:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"tree widths must be integers >= 1, got {tree!r}")
    spec = TreeSpec(tuple(widths))
    if spec.size > MAX_TREE_NODES:
        raise ValueError(f"tree {spec} has {spec.size} nodes; at most {MAX_TREE_NODES} are verified in one pass")
    return spec


def check_tree(spec, levels, *, max_new_tokens: int, policy, do_sample: bool = False) -> None:
    """Trees need a draft exit (static or dynamic trees) or the EAGLE-3 drafter (static trees,
    `hispec.decoding.eagle_tree`) directly under the full model; refuse anything else before any work."""
    if do_sample and isinstance(spec, DynamicTreeSpec):
        raise ValueError(f"dynamic tree {spec} is greedy only: which drafted children it keeps depends on their own "
                         f"draft probabilities, which no lossless sampling rule here allows; use a static tree "
                         f"such as [4, 2, 1] when sampling")
    kinds = [lv.kind for lv in levels]
    if kinds not in (["exit", "full"], ["eagle3", "full"]):
        raise ValueError(f"tree drafts need a hierarchy of one draft exit or the EAGLE-3 drafter under the full model "
                         f"(e.g. 'self-spec', 'draft>full', 'eagle'), got {'>'.join(lv.name for lv in levels)}")
    if kinds[0] == "eagle3" and isinstance(spec, DynamicTreeSpec):
        raise ValueError(f"the EAGLE-3 drafter drafts static trees (e.g. [4, 2, 1]); dynamic tree {spec} is for "
                         f"draft exits")
    if policy is not None:
        raise ValueError("tree drafts do not take a policy of yours (strategy='auto' plans its own trees where "
                         "the calibration predicts them faster: drop tree= to let it)")
    if max_new_tokens and spec.depth > max_new_tokens:
        raise ValueError(f"tree {spec} is {spec.depth} deep but max_new_tokens is {max_new_tokens}; "
                         f"a tree deeper than the tokens to generate drafts nothing that can be used")


class _Layout:
    """Node ids by depth (depth 1 first), parents, depths, ancestry — the same for every row."""

    def __init__(self, spec: TreeSpec, device):
        self.spec = spec
        counts = spec.counts
        self.offset = [0]
        for n in counts:
            self.offset.append(self.offset[-1] + n)
        N = spec.size
        parent, depth = [], []
        for d, (k, n) in enumerate(zip(spec.widths, counts), start=1):
            for j in range(n):
                parent.append(-1 if d == 1 else self.offset[d - 2] + j // k)
                depth.append(d)
        self.parent = torch.tensor(parent, dtype=torch.long, device=device)
        self.depth = torch.tensor(depth, dtype=torch.long, device=device)
        anc = torch.eye(N, dtype=torch.bool, device=device)
        for i in range(N):  # parents come before children
            if parent[i] >= 0:
                anc[i] |= anc[parent[i]]
        self.anc = anc  # anc[i, j]: j is i or an ancestor of i

    def nodes(self, d: int) -> slice:
        return slice(self.offset[d - 1], self.offset[d])


def _allow(lay: _Layout, q_nodes: torch.Tensor, slot_nodes: torch.Tensor, before: int, q_plain: int = 0):
    """`[1, q_plain + len(q_nodes), before + q_plain + len(slot_nodes)]`: plain queries / slots (the first
    `q_plain` queries, the first `before + q_plain` slots) follow (valid, position) alone; tree queries see tree
    slots only where they are an ancestor or themselves."""
    Tq, S = q_plain + len(q_nodes), before + q_plain + len(slot_nodes)
    m = torch.ones(Tq, S, dtype=torch.bool, device=lay.anc.device)
    if len(q_nodes) and len(slot_nodes):
        m[q_plain:, before + q_plain:] = lay.anc[q_nodes][:, slot_nodes]
    return m[None]


def tree_round(run, spec):
    """One tree round for every row of `run` (a `hispec.decoding._Run` with levels [exit, full]); under a
    lookup-first exit (`ngram|EXIT`) the n-gram lookup goes first (`_lookup_first`)."""
    if run.levels[0].lookup and not _lookup_first(run) or run.verify_plainly_if_none_drafts():
        return
    ad, cache = run.adapter, run.cache
    lay = getattr(run, "_tree_layout", None)
    if lay is None:
        lay = run._tree_layout = _Layout(spec, run.seq.device)
    st0, st1 = run.stats.levels
    dev = run.seq.device
    B, N, D = len(run.seq), spec.size, spec.depth
    rows = torch.arange(B, device=dev)
    a0, a1, L = run.bounds
    head = run.state_heads[0]
    H = ad.hidden_size
    t0 = timing.now(run.device)

    seq = run.seq.clone()  # tokens [0, seq) are committed; seq - 1 has passed no range yet
    part = seq < run.limit  # rows that still decode
    # per row: drafts that can still be committed (none for a row `auto` switched to plain decoding or lookup only)
    depth_cap = (run.limit - seq).clamp(min=0, max=D) * run.drafting_rows()
    # ---------------------------------------------------------------- drafting
    out, logits = _root(run, seq, rows)  # [B, 1, V]
    ntok = torch.zeros(B, N, dtype=torch.long, device=dev)
    nvalid = torch.zeros(B, N, dtype=torch.bool, device=dev)
    h_exit = torch.zeros(B, N, H, dtype=out.dtype, device=dev)  # range 0's output per node
    V = logits.shape[-1]
    qrows = torch.zeros(B, 1 + N, V, dtype=torch.float32, device=dev) if run.do_sample else None  # 0: root
    T0 = {0: cache.seq_length(a0, a1)}  # where the tree's slots start in each cache
    if head is not None:
        T0["h"] = cache.get_seq_length(head.cache_index)

    def children(d: int, parent_logits: torch.Tensor, parent_valid: torch.Tensor):
        """Depth d's tokens from their parents' draft logits `[B, n_{d-1}, V]`."""
        k, sl = spec.widths[d - 1], lay.nodes(d)
        if run.do_sample:
            q = sampling.logits_to_probs(parent_logits, **run.warp)
            first = 0 if d == 1 else 1 + lay.offset[d - 2]
            qrows[:, first : first + q.shape[1]] = q
            tk, ok = sampling.sample_without_replacement(q.reshape(-1, V), k, run.generator)
            tk, ok = tk.reshape(B, -1), ok.reshape(B, -1)
        else:
            tk = parent_logits.topk(k, dim=-1).indices.reshape(B, -1)
            ok = torch.ones_like(tk, dtype=torch.bool)
        ok = ok & parent_valid.repeat_interleave(k, dim=1) & (d <= depth_cap)[:, None]
        ntok[:, sl], nvalid[:, sl] = tk, ok

    def range0(d: int, want_logits: bool):
        """Range 0 (+ a `layer` head's layer) over the depth-d nodes; their draft logits if wanted."""
        sl = lay.nodes(d)
        q_nodes = torch.arange(sl.start, sl.stop, device=dev)
        slot_nodes = torch.arange(0, sl.stop, device=dev)  # every node of depths 1..d, in order
        valid = nvalid[:, sl]
        pos = torch.where(valid, (seq + d - 1)[:, None], seq[:, None] - 1).expand(-1, len(q_nodes))
        inp = ad.embed(ntok[:, sl], pos)
        allow = _allow(lay, q_nodes, slot_nodes, T0[0])
        o = ad.run_layers(inp, a0, a1, position_ids=pos, cache=cache, valid=valid, allow=allow)
        st0.layer_evals += int(valid.sum()) * (a1 - a0)
        h_exit[:, sl] = o
        feats = None
        if head is not None:
            allow_h = _allow(lay, q_nodes, slot_nodes, T0["h"])

            def run_layer(module, hidden):
                return ad.run_module(module, head.layer_type, hidden, cache_index=head.cache_index,
                                     position_ids=pos, cache=cache, valid=valid, allow=allow_h)

            feats = head(o, run_layer)
            st0.layer_evals += int(valid.sum())
        if not want_logits:
            return None
        return run._logits(0, o, feats, pos=pos)

    children(1, logits, torch.ones(B, 1, dtype=torch.bool, device=dev))
    st0.passes += 1
    st0.row_passes += B
    for d in range(1, D):
        lg = range0(d, True)
        children(d + 1, lg, nvalid[:, lay.nodes(d)])
        st0.passes += 1
        st0.row_passes += int(nvalid[:, lay.nodes(d)].any(1).sum())
    st0.proposed += int(nvalid.sum())
    st0.proposals += int((depth_cap > 0).sum())  # rows that drafted (not plain rows, not rows at their limit)
    st0.seconds += timing.now(run.device) - t0
    t1 = timing.now(run.device)

    # ---------------------------------------------------------------- verification (one pass of the rest)
    range0(D, False)
    o, flog, P, pvalid, ppos, T0[1] = verify_tree(run, lay, seq, h_exit, nvalid)

    # ---------------------------------------------------------------- acceptance
    path, bonus, prow, pred = accept_tree(run, spec, lay, flog, ntok, nvalid, qrows)
    observe_tree(run, spec, depth_cap > 0, part, ntok, qrows, prow, pred, bonus)
    # ---------------------------------------------------------------- commit the path, roll back the rest
    a, keep, newpos, has_new = _write_path(run, path, ntok, bonus, seq, D)
    pidx = path.clamp(min=0)
    _write_states(run, seq, keep, h_exit, pidx, o, P, pidx, pvalid, ppos)
    _keep_path(run, cache, head, (a0, a1, L), T0, pidx, pidx, keep, newpos, has_new)
    _count(run, a, depth_cap, B, t1)


def _root(run, seq, rows):
    """Range 0 over every row's pending token (its newest committed one) -> (range 0's output, the exit's logits at
    that position `[B, 1, V]`: the root's children), the start of every tree round (static and dynamic)."""
    out, start, hf = run._advance(0, seq)
    if out is None:
        raise RuntimeError("tree round: the newest committed token has already passed the draft range")
    last = (seq - 1 - start).clamp(min=0)
    return out, run._logits(0, out[rows, last][:, None], None if hf is None else hf[rows, last][:, None],
                            pos=(seq - 1)[:, None])


def verify_tree(run, lay: _Layout, seq, node_states, nvalid, capture: dict | None = None):
    """ONE pass of the verifier's range (the layers above level 0's) over each row's pending position(s) and all N
    tree nodes (`node_states`: the range's inputs `[B, N, H]`, or token ids `[B, N]` where it starts at the
    embedding; valid where `nvalid`), a node seeing only itself and its ancestors among the tree's slots; `capture`
    as in `run_layers` -> (the range's output `[B, P + N, H]`, the full model's logits `[B, 1 + N, V]` (0: the root,
    1 + i: node i), P the most pending positions of any row, pvalid / ppos `[B, P]`, the tree's first cache slot)."""
    ad, cache = run.adapter, run.cache
    _, a1, L = run.bounds
    B, N, dev = nvalid.shape[0], nvalid.shape[1], nvalid.device
    pstart = run.done[1]
    P = int((seq - pstart).max())
    ar = torch.arange(P, device=dev)
    pvalid = ar < (seq - pstart)[:, None]
    ppos = torch.where(pvalid, pstart[:, None] + ar, (seq - 1)[:, None])
    pin = run.hid[1].gather(1, ppos[..., None].expand(-1, -1, ad.hidden_size))
    npos = torch.where(nvalid, seq[:, None] + lay.depth[None] - 1, (seq - 1)[:, None])
    if not node_states.is_floating_point():
        node_states = ad.embed(node_states, npos)
    inp = torch.cat([pin, node_states.to(pin.dtype)], 1)
    pos = torch.cat([ppos, npos], 1)
    valid = torch.cat([pvalid, nvalid], 1)
    T0 = cache.seq_length(a1, L)
    all_nodes = torch.arange(N, device=dev)
    allow = _allow(lay, all_nodes, all_nodes, T0, q_plain=P)
    o = ad.run_layers(inp, a1, L, position_ids=pos, cache=cache, valid=valid, allow=allow, capture=capture)
    run.stats.levels[1].layer_evals += int(valid.sum()) * (L - a1)
    root = o[torch.arange(B, device=dev), (seq - 1 - pstart)][:, None]  # the state predicting depth 1
    flog = run._logits(1, torch.cat([root, o[:, P:]], 1))  # [B, 1 + N, V]: 0 = root, 1 + i = node i
    return o, flog, P, pvalid, ppos, T0 + P


def observe_tree(run, spec: TreeSpec, drafted, part, ntok, qrows, prow, pred, bonus) -> None:
    """Under `auto` (`run.policy`), one observation per row of level 0's top-1 at the root (sampling: sum(min(p, q))
    there) and, greedy, of the model token's rank among the root's children (level 0's top-k_1: auto's trees have
    non-increasing widths, so k_1 is the largest), for `_AutoPolicy.observe_tree`; nothing without a policy."""
    if run.policy is None:
        return
    rank = None
    if run.do_sample:
        top1 = torch.minimum(prow[:, 0], qrows[:, 0]).sum(-1)
    else:
        rank = sampling.rank_among(ntok[:, : spec.widths[0]], pred[:, 0])
        top1 = (rank == 0).double()
    run.policy.observe_tree(run, drafted, top1, part, bonus, prow if run.do_sample else None, rank)


def accept_tree(run, spec: TreeSpec, lay: _Layout, flog, ntok, nvalid, qrows):
    """A static tree's acceptance for every row: flog `[B, 1 + N, V]` the full model's logits at the root (0) and
    at each node (1 + i), ntok / nvalid `[B, N]` the nodes, qrows `[B, 1 + N, V]` the draft distributions their
    children were drawn from (sampling; None when greedy) -> (path `[B, D]` node ids by depth, -1 past its end;
    the full model's token after it `[B]`; the full model's probabilities `[B, 1 + N, V]` (sampling) or None;
    its argmax `[B, 1 + N]` (greedy) or None). Greedy: the deepest path whose every token is the full model's
    argmax at its parent. Sampling: per depth, recursive rejection sampling over the current node's children."""
    B, D, dev = ntok.shape[0], spec.depth, ntok.device
    rows = torch.arange(B, device=dev)
    prow = pred = None
    eos = run.eos
    path = torch.full((B, D), -1, dtype=torch.long, device=dev)
    if run.do_sample:
        prow = sampling.logits_to_probs(flog, **run.warp)
        cur = torch.full((B,), -1, dtype=torch.long, device=dev)  # -1: the root
        alive = torch.ones(B, dtype=torch.bool, device=dev)
        resid = prow[:, 0].clone()
        for d in range(1, D + 1):
            k = spec.widths[d - 1]
            local = torch.zeros_like(cur) if d == 1 else cur - lay.offset[d - 2]
            first = lay.offset[d - 1] + local.clamp(min=0) * k
            kids = first[:, None] + torch.arange(k, device=dev)
            p_here, q_here = prow[rows, 1 + cur], qrows[rows, 1 + cur]
            cands, ok = ntok.gather(1, kids), nvalid.gather(1, kids) & alive[:, None]
            idx, res = sampling.recursive_accept(p_here, q_here, cands, ok, run.generator)
            stop_here = alive & (idx < 0)
            resid = torch.where(stop_here[:, None], res, resid)
            alive = alive & (idx >= 0)
            cur = torch.where(alive, kids.gather(1, idx.clamp(min=0)[:, None])[:, 0], cur)
            path[:, d - 1] = torch.where(alive, cur, path[:, d - 1])
            if eos.numel():
                alive = alive & ~torch.isin(ntok.gather(1, cur.clamp(min=0)[:, None])[:, 0], eos)
        resid = torch.where(alive[:, None], prow[rows, 1 + cur], resid)
        bonus = sampling.sample(resid, run.generator)
    else:
        pred = flog.argmax(-1)  # [B, 1 + N]
        ok = nvalid & (ntok == pred.gather(1, 1 + lay.parent[None].expand(B, -1)))
        on = torch.zeros_like(ok)
        for d in range(1, D + 1):
            sl = lay.nodes(d)
            par = lay.parent[sl]
            up = torch.ones(B, sl.stop - sl.start, dtype=torch.bool, device=dev) if d == 1 else on[:, par]
            on[:, sl] = ok[:, sl] & up
            hit = on[:, sl]
            path[:, d - 1] = torch.where(hit.any(1), sl.start + hit.float().argmax(1), -1)
        bonus = pred[rows, 1 + _deepest(path)]
    return path, bonus, prow, pred


def _lookup_first(run) -> bool:
    """The lookup-first exit (`ngram|EXIT`) with trees: every row first tries the n-gram lookup (up to
    `ngram.max_len` tokens, as in a chain round); rows it serves are verified by the full model as a chain
    (`_Run.verify`), the others draft the exit's tree (`lookup_only` rows: nothing, they decode plainly). Returns
    whether a tree round follows: none when every row was
    served (or none is left). In a batch where only some rows were served, those rows are committed first (so a
    row the chain finished leaves before the tree) and then take part in the tree round as well: every row still
    decoding has exactly its newest committed token pending then, which is what a tree round starts from.

    Lossless for the same reason as each part: the chain verification and the tree round each commit only tokens
    the full model accepts given the committed prefix (greedy: its argmax; sampling: speculative sampling against
    the stored q, a point mass for an n-gram token)."""
    t0 = timing.now(run.device)
    st0 = run.stats.levels[0]
    stop = run._stop_pos()
    grow = (run.seq < stop) & (run.gam[0] > 0)  # (not for rows `auto` switched to plain decoding)
    n = run._propose_ngram(grow, torch.minimum(torch.full_like(stop, run.ngram.max_len), stop - run.seq))
    hit = n > 0
    if run.policy is not None:
        run.policy.lookup_missed(grow & ~hit)
    st0.proposed += int(n.sum())
    st0.proposals += int(hit.sum())
    st0.lookups += int(hit.sum())
    st0.seconds += timing.now(run.device) - t0
    if not bool(hit.any()):
        return True
    run.exhausted |= hit
    run.verify(1, hit)
    return not bool(hit.all()) and run.commit()


def _deepest(path: torch.Tensor) -> torch.Tensor:
    """Per row, the node id of the deepest accepted node on `path` `[B, D]` (-1 entries: none there), else -1."""
    cur = torch.full(path.shape[:1], -1, dtype=torch.long, device=path.device)
    for d in range(path.shape[1]):
        cur = torch.where(path[:, d] >= 0, path[:, d], cur)
    return cur


def _write_states(run, seq, keep, h_exit, pidx, o, P, slot, pvalid, ppos):
    """The per-position buffers of the committed positions: the path's exit states (`h_exit` at node ids `pidx`)
    and, for context heads, the final states `o` of the pending positions and of the path's nodes (pass slot
    P + `slot`)."""
    r_, c_ = keep.nonzero(as_tuple=True)
    run.hid[1][r_, seq[r_] + c_] = h_exit[r_, pidx[r_, c_]]
    if run.fin is not None:
        pr, pc = pvalid.nonzero(as_tuple=True)
        run.fin[pr, ppos[pr, pc]] = o[pr, pc]
        run.fin[r_, seq[r_] + c_] = o[r_, P + slot[r_, c_]]


def _write_path(run, path, ntok, bonus, seq, D):
    """Write each row's accepted path (node ids `path` `[B, D]`, -1 past its end; node tokens `ntok`) and then the
    full model's token `bonus` into `run.tok` from position `seq`; an accepted EOS ends the path and the row (nothing
    after it). -> (accepted length `[B]`, keep `[B, D]`, new committed length `[B]`, has_new `[B]`)."""
    dev = path.device
    a = (path >= 0).long().sum(1)  # paths are contiguous from depth 1
    ended = torch.zeros_like(a, dtype=torch.bool)
    if run.eos.numel():
        is_eos = torch.isin(ntok.gather(1, path.clamp(min=0)), run.eos) & (path >= 0)
        ended = is_eos.any(1)
        a = torch.minimum(a, torch.where(ended, is_eos.float().argmax(1) + 1, a))
    keep = torch.arange(D, device=dev)[None] < a[:, None]
    newpos = seq + a
    has_new = ~ended & (newpos < run.limit)
    W = run.tok.shape[1]
    ppos_path = (seq[:, None] + torch.arange(D, device=dev)).clamp(max=W - 1)
    ptok = ntok.gather(1, path.clamp(min=0))
    run.tok.scatter_(1, ppos_path, torch.where(keep, ptok, run.tok.gather(1, ppos_path)))
    npos_c = newpos.clamp(max=W - 1)
    run.tok.scatter_(1, npos_c[:, None], torch.where(has_new, bonus, run.tok.gather(1, npos_c[:, None])[:, 0])[:, None])
    return a, keep, newpos, has_new


def _keep_path(run, cache, head, ranges, T0, idx0, idx1, keep, newpos, has_new):
    """After a tree verification: keep each row's accepted path in the cache (slots `idx0` of the draft range and a
    `layer` head's layer, `idx1` of the verifier's range, valid where `keep`), cut every range at `newpos`, and set
    the row counts as after a chain verification (`done[0] = done[1] = ver[1] - 1`)."""
    a0, a1, L = ranges
    cache.compact(a0, a1, T0[0], idx0, keep)
    cache.compact(a1, L, T0[1], idx1, keep)
    if head is not None:
        cache.compact(head.cache_index, head.cache_index + 1, T0["h"], idx0, keep)
    cache.truncate_ranges([(a0, a1), (a1, L)] + ([(head.cache_index, head.cache_index + 1)] if head is not None
                                                 else []), newpos)
    run.done[0] = newpos.clone()
    run.done[1] = newpos.clone()
    run.seq = newpos + has_new.long()
    run.ver[1] = run.seq.clone()
    run.base = run.seq.clone()


def _count(run, a, depth_cap, B, t1) -> None:
    """The full level's counters for one tree round: accepted path lengths out of each row's usable depth (read
    from the device at the round's commit)."""
    st1 = run.stats.levels[1]
    run._count(1, "accepted", a.sum())
    run._count(1, "proposed", depth_cap.sum())
    run._count(1, "rejections", (a < depth_cap).sum())
    st1.passes += 1
    st1.row_passes += B
    st1.seconds += timing.now(run.device) - t1


# ==================================================================================================== dynamic trees
@dataclass(frozen=True)
class DynamicTreeSpec:
    """EAGLE-2-style dynamic tree (greedy only): `depth` levels; the root's top-`topk` children form depth 1; at
    each depth the `beam` nodes of highest cumulative draft log-probability are expanded by their top-`topk`;
    finally the `nodes` drafted nodes of highest cumulative log-probability (an ancestor-closed set: a child never
    scores above its parent, ties go to the shallower node) are verified in one full pass."""

    depth: int
    topk: int
    beam: int
    nodes: int

    @property
    def size(self) -> int:
        return self.nodes

    @property
    def drafted(self) -> int:
        return self.topk + (self.depth - 1) * self.beam * self.topk

    def __str__(self) -> str:
        return f"dyn-{self.depth}-{self.topk}-{self.beam}-{self.nodes}"


def parse_dynamic(text: str) -> DynamicTreeSpec:
    """`"dyn-D-K-B-N"` (depth, top-k, beam, nodes verified) -> DynamicTreeSpec; ValueError when malformed."""
    parts = text.split("-")
    try:
        if parts[0] != "dyn" or len(parts) != 5:
            raise ValueError
        depth, topk, beam, nodes = (int(p) for p in parts[1:])
    except ValueError:
        raise ValueError(f"dynamic tree {text!r}: expected 'dyn-DEPTH-TOPK-BEAM-NODES', e.g. 'dyn-5-4-4-16'") from None
    spec = DynamicTreeSpec(depth, topk, beam, nodes)
    for name in ("depth", "topk", "beam", "nodes"):
        if getattr(spec, name) < 1:
            raise ValueError(f"dynamic tree {text!r}: {name} must be >= 1")
    if beam > topk:
        raise ValueError(f"dynamic tree {text!r}: beam ({beam}) cannot exceed topk ({topk})")
    if nodes > spec.drafted:
        raise ValueError(f"dynamic tree {text!r}: {nodes} nodes to verify but only {spec.drafted} are drafted")
    if nodes > MAX_TREE_NODES:
        raise ValueError(f"dynamic tree {text!r}: at most {MAX_TREE_NODES} nodes are verified in one pass")
    return spec
