"""Exit heads: map the residual stream after layer l to features that the model's own (frozen) lm_head projects.

Contract: a head takes hidden states `[B, T, H]` at its exit and returns normed features `[B, T, H]`; logits are
`DecoderAdapter.project(features)` — heads never copy the vocabulary-sized output matrix. Types:

- `shared`  the model's own final norm (nothing to train; for early-exit-pretrained models such as LayerSkip)
- `norm`    its own copy of the final norm, trainable (LayerSkip-style, nearly free)
- `linear`  own norm + residual d×d adapter initialised to zero, so it starts exactly as `norm`
- `lowrank` own norm + residual rank-r adapter (up-projection zero-initialised)
- `layer`   one decoder layer (a copy of the base layer right after the exit, so it starts as "one layer deeper")
            with attention over the exit's previous positions, then its own norm and a zero-initialised residual
            d x d adapter. It is *stateful*: its keys/values live in the decoder's cache as an extra layer
            (index num_layers for the draft head, num_layers + 1 for the verifier) that is advanced and rolled back
            together with the exit's range, so it reuses KV exactly like the model's own layers. Callers pass
            `run_layer(module, hidden)` (the decoder: `DecoderAdapter.run_module` on its cache; training: a fresh
            cache over whole sequences, see `ExitHead.run_layer_fresh`). Trainable fully or with LoRA (peft).

- `context` the exit state of token t plus what the decoder already knows about the positions before it: one
            cross-attention block (queries from the exit state at t; keys/values from a window of the last
            `window` positions <= t, each represented by the *deepest* state the decoder holds for it: the final
            layer's residual for positions the full model verified, else an intermediate exit's, else this exit's
            own) followed by a SiLU MLP, both residual with zero-initialised output projections, so it starts
            exactly as `norm`. Each kind of state (one per layer in `context_layers`) gets its own trainable copy of
            the final norm and a learned kind embedding; a learned bias per attention head and relative distance
            t - p encodes positions. It is stateless (no KV of its own: the window is re-read from the decoder's
            hidden-state buffers every call), so drafts roll back for free. Callers pass a `ContextInputs`
            (the decoder's buffers and, per kind, up to which position each query may read it; training builds the
            same from whole sequences, drawing each position's verified frontier like decoding produces it).

`ExitHead.stateful` is True only for `layer`; `ExitHead.needs_context` only for `context`.

Any head may carry a reduced output vocabulary (`set_vocab(ids)`, a persistent `vocab` buffer of sorted token ids,
saved with the head): `EarlyExitModel.exit_logits` then projects onto those rows of the lm_head only (8k of 49k rows
costs ~1/6 of the full projection) and returns full-vocabulary logits with -inf outside the set, so every decoding
rule downstream is unchanged and stays lossless (a proposal with smaller support is still exact under speculative
sampling; greedy drafts outside the set are simply never proposed).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..layers import positions_from_mask

HEAD_TYPES = ("shared", "norm", "linear", "lowrank", "layer", "context")
STATELESS_HEAD_TYPES = ("shared", "norm", "linear", "lowrank")  # position-wise: no attention, no KV
EXTRA_CACHE_INDEX = {"draft": 0, "verify": 1}  # a layer head's cache layer: num_layers + this


# head_dim None: min(64, H // heads); frontier 1: the direct path from the newest verified final state (below). A
# checkpoint written before `frontier` existed has none (hispec.model reads it as 0).
CONTEXT_DEFAULTS = {"window": 16, "heads": 4, "head_dim": None, "mlp_mult": 2, "frontier": 1}


@dataclass
class ContextInputs:
    """What a `context` head reads besides its exit state, for queries at positions `query_pos` `[B, T]`.

    `states[i]` `[B, S, H]`: the residual stream after layer `layers[i]` at every position of a row (a buffer: only
    positions below `avail[i]` are meaningful). `avail[i]` `[B, T]` (or `[B]`, the same for every query of a row):
    query t may read kind i at positions p < avail[i]. `layers` must be the head's `context_layers` (deepest
    first is not required: the head picks, per position, the deepest kind available). Positions < `start` `[B]`
    (default 0) are never read (left padding)."""

    states: list
    avail: list
    query_pos: torch.Tensor
    layers: list
    start: torch.Tensor | None = None


def _set_layer_idx(module: nn.Module, idx: int) -> None:
    """Point every attention submodule of a copied decoder layer at cache layer `idx`."""
    found = False
    for sub in module.modules():
        if hasattr(sub, "layer_idx") and isinstance(sub.layer_idx, int):
            sub.layer_idx = idx
            found = True
    if not found:
        raise ValueError(f"{type(module).__name__} has no attention module with a layer_idx; a 'layer' head needs one")


class ExitHead(nn.Module):
    def __init__(self, head_type: str, final_norm: nn.Module, hidden_size: int, rank: int = 64, *,
                 layer: nn.Module | None = None, layer_type: str = "full_attention", cache_index: int | None = None,
                 context_layers: list[int] | None = None, context: dict | None = None):
        super().__init__()
        if head_type not in HEAD_TYPES:
            raise ValueError(f"unknown head type '{head_type}'; choose one of {', '.join(HEAD_TYPES)}")
        if head_type == "lowrank" and not 1 <= rank <= hidden_size:
            raise ValueError(f"lowrank head rank {rank} must be in 1..{hidden_size}")
        self.head_type = head_type
        self.rank = rank if head_type == "lowrank" else None
        if head_type == "shared":
            self._shared_norm = [final_norm]  # a reference, not a registered (saved, trained) submodule
            self.norm = None
        else:
            self.norm = copy.deepcopy(final_norm)
            for p in self.norm.parameters():
                p.requires_grad_(True)
        self.adapter: nn.Module | None = None
        self.layer: nn.Module | None = None
        self.layer_type = layer_type if head_type == "layer" else None
        self.cache_index = cache_index if head_type == "layer" else None
        if head_type == "layer":
            if layer is None or cache_index is None:
                raise ValueError("a 'layer' head needs the base decoder layer to copy and its cache index")
            self.layer = copy.deepcopy(layer)
            _set_layer_idx(self.layer, cache_index)
            for p in self.layer.parameters():
                p.requires_grad_(True)
        if head_type in ("linear", "layer"):
            self.adapter = nn.Linear(hidden_size, hidden_size, bias=False)
            nn.init.zeros_(self.adapter.weight)
        elif head_type == "lowrank":
            down = nn.Linear(hidden_size, rank, bias=False)
            up = nn.Linear(rank, hidden_size, bias=False)
            nn.init.normal_(down.weight, std=hidden_size**-0.5)
            nn.init.zeros_(up.weight)
            self.adapter = nn.Sequential(down, up)
        self.context_layers: list[int] | None = None
        self.context: dict | None = None
        if head_type == "context":
            self._init_context(final_norm, hidden_size, context_layers, context)
        self.register_buffer("vocab", None)

    def _init_context(self, final_norm, H, layers, settings):
        if not layers:
            raise ValueError("a 'context' head needs context_layers: its own exit layer and deeper ones it reads")
        if len(set(layers)) != len(layers):
            raise ValueError(f"context_layers must be distinct, got {layers}")
        unknown = set(settings or {}) - set(CONTEXT_DEFAULTS)
        if unknown:
            raise ValueError(f"unknown context head settings {sorted(unknown)}; known: {sorted(CONTEXT_DEFAULTS)}")
        cfg = {**CONTEXT_DEFAULTS, **(settings or {})}
        if cfg["head_dim"] is None:
            cfg["head_dim"] = max(1, min(64, H // cfg["heads"])) if isinstance(cfg["heads"], int) else None
        for k, v in cfg.items():
            if k == "frontier":
                if v not in (0, 1) or isinstance(v, float):
                    raise ValueError(f"context head setting frontier must be 0 or 1, got {v!r}")
            elif not isinstance(v, int) or v < 1:
                raise ValueError(f"context head setting {k} must be an integer >= 1, got {v!r}")
        cfg["frontier"] = int(cfg["frontier"])
        self.context_layers, self.context = [int(x) for x in layers], cfg
        nh, dh, W = cfg["heads"], cfg["head_dim"], cfg["window"]
        A = nh * dh
        self.ctx_norms = nn.ModuleList(copy.deepcopy(final_norm) for _ in layers)
        for p in self.ctx_norms.parameters():
            p.requires_grad_(True)
        self.ctx_kind = nn.Parameter(torch.zeros(len(layers), H))
        self.ctx_q = nn.Linear(H, A, bias=False)
        self.ctx_k = nn.Linear(H, A, bias=False)
        self.ctx_v = nn.Linear(H, A, bias=False)
        self.ctx_o = nn.Linear(A, H, bias=False)
        self.ctx_rel = nn.Parameter(torch.zeros(nh, W))  # bias per attention head and distance t - p in 0..W-1
        inner = cfg["mlp_mult"] * H
        self.ctx_up = nn.Linear(H, inner, bias=False)
        self.ctx_down = nn.Linear(inner, H, bias=False)
        for lin in (self.ctx_q, self.ctx_k, self.ctx_v, self.ctx_up):
            nn.init.normal_(lin.weight, std=H**-0.5)
        nn.init.zeros_(self.ctx_o.weight)
        nn.init.zeros_(self.ctx_down.weight)
        if cfg["frontier"]:
            self.ctx_front = nn.Linear(H, H, bias=False)  # the frontier's state, into the residual before the MLP
            nn.init.zeros_(self.ctx_front.weight)
            self.ctx_dist = nn.Parameter(torch.zeros(W, H))  # distance t - f = 1..W (beyond: W)

    @property
    def needs_context(self) -> bool:
        return self.context_layers is not None

    def set_vocab(self, ids: torch.Tensor | None) -> None:
        """Restrict this head's output to the token ids `ids` (1-D, unique; stored sorted), or lift it (None)."""
        if ids is None:
            self.vocab = None
            return
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("a head vocabulary needs at least one token id")
        ids = torch.unique(ids)  # sorted
        if int(ids[0]) < 0:
            raise ValueError("head vocabulary ids must be >= 0")
        dev = next((t.device for t in self.parameters()), ids.device)
        self.vocab = ids.to(dev)

    @property
    def vocab_size(self) -> int | None:
        return None if self.vocab is None else int(self.vocab.numel())

    @property
    def stateful(self) -> bool:
        return self.layer is not None

    def forward(self, hidden: torch.Tensor, run_layer=None, context: ContextInputs | None = None) -> torch.Tensor:
        """hidden `[B, T, H]` residual stream at the exit -> `[B, T, H]` features for the lm_head.

        A `layer` head needs `run_layer(module, hidden) -> hidden` that runs its decoder layer over these positions
        with the right cache and positions (see the module docstring); a `context` head needs `context`.
        """
        if self.context_layers is not None:
            return self._context_forward(hidden, context)
        if self.layer is not None:
            if run_layer is None:
                raise ValueError("a 'layer' head attends over previous positions: call it with run_layer=... "
                                 "(the decoder does; for whole sequences use run_layer_fresh)")
            hidden = run_layer(self.layer, hidden)
        norm = self._shared_norm[0] if self.norm is None else self.norm
        y = norm(hidden)
        if self.adapter is not None:
            y = y + self.adapter(y)
        return y

    def _context_forward(self, hidden: torch.Tensor, ctx: ContextInputs | None) -> torch.Tensor:
        if ctx is None:
            raise ValueError(
                "a 'context' head reads the decoder's states of earlier positions: call it with context=ContextInputs"
                "(...) (hispec's decoder does; a caller that only has exit states cannot use this head)")
        if list(ctx.layers) != self.context_layers:
            raise ValueError(f"context states for layers {list(ctx.layers)}, this head reads {self.context_layers}")
        B, T, H = hidden.shape
        W, nh, dh = self.context["window"], self.context["heads"], self.context["head_dim"]
        y = self.norm(hidden)
        dev = hidden.device
        pos = ctx.query_pos.to(dev)
        idx = pos[..., None] - torch.arange(W, device=dev)  # [B, T, W]: p = t, t - 1, ..., t - W + 1
        start = torch.zeros(B, dtype=torch.long, device=dev) if ctx.start is None else ctx.start.to(dev)
        ok = idx >= start[:, None, None]
        chosen = torch.zeros_like(ok)
        chosen[..., 0] = True  # the query's own position: its own exit state at least (zero keys if none given)
        S = ctx.states[0].shape[1]
        A = nh * dh
        w_kv = torch.cat([self.ctx_k.weight, self.ctx_v.weight])  # keys and values in one product [2A, H]
        # Which kind of state each window slot (b, t, w) reads: the deepest available to its query.
        takes = {}
        first = torch.zeros_like(ok)
        first[..., 0] = True  # position t is pre-marked chosen but still takes the deepest state it has
        for i in sorted(range(len(self.context_layers)), key=lambda i: -self.context_layers[i]):
            avail = ctx.avail[i].to(dev)
            if avail.dim() == 1:
                avail = avail[:, None].expand(B, T)
            take = ok & (~chosen | first) & (idx < avail[..., None])
            if bool(take.any()):
                takes[i] = take
            chosen |= take
            first &= ~take
        q = self.ctx_q(y).reshape(B, T, nh, dh)
        if S == T and torch.equal(pos, torch.arange(T, device=dev).expand(B, T)):
            # Whole sequences (training, evaluation): slot w of query t is position t - w, so keys and values are
            # projected once per position and read as W shifted views; no [B, T, W, H] tensor is built (the
            # gathered form below costs ~10x the time and memory here; both give the same values).
            kv = {i: nn.functional.pad(nn.functional.linear(self.ctx_norms[i](ctx.states[i].to(hidden.dtype))
                                                            + self.ctx_kind[i], w_kv), (0, 0, W - 1, 0))
                  for i in takes}
            scores, vals = [], []
            for w in range(W):
                kw = vw = hidden.new_zeros(B, T, A)
                for i, take in takes.items():
                    rows = kv[i][:, W - 1 - w: W - 1 - w + T]
                    sel = take[:, :, w, None]
                    kw = torch.where(sel, rows[..., :A], kw)
                    vw = torch.where(sel, rows[..., A:], vw)
                scores.append((q * kw.reshape(B, T, nh, dh)).sum(-1))
                vals.append(vw.reshape(B, T, nh, dh))
            att = torch.stack(scores, -1) / math.sqrt(dh) + self.ctx_rel.to(q.dtype)  # [B, T, nh, W]
            att = att.masked_fill(~chosen[:, :, None, :], float("-inf"))
            att = torch.softmax(att.float(), dim=-1).to(q.dtype)
            o = sum(att[..., w, None] * vals[w] for w in range(W)).reshape(B, T, A)
        else:
            # A few queries over a long buffer (decoding): gather each query's window, then project.
            gidx = idx.clamp(0, S - 1).reshape(B, T * W)
            kv = hidden.new_zeros(B, T, W, 2 * A)
            for i, take in takes.items():
                st = ctx.states[i].gather(1, gidx[..., None].expand(-1, -1, H)).reshape(B, T, W, H)
                rows = nn.functional.linear(self.ctx_norms[i](st.to(hidden.dtype)) + self.ctx_kind[i], w_kv)
                kv = torch.where(take[..., None], rows, kv)
            k = kv[..., :A].reshape(B, T, W, nh, dh)
            v = kv[..., A:].reshape(B, T, W, nh, dh)
            att = torch.einsum("btnd,btwnd->btnw", q, k) / math.sqrt(dh) + self.ctx_rel.to(q.dtype)
            att = att.masked_fill(~chosen[:, :, None, :], float("-inf"))
            att = torch.softmax(att.float(), dim=-1).to(q.dtype)
            o = torch.einsum("btnw,btwnd->btnd", att, v).reshape(B, T, A)
        z = y + self.ctx_o(o)
        if self.context["frontier"]:
            z = z + self._frontier(ctx, pos, start, hidden.dtype)
        return z + self.ctx_down(nn.functional.silu(self.ctx_up(z)))

    def _frontier(self, ctx: ContextInputs, pos: torch.Tensor, start: torch.Tensor, dtype) -> torch.Tensor:
        """The direct path: the deepest kind's state at the newest position f it is available for (per query),
        normed and mapped, plus an embedding of t - f; zero where that kind has no position yet (f < start)."""
        i = max(range(len(self.context_layers)), key=lambda j: self.context_layers[j])
        B, T = pos.shape
        avail = ctx.avail[i].to(pos.device)
        f = (avail[:, None].expand(B, T) if avail.dim() == 1 else avail) - 1
        f = torch.minimum(f, pos)  # a query reads nothing after itself
        ok = (f >= start[:, None]) & (f >= 0)
        st = ctx.states[i]
        H = st.shape[-1]
        st = st.gather(1, f.clamp(0, st.shape[1] - 1)[..., None].expand(B, T, H).to(st.device)).to(dtype)
        W = self.ctx_dist.shape[0]
        d = (pos - f).clamp(1, W) - 1
        out = self.ctx_front(self.ctx_norms[i](st) + self.ctx_kind[i]) + self.ctx_dist[d].to(dtype)
        return torch.where(ok[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))

    def sequence_context(self, states: dict, distance, mid_distance=None, start=None) -> ContextInputs:
        """`ContextInputs` for whole sequences (training, evaluation): `states` {layer: `[B, T, H]`} holds every
        layer in `context_layers`; the query at t reads the final layer at positions <= t - distance (the frontier
        the full model verified), a deeper exit (not its own) at positions <= t - mid_distance (default: none),
        and its own exit up to t. `distance` / `mid_distance`: ints or `[B, T]` tensors (>= 1; draw them like
        decoding produces them when training). `start` `[B]`: first real position of each row (left padding)."""
        if self.context_layers is None:
            raise ValueError(f"a {self.head_type!r} head reads no context")
        own = self.context_layers[0]
        x = states[own]
        B, T = x.shape[:2]
        pos = torch.arange(T, device=x.device).expand(B, T)

        def upto(d):
            if d is None:
                return torch.zeros_like(pos)
            d = torch.as_tensor(d, device=x.device)
            if bool((d < 1).any()):
                raise ValueError("frontier distances must be >= 1 (the position drafting from is never verified)")
            return pos + 1 - d

        final = max(self.context_layers)
        avail = [pos + 1 if L == own else upto(distance) if L == final else upto(mid_distance)
                 for L in self.context_layers]
        return ContextInputs(states=[states[L] for L in self.context_layers], avail=avail, query_pos=pos,
                             layers=list(self.context_layers), start=start)

    def run_layer_fresh(self, adapter, attention_mask: torch.Tensor | None = None):
        """`run_layer` for whole (left-padded) sequences without a decoder cache: training and evaluation."""
        def run(module, hidden):
            B, T = hidden.shape[:2]
            mask = torch.ones(B, T, dtype=torch.long, device=hidden.device) if attention_mask is None else attention_mask
            cache = adapter.new_cache(B, extra=self.cache_index - adapter.num_layers + 1)
            return adapter.run_module(module, self.layer_type, hidden, cache_index=self.cache_index,
                                      position_ids=positions_from_mask(mask), cache=cache, valid=mask.bool())

        return run

    def extra_repr(self) -> str:
        return (f"head_type={self.head_type}" + (f", rank={self.rank}" if self.rank else "")
                + (f", vocab={self.vocab_size}" if self.vocab is not None else "")
                + (f", context_layers={self.context_layers}, window={self.context['window']}"
                   if self.context_layers else ""))

    def shape_info(self) -> dict:
        return {"head_type": self.head_type, "rank": self.rank, "vocab_size": self.vocab_size,
                "layer_type": self.layer_type, "context_layers": self.context_layers, "context": self.context}
