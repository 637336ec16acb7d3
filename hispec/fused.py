"""Standard pre-norm decoder layers called without their wrappers: the same operators, fewer Python frames.

Contract: `standard_layers(adapter)` returns a `StandardLayers` when every decoder layer of the adapter's model has
the standard layout (children `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`; an attention with
`q_proj`, `k_proj`, `v_proj`, `o_proj`, optionally `q_norm` / `k_norm` over the head dimension, `head_dim`,
`scaling`; the family's own `apply_rotary_pos_emb` and `eager_attention_forward` in its modeling module: Llama,
Mistral, Qwen2, Qwen3, SmolLM, ...) and `StandardLayers.run` reproduces the layer's own forward bit for bit on a
probe; else None, and `DecoderAdapter` calls the layers as they are. `run(i, hidden, position_ids, cache, mask,
rotary)` is `layer(hidden, attention_mask=mask, position_ids=..., cache=cache, position_embeddings=rotary)`;
`DecoderAdapter` calls the layer itself where hooks are registered on it (or on every module), so they run.

Why: a layer's forward in transformers passes through decorators (`deprecate_kwarg`), `GradientCheckpointingLayer.
__call__`, hub-kernel wrappers and keyword plumbing that cost more than the small operators of a one-position pass
(tools/pass_profile.py: `python + dispatch`). `run` calls the same modules and functions in the same order on the
same tensors — the norms, the projections (so `hispec.packed`'s kernels), the family's rotary function,
`KVCache.update`, transformers' attention interface (`ALL_ATTENTION_FUNCTIONS`), the MLP — so its output is the
layer's own, checked once per model (`_matches`). Nothing here knows a family by name.

Two steps differ from the layer's forward in how they compute, never in what: QKV and gate/up as one product each
(`hispec.merged`: bit-identical by the kernels' reduction order, checked per kernel), and attention over several
queries with grouped K/V heads through sdpa's own `enable_gqa` instead of transformers' copy of the cache per head
(`_grouped_attention`, kept only where `_matches` finds it exact). docs/design.md §3.7 has the measurements.
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
        self.grouped_sdpa = adapter.attn_implementation == "sdpa"  # `_grouped_attention`; off where not exact
        self.gated_mlp = _gated_mlp(self.layers[0].mlp, adapter)
        self._groups: dict[tuple[int, int], tuple[tuple, MergedLinear | None]] = {}

    @staticmethod
    def global_hooks() -> bool:
        """Whether module hooks are registered for every module (`torch.nn.modules.module.register_module_forward_*`):
        then every layer is called as it is, so the hooks see it (a layer with hooks of its own is too)."""
        from torch.nn.modules import module as mod

        return bool(mod._global_forward_hooks or mod._global_forward_pre_hooks)

    def run(self, i: int, hidden: torch.Tensor, position_ids: torch.Tensor, cache, mask, rotary) -> torch.Tensor:
        layer = self.layers[i]
        attn = layer.self_attn
        residual = hidden
        x = layer.input_layernorm(hidden)
        shape = (*x.shape[:-1], -1, attn.head_dim)  # [B, T, heads, D]
        qkv = self._group(i, 0, (attn.q_proj, attn.k_proj, attn.v_proj))
        qkv = qkv(x) if qkv is not None else None
        q, k, v = qkv if qkv is not None else (attn.q_proj(x), attn.k_proj(x), attn.v_proj(x))
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        if rotary is not None:
            q, k = self.rope(q, k, *rotary)
        k, v = cache.update(k, v, attn.layer_idx)
        if (self.grouped_sdpa and q.is_cpu and getattr(attn, "num_key_value_groups", 1) > 1 and mask is not None
                and q.shape[2] > 1 and mask.shape[1] == 1):
            out = self._grouped_attention(attn, q, k, v, mask)
        else:
            out, _ = self.attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling,
                                    sliding_window=getattr(attn, "sliding_window", None), position_ids=position_ids)
        hidden = residual + attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())
        x = layer.post_attention_layernorm(hidden)
        mlp = layer.mlp
        gate_up = self._group(i, 1, (mlp.gate_proj, mlp.up_proj)) if self.gated_mlp else None
        gate_up = gate_up(x) if gate_up is not None else None
        if gate_up is None:
            return hidden + mlp(x)
        return hidden + mlp.down_proj(mlp.act_fn(gate_up[0]) * gate_up[1])

    @staticmethod
    def _grouped_attention(attn, q, k, v, mask) -> torch.Tensor:
        """sdpa over several positions with grouped K/V heads (GQA) and a mask, through sdpa's own `enable_gqa`:
        each query head reads its K/V head in place. transformers' sdpa path gives `enable_gqa` no mask on CPU and
        repeats every cached K and V `groups` times instead (`repeat_kv`: the whole cache copied per layer and
        pass, 7-11% of a 2-8 position pass of SmolLM2 on an AVX2 EPYC, docs/results.md §The pass).
        `standard_layers` keeps this only where it reproduces the layer bit for bit (`_matches`). CPU only: on CUDA,
        sdpa with a mask and `enable_gqa` falls back to its math kernel (transformers' note in
        `transformers.integrations.sdpa_attention.use_gqa_in_sdpa`), so GPUs keep transformers' path."""
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling,
                                                         enable_gqa=True)
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
    one position, then 3 positions behind the cache with a masked hole (a masked attention over several queries)."""
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
            for T in (5, 1, 3):
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
        if fused.grouped_sdpa and not _matches(adapter, fused):
            fused.grouped_sdpa = False  # sdpa's own GQA not exact here: transformers' attention for every pass
        return fused if _matches(adapter, fused) else None
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError):
        return None  # a layout that only looks standard: the layers run as they are
