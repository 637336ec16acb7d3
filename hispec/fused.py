"""Standard pre-norm decoder layers run operator by operator: the layer's own operators, without its Python.

Contract: `standard_layers(adapter)` returns a `StandardLayers` when every decoder layer of the adapter's model has
the standard layout (children `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`; an attention with
`q_proj`, `k_proj`, `v_proj`, `o_proj`, optionally `q_norm` / `k_norm` over the head dimension, `head_dim`,
`scaling`; the family's own `apply_rotary_pos_emb` and `eager_attention_forward` in its modeling module: Llama,
Mistral, Qwen2, Qwen3, SmolLM, ...) and `StandardLayers.run` reproduces the layer's own forward bit for bit on a
probe; else None, and `DecoderAdapter` calls the layers as they are. `run(i, hidden, position_ids, cache, mask,
rotary)` is `layer(hidden, attention_mask=mask, position_ids=..., cache=cache, position_embeddings=rotary)`;
`DecoderAdapter` calls the layer itself where hooks are registered on it (or on every module), so they run.

Why: a layer's forward in transformers passes through decorators (`deprecate_kwarg`), `GradientCheckpointingLayer.
__call__`, hub-kernel wrappers, keyword plumbing, `nn.Module.__call__` and `__getattr__` for every child and
parameter, and the attention interface's checks; at one position these cost more than many of the small operators
(tools/pass_profile.py: `python + dispatch`). `run` computes the same operators in the same order on the same
tensors: the projections through their modules (`forward` directly where hook-free: `hispec.packed`'s kernels),
`KVCache.update`, and, each where a probe at load finds it equal to the module it replaces bit for bit, the RMSNorm
(`_rms_eps`), the rotary embedding (`_llama_rope`), SiLU (`_is_silu`) and sdpa (`_sdpa`) as torch operators inline;
anything else through its module or the family's function. The whole layer is then checked against the layer's own
forward once per model (`_matches`). Nothing here knows a family by name.

Two steps differ from the layer's forward in how they compute, never in what: QKV and gate/up as one product each
(`hispec.merged`: bit-identical by the kernels' reduction order, checked per kernel), and attention over several
queries with grouped K/V heads through sdpa's own `enable_gqa` instead of transformers' copy of the cache per head
(`_sdpa`, kept only where `_matches` finds it exact). docs/design.md §3.7 has the measurements.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from .merged import MergedLinear, mergeable
from .packed import PackedLinear

_CHILDREN = {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_ATTN_OPTIONAL = {"q_norm", "k_norm"}


def _family_functions(attn: nn.Module):
    """The family's own `apply_rotary_pos_emb` and `eager_attention_forward`, from its modeling module."""
    mod = sys.modules.get(type(attn).__module__)
    rope = getattr(mod, "apply_rotary_pos_emb", None)
    eager = getattr(mod, "eager_attention_forward", None)
    return (rope, eager) if callable(rope) and callable(eager) else None


def _standard(layer: nn.Module) -> bool:
    names = {n for n, _ in layer.named_children()}
    attn = getattr(layer, "self_attn", None)
    if names != _CHILDREN or attn is None:
        return False
    attn_children = {n for n, _ in attn.named_children()}
    return (all(isinstance(getattr(attn, n, None), nn.Linear) for n in _ATTN)
            and attn_children <= set(_ATTN) | _ATTN_OPTIONAL
            and isinstance(getattr(attn, "head_dim", None), int) and hasattr(attn, "scaling")
            and _family_functions(attn) is not None)


