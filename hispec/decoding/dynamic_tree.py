"""Dynamic trees (EAGLE-2 style, greedy only): `dynamic_round`, one round of a `hispec.decoding.tree.DynamicTreeSpec`.

Per round the exit expands, depth by depth, the `beam` most probable nodes so far (by the product of its
probabilities along the path) into their top-`topk` children, then the `nodes` most probable of all drafted nodes
are verified by the full model in one pass with the ancestry mask, and the longest accepted path is kept, as in a
static tree round. Its own module because static trees (`hispec.decoding.tree`) are the ones `auto` plans and samples with;
this round reuses their writing, rollback and accounting helpers (`hispec.decoding.tree` does not import this module, so
there is no cycle: `hispec.decoding.rounds` picks the round).
"""

from __future__ import annotations

import torch

from .. import timing
from .tree import (DynamicTreeSpec, _count, _deepest, _keep_path, _lookup_first, _root, _write_path,
                   _write_states)


def _rows_gather(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t `[B, M, ...]`, idx `[B, T]` (-1 allowed: junk) -> `[B, T, ...]`."""
    i = idx.clamp(min=0)
    if t.dim() == 2:
        return t.gather(1, i)
    return t.gather(1, i.reshape(*i.shape, *([1] * (t.dim() - 2))).expand(*i.shape, *t.shape[2:]))


def dynamic_round(run, spec: DynamicTreeSpec):
    """One dynamic-tree round (greedy) for every row of `run`; see `DynamicTreeSpec` and `hispec.decoding.tree.tree_round`
    (the same start: a lookup-first exit's lookup, or one plain verification where no row drafts)."""
    if run.do_sample:
        raise RuntimeError("dynamic trees are greedy only")
    if run.levels[0].lookup and not _lookup_first(run) or run.verify_plainly_if_none_drafts():
        return
    ad, cache = run.adapter, run.cache
    st0, st1 = run.stats.levels
    dev = run.seq.device
    B, D, k, nb, NV = len(run.seq), spec.depth, spec.topk, spec.beam, spec.nodes
    M = spec.drafted
    rows = torch.arange(B, device=dev)
    a0, a1, L = run.bounds
    head = run.state_heads[0]
    H = ad.hidden_size
    t0 = timing.now(run.device)
    seq = run.seq.clone()
    depth_cap = (run.limit - seq).clamp(min=0, max=D) * run.drafting_rows()

    out, logits = _root(run, seq, rows)
    ntok = torch.zeros(B, M, dtype=torch.long, device=dev)
    nvalid = torch.zeros(B, M, dtype=torch.bool, device=dev)
    score = torch.full((B, M), float("-inf"), dtype=torch.float64, device=dev)
    par = torch.full((B, M), -1, dtype=torch.long, device=dev)
    dep = torch.zeros(M, dtype=torch.long, device=dev)
    anc = torch.zeros(B, M, M, dtype=torch.bool, device=dev)
    slot0 = torch.full((B, M), -1, dtype=torch.long, device=dev)  # each node's slot in range 0's tree tail
    h_exit = torch.zeros(B, M, H, dtype=out.dtype, device=dev)
    T0 = {0: cache.seq_length(a0, a1)}
    if head is not None:
        T0["h"] = cache.get_seq_length(head.cache_index)
    tail_nodes = []  # per range-0 pass, the node ids `[B, T]` (-1: padding) its slots hold

    def add_children(first: int, parents: torch.Tensor, parent_logits: torch.Tensor, parent_ok: torch.Tensor,
                     d: int):
        """parents `[B, n]` (-1: the root) -> their top-k children as nodes first .. first + n*k - 1."""
        lp = torch.log_softmax(parent_logits.float(), -1).double()  # [B, n, V]
        top = lp.topk(k, dim=-1)
        n = parents.shape[1]
        ids = slice(first, first + n * k)
        base = torch.zeros(B, n, dtype=torch.float64, device=dev) if d == 1 else score.gather(1, parents.clamp(min=0))
        ntok[:, ids] = top.indices.reshape(B, -1)
        ok = (parent_ok[..., None] & torch.isfinite(top.values)).reshape(B, -1) & (d <= depth_cap)[:, None]
        nvalid[:, ids] = ok
        score[:, ids] = torch.where(ok, (base[..., None] + top.values).reshape(B, -1), float("-inf"))
        pr = parents.repeat_interleave(k, dim=1)
        par[:, ids] = pr
        dep[ids] = d
        eye = torch.zeros(B, n * k, M, dtype=torch.bool, device=dev)
        eye[:, torch.arange(n * k, device=dev), torch.arange(first, first + n * k, device=dev)] = True
        up = torch.where((pr >= 0)[..., None], _rows_gather(anc, pr), torch.zeros_like(eye))
        anc[:, ids] = eye | up

    def range0(nodes: torch.Tensor, want_logits: bool):
        """Range 0 (+ a `layer` head) over nodes `[B, T]` (-1: padding); each row's own ancestry masks."""
        T = nodes.shape[1]
        valid = (nodes >= 0) & _rows_gather(nvalid, nodes)
        d = dep[nodes.clamp(min=0)]
        pos = torch.where(valid, seq[:, None] + d - 1, seq[:, None] - 1)
        inp = ad.embed(_rows_gather(ntok, nodes), pos)
        tail = torch.cat(tail_nodes + [nodes], 1)  # [B, S_tree]
        q_anc = _rows_gather(anc, nodes)  # [B, T, M]
        tree_allow = q_anc.gather(2, tail.clamp(min=0)[:, None].expand(-1, T, -1)) & (tail >= 0)[:, None]
        nr, nc = (nodes >= 0).nonzero(as_tuple=True)
        slot0[nr, nodes[nr, nc]] = sum(t.shape[1] for t in tail_nodes) + nc
        tail_nodes.append(nodes)

        def allow_for(before):
            return torch.cat([torch.ones(B, T, before, dtype=torch.bool, device=dev), tree_allow], 2)

        o = ad.run_layers(inp, a0, a1, position_ids=pos, cache=cache, valid=valid, allow=allow_for(T0[0]))
        st0.layer_evals += int(valid.sum()) * (a1 - a0)
        r_, c_ = valid.nonzero(as_tuple=True)
        h_exit[r_, nodes[r_, c_]] = o[r_, c_]
        feats = None
        if head is not None:
            allow_h = allow_for(T0["h"])

            def run_layer(module, hidden):
                return ad.run_module(module, head.layer_type, hidden, cache_index=head.cache_index,
                                     position_ids=pos, cache=cache, valid=valid, allow=allow_h)

            feats = head(o, run_layer)
            st0.layer_evals += int(valid.sum())
        return run._logits(0, o, feats, pos=pos) if want_logits else None

    add_children(0, torch.full((B, 1), -1, dtype=torch.long, device=dev), logits,
                 torch.ones(B, 1, dtype=torch.bool, device=dev), 1)
    st0.passes += 1
    st0.row_passes += B
    first, width = 0, k  # the current depth's block of node ids
    for d in range(1, D):
        blk = score[:, first : first + width]
        sel = blk.topk(nb, dim=-1).indices + first  # [B, nb] the best nodes of depth d to expand
        sel_ok = _rows_gather(nvalid, sel)
        sel = torch.where(sel_ok, sel, -1)
        lg = range0(sel, True)
        first, width = first + width, nb * k
        add_children(first, sel, lg, sel_ok, d + 1)
        st0.passes += 1
        st0.row_passes += int(sel_ok.any(1).sum())
    st0.proposed += int(nvalid.sum())
    st0.proposals += int((depth_cap > 0).sum())  # rows that drafted (not plain rows, not rows at their limit)
    st0.seconds += timing.now(run.device) - t0
    t1 = timing.now(run.device)

    # the verified set: the NV best-scoring nodes, parents first (stable sort: a child never outranks its parent)
    order = torch.sort(-score, dim=1, stable=True).indices[:, :NV]  # [B, NV]
    vsel = torch.where(_rows_gather(nvalid, order), order, -1)
    # sort the chosen ones by depth so that every node's parent comes before it (ancestry closure holds anyway)
    vsel = vsel.gather(1, torch.sort(torch.where(vsel >= 0, dep[vsel.clamp(min=0)], D + 1), dim=1,
                                     stable=True).indices)
    todo = torch.where((vsel >= 0) & (_rows_gather(slot0, vsel) < 0), vsel, -1)
    cnt = (todo >= 0).sum(1)
    U = int(cnt.max())
    if U:  # the chosen nodes no draft pass ran: through range 0 now (left-packed)
        packed = todo.gather(1, torch.sort((todo < 0).long(), dim=1, stable=True).indices)[:, :U]
        range0(packed, False)
    selpos = torch.full((B, M), -1, dtype=torch.long, device=dev)
    ok_v = vsel >= 0
    vr, vc = ok_v.nonzero(as_tuple=True)
    selpos[vr, vsel[vr, vc]] = vc
    vvalid = ok_v & _rows_gather(nvalid, vsel)
    pstart = run.done[1]
    P = int((seq - pstart).max())
    ar = torch.arange(P, device=dev)
    pvalid = ar < (seq - pstart)[:, None]
    ppos = torch.where(pvalid, pstart[:, None] + ar, (seq - 1)[:, None])
    pin = run.hid[1].gather(1, ppos[..., None].expand(-1, -1, H))
    vdep = dep[vsel.clamp(min=0)]
    npos = torch.where(vvalid, seq[:, None] + vdep - 1, (seq - 1)[:, None])
    inp = torch.cat([pin, _rows_gather(h_exit, vsel)], 1)
    pos = torch.cat([ppos, npos], 1)
    valid = torch.cat([pvalid, vvalid], 1)
    T0[1] = cache.seq_length(a1, L)
    v_anc = _rows_gather(anc, vsel).gather(2, vsel.clamp(min=0)[:, None].expand(-1, NV, -1)) & vvalid[:, None]
    allow = torch.ones(B, P + NV, T0[1] + P + NV, dtype=torch.bool, device=dev)
    allow[:, P:, T0[1] + P:] = v_anc
    T0[1] += P
    o = ad.run_layers(inp, a1, L, position_ids=pos, cache=cache, valid=valid, allow=allow)
    st1.layer_evals += int(valid.sum()) * (L - a1)
    root = o[rows, (seq - 1 - pstart)][:, None]
    flog = run._logits(1, torch.cat([root, o[:, P:]], 1))  # [B, 1 + NV, V]
    pred = flog.argmax(-1)

    # greedy acceptance over each row's own tree
    vpar = _rows_gather(par, vsel)
    prow = torch.where(vpar >= 0, 1 + _rows_gather(selpos, vpar), 0)
    match = vvalid & (_rows_gather(ntok, vsel) == pred.gather(1, prow.clamp(min=0))) & ((vpar < 0) | (prow > 0))
    on = match & (vpar < 0)
    for _ in range(D - 1):
        up = torch.where(vpar >= 0, on.gather(1, (prow - 1).clamp(min=0)), torch.ones_like(on))
        on = match & up
    path = torch.full((B, D), -1, dtype=torch.long, device=dev)  # node ids by depth
    for d in range(1, D + 1):
        hit = on & (vdep == d)
        path[:, d - 1] = torch.where(hit.any(1), vsel.gather(1, hit.float().argmax(1)[:, None])[:, 0], -1)
    cur = _deepest(path)
    bonus = pred[rows, torch.where(cur >= 0, 1 + selpos.gather(1, cur.clamp(min=0)[:, None])[:, 0], 0)]
    a, keep, newpos, has_new = _write_path(run, path, ntok, bonus, seq, D)
    pidx = path.clamp(min=0)
    idx0 = slot0.gather(1, pidx).clamp(min=0)
    idx1 = selpos.gather(1, pidx).clamp(min=0)
    _write_states(run, seq, keep, h_exit, pidx, o, P, idx1, pvalid, ppos)
    _keep_path(run, cache, head, (a0, a1, L), T0, idx0, idx1, keep, newpos, has_new)
    _count(run, a, depth_cap, B, t1)