class StandardLayers:
    """The model's decoder layers, each run as its forward does but without the wrappers (module docstring)."""

    def __init__(self, adapter):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.adapter = adapter
        self.layers = adapter.parts.layers
        attn = self.layers[0].self_attn
        self.rope, eager = _family_functions(attn)
        self.attention = ALL_ATTENTION_FUNCTIONS.get_interface(adapter.attn_implementation, eager)
        self.merge = True  # QKV and gate/up as one product each where the kernels allow (`hispec.merged`)
        # sdpa called directly, GQA in place (`_sdpa`); off where not exact
        self.direct_sdpa = adapter.attn_implementation == "sdpa" and getattr(attn, "is_causal", True) is True
        self.gated_mlp = _gated_mlp(self.layers[0].mlp, adapter)
        self.lean = True  # norms, rotary and SiLU inline where each is checked equal to the module (`_norm`, ...)
        self.inline_rope = _llama_rope(self.rope, attn.head_dim, adapter)
        self._groups: dict[tuple[int, int], tuple[tuple, MergedLinear | None]] = {}
        self._norms: dict[nn.Module, float | bool] = {}  # norm -> its epsilon where inline, False where not
        self._acts: dict[nn.Module, bool] = {}
        self._rotary_seen = self._rotary = None
        for layer in self.layers:  # probed now, not on first use, where a user's hook would see the probes
            for norm in _norms_of(layer):
                self._norms[norm] = _rms_eps(norm, adapter)
            if self.gated_mlp:
                self._acts[layer.mlp.act_fn] = _is_silu(layer.mlp.act_fn, adapter)

    @staticmethod
    def global_hooks() -> bool:
        """Whether module hooks are registered for every module (`torch.nn.modules.module.register_module_forward_*`):
        then every layer is called as it is, so the hooks see it (a layer with hooks of its own is too)."""
        from torch.nn.modules import module as mod

        return bool(mod._global_forward_hooks or mod._global_forward_pre_hooks)

    def run(self, i: int, hidden: torch.Tensor, position_ids: torch.Tensor, cache, mask, rotary) -> torch.Tensor:
        layer = self.layers[i]
        mods = layer._modules  # plain dict reads: `nn.Module.__getattr__` costs ~1 us each, ~800 per pass
        attn, mlp = mods["self_attn"], mods["mlp"]
        am = attn._modules
        residual = hidden
        x = self._norm(mods["input_layernorm"], hidden)
        shape = (*x.shape[:-1], -1, attn.head_dim)  # [B, T, heads, D]
        qkv = self._group(i, 0, (am["q_proj"], am["k_proj"], am["v_proj"]))
        qkv = qkv(x) if qkv is not None else None
        if qkv is None:
            qkv = (_call(am["q_proj"], x), _call(am["k_proj"], x), _call(am["v_proj"], x))
        q, k, v = qkv[0].view(shape), qkv[1].view(shape), qkv[2].view(shape)
        if am.get("q_norm") is not None:
            q, k = self._norm(am["q_norm"], q), self._norm(am["k_norm"], k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        if rotary is not None:
            q, k = self._rotate(q, k, rotary)
        k, v = cache.update(k, v, attn.layer_idx)
        if self.direct_sdpa and q.is_cpu and (mask is None or mask.shape[1] == 1) and (
                mask is not None or q.shape[2] in (1, k.shape[2])):
            out = self._sdpa(attn, q, k, v, mask)
        else:
            out, _ = self.attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling,
                                    sliding_window=getattr(attn, "sliding_window", None), position_ids=position_ids)
        hidden = residual + _call(am["o_proj"], out.reshape(*x.shape[:-1], -1).contiguous())
        x = self._norm(mods["post_attention_layernorm"], hidden)
        mm = mlp._modules
        gate_up = self._group(i, 1, (mm["gate_proj"], mm["up_proj"])) if self.gated_mlp else None
        gate_up = gate_up(x) if gate_up is not None else None
        if gate_up is None:
            return hidden + _call(mlp, x)
        act = mm["act_fn"]
        gate = nn.functional.silu(gate_up[0]) if self._silu(act) else _call(act, gate_up[0])
        return hidden + _call(mm["down_proj"], gate * gate_up[1])

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """`norm(x)`; inline where `norm` is the RMSNorm of Llama's form, `_rms_eps` (checked on a probe)."""
        eps = self._norms.get(norm)
        if eps is None:
            eps = self._norms[norm] = _rms_eps(norm, self.adapter) if self.lean else False
        if eps is False or norm._forward_hooks or norm._forward_pre_hooks:
            return norm(x)
        return _rms(x, norm._parameters["weight"], eps)

    def _rotate(self, q: torch.Tensor, k: torch.Tensor, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's `apply_rotary_pos_emb(q, k, cos, sin)`; where it is Llama's (`inline_rope`, probed), its
        operators inline, with cos and sin unsqueezed once per pass instead of once per layer."""
        if not self.inline_rope:
            return self.rope(q, k, *rotary)
        if rotary is not self._rotary_seen:  # a new pass: run_layers hands every layer the same tuple
            self._rotary_seen, self._rotary = rotary, (rotary[0].unsqueeze(1), rotary[1].unsqueeze(1))
        return _rope(q, k, *self._rotary)

    def _silu(self, act: nn.Module) -> bool:
        """Whether `act` is SiLU (checked on a probe) and hook-free: then `nn.functional.silu` is called directly."""
        ok = self._acts.get(act)
        if ok is None:
            ok = self._acts[act] = self.lean and _is_silu(act, self.adapter)
        return ok and not (act._forward_hooks or act._forward_pre_hooks)

    @staticmethod
    def _sdpa(attn, q, k, v, mask) -> torch.Tensor:
        """sdpa as transformers' `sdpa_attention_forward` calls it, without its Python, and with grouped K/V heads
        (GQA) read in place through sdpa's own `enable_gqa` for every pass. transformers' sdpa path gives
        `enable_gqa` no mask on CPU and repeats every cached K and V `groups` times instead (`repeat_kv`: the whole
        cache copied per layer and pass, 7-11% of a 2-8 position pass of SmolLM2 on an AVX2 EPYC, docs/results.md
        §The pass). `standard_layers` keeps this only where it reproduces the layer bit for bit (`_matches`). CPU
        only: on CUDA, sdpa with a mask and `enable_gqa` falls back to its math kernel (transformers' note in
        `transformers.integrations.sdpa_attention.use_gqa_in_sdpa`), so GPUs keep transformers' path."""
        groups = getattr(attn, "num_key_value_groups", 1)
        b, heads, t, d = q.shape
        if groups > 1 and t == 1 and mask is not None:  # as transformers (`pack_gqa`): a K/V head's query heads as
            out = nn.functional.scaled_dot_product_attention(  # its queries (with enable_gqa: not the same bits)
                q.reshape(b, heads // groups, groups, d), k, v, attn_mask=mask, scale=attn.scaling)
            return out.reshape(b, heads, 1, d).transpose(1, 2).contiguous()
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling,
                                                         is_causal=mask is None and t > 1, enable_gqa=groups > 1)
        return out.transpose(1, 2).contiguous()

    def _group(self, i: int, which: int, linears: tuple) -> MergedLinear | None:
        """Layer i's merged product of `linears` (which: 0 QKV, 1 gate/up), remade when the modules change (packing
        replaces them); None where merging is off or they are not all `PackedLinear`s."""
        if not self.merge:
            return None
        seen = self._groups.get((i, which))
        if seen is not None and len(seen[0]) == len(linears) and all(a is b for a, b in zip(seen[0], linears)):
            return seen[1]
        group = MergedLinear(list(linears)) if all(type(m) is PackedLinear for m in linears) and mergeable(
            *linears) else None
        self._groups[(i, which)] = (linears, group)
        return group


def _call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`; its `forward` directly where it has no hooks (`run_layers` checks the global ones per pass):
    `nn.Module.__call__` costs a few microseconds, ~200 times per pass of a 30-layer model."""
    return module(x) if module._forward_hooks or module._forward_pre_hooks else module.forward(x)


def _norms_of(layer: nn.Module) -> list[nn.Module]:
    attn = layer.self_attn
    return [m for m in (layer.input_layernorm, layer.post_attention_layernorm, getattr(attn, "q_norm", None),
                        getattr(attn, "k_norm", None)) if m is not None]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm forward, operator for operator."""
    if x.dtype == torch.float32:  # (the norm's own `.to(float32)` and back are no-ops then)
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's `apply_rotary_pos_emb` with cos and sin already unsqueezed over the heads, operator for operator."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _probe(adapter, *shape: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(adapter.device, adapter.dtype)


def _rms_eps(norm: nn.Module, adapter) -> float | bool:
    """The epsilon of `norm` where its forward is Llama's RMSNorm (`weight * (x * rsqrt(mean(x^2) + eps))` in
    float32), checked bit for bit on probes, else False."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    w = norm._parameters.get("weight")
    if not isinstance(eps, float) or w is None or w.dim() != 1 or set(norm._parameters) != {"weight"}:
        return False
    with torch.no_grad():
        for shape in ((1, 1, w.shape[0]), (2, 3, w.shape[0]), (1, 4, 2, w.shape[0])):
            x = _probe(adapter, *shape) * 3
            try:
                if not torch.equal(norm.forward(x), _rms(x, w, eps)):  # (forward: no user hooks)
                    return False
            except (TypeError, RuntimeError):
                return False
    return eps


def _llama_rope(rope, head_dim: int, adapter) -> bool:
    """Whether the family's `apply_rotary_pos_emb(q, k, cos, sin)` is Llama's (`StandardLayers._rotate`), checked
    bit for bit on a probe."""
    q, k = _probe(adapter, 1, 4, 3, head_dim, seed=3), _probe(adapter, 1, 2, 3, head_dim, seed=4)
    cos, sin = _probe(adapter, 1, 3, head_dim, seed=5), _probe(adapter, 1, 3, head_dim, seed=6)
    with torch.no_grad():
        try:
            return all(torch.equal(a, b) for a, b in zip(rope(q, k, cos, sin),
                                                          _rope(q, k, cos.unsqueeze(1), sin.unsqueeze(1))))
        except (TypeError, RuntimeError, ValueError):
            return False


def _is_silu(act: nn.Module, adapter) -> bool:
    """Whether `act` is SiLU, bit for bit on a probe."""
    x = _probe(adapter, 2, 3, 16) * 4
    with torch.no_grad():
        try:
            return torch.equal(act.forward(x), nn.functional.silu(x))
        except (TypeError, RuntimeError):
            return False


def _gated_mlp(mlp: nn.Module, adapter) -> bool:
    """Whether `mlp` is `down_proj(act_fn(gate_proj(x)) * up_proj(x))`, bit for bit on a probe (Llama's, Qwen's,
    Mistral's MLP): then its gate and up products can be one (`hispec.merged`)."""
    names = {n for n, _ in mlp.named_children()}
    if names != {"gate_proj", "up_proj", "down_proj", "act_fn"} or not mergeable(mlp.gate_proj, mlp.up_proj):
        return False
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 3, adapter.hidden_size, generator=g).to(adapter.device, adapter.dtype)
    with torch.no_grad():
        try:
            return torch.equal(mlp(x), mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)))
        except (TypeError, RuntimeError, AttributeError):
            return False


def _matches(adapter, fused: StandardLayers) -> bool:
    """Whether `fused.run` gives each probed layer's own output bit for bit, on random states: a 5-position prompt,
    one position, 3 positions behind the cache with a masked hole (a masked attention over several queries), then one
    position over that hole (a masked one-query attention)."""
    from .cache import KVCache

    g = torch.Generator().manual_seed(0)
    dev, dt = adapter.device, adapter.dtype
    n = adapter.num_layers
    types = set(adapter.layer_types)
    with torch.no_grad():
        for i in sorted({0, n - 1}):
            t = adapter.layer_types[i]
            caches = (KVCache(n, 1, device=dev), KVCache(n, 1, device=dev))
            done = 0
            for T in (5, 1, 3, 1):
                x = torch.randn(1, T, adapter.hidden_size, generator=g).to(dev, dt)
                pos = torch.arange(done, done + T, device=dev)[None]
                valid = torch.ones(1, T, dtype=torch.bool, device=dev)
                valid[0, 1:2] = T != 3  # the last step leaves a hole
                outs = []
                for use, cache in zip((False, True), caches):
                    kv_valid, kv_pos, masks, rotary = adapter._prepare(x, pos, valid, cache, i, types)
                    if use:
                        outs.append(fused.run(i, x, pos, cache, masks[t], rotary.get(t)))
                    else:
                        outs.append(adapter._call_layer(adapter.parts.layers[i], t, x, pos, cache, masks, rotary))
                    cache.set_slot_meta(i, i + 1, kv_valid, kv_pos)
                if not torch.equal(outs[0], outs[1]):
                    return False
                done += T
    return True


def standard_layers(adapter) -> StandardLayers | None:
    """A `StandardLayers` for `adapter`'s model when its layers are standard and reproduced exactly, else None."""
    if not adapter.parts.layers or not all(_standard(layer) for layer in adapter.parts.layers):
        return None
    if getattr(adapter.parts.layers[0].self_attn, "layer_idx", None) is None:
        return None
    try:
        fused = StandardLayers(adapter)
        if fused.direct_sdpa and not _matches(adapter, fused):
            fused.direct_sdpa = False  # sdpa's own GQA not exact here: transformers' attention for every pass
        if not _matches(adapter, fused):
            fused.lean = fused.inline_rope = False  # the norms, rotary and activation through their modules
            fused._norms.clear(), fused._acts.clear()
        return fused if _matches(adapter, fused) else None
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError):
        return None  # a layout that only looks standard: the layers run as they are
