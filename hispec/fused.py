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
"""

from __future__ import annotations

import sys

import torch
from torch import nn

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
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        if rotary is not None:
            q, k = self.rope(q, k, *rotary)
        k, v = cache.update(k, v, attn.layer_idx)
        out, _ = self.attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling,
                                sliding_window=getattr(attn, "sliding_window", None), position_ids=position_ids)
        hidden = residual + attn.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _matches(adapter, fused: StandardLayers) -> bool:
    """Whether `fused.run` gives each probed layer's own output bit for bit (random states, a short cache)."""
    from .cache import KVCache

    g = torch.Generator().manual_seed(0)
    dev, dt = adapter.device, adapter.dtype
    n = adapter.num_layers
    x = torch.randn(1, 3, adapter.hidden_size, generator=g).to(dev, dt)
    pos = torch.arange(3, device=dev)[None]
    valid = torch.ones(1, 3, dtype=torch.bool, device=dev)
    types = set(adapter.layer_types)
    with torch.no_grad():
        for i in sorted({0, n - 1}):
            outs = []
            for use in (False, True):
                cache = KVCache(n, 1, device=dev)
                _, _, masks, rotary = adapter._prepare(x, pos, valid, cache, i, types)
                t = adapter.layer_types[i]
                if use:
                    outs.append(fused.run(i, x, pos, cache, masks[t], rotary.get(t)))
                else:
                    outs.append(adapter._call_layer(adapter.parts.layers[i], t, x, pos, cache, masks, rotary))
            if not torch.equal(outs[0], outs[1]):
                return False
    return True


def standard_layers(adapter) -> StandardLayers | None:
    """A `StandardLayers` for `adapter`'s model when its layers are standard and reproduced exactly, else None."""
    if not adapter.parts.layers or not all(_standard(layer) for layer in adapter.parts.layers):
        return None
    if getattr(adapter.parts.layers[0].self_attn, "layer_idx", None) is None:
        return None
    try:
        fused = StandardLayers(adapter)
        return fused if _matches(adapter, fused) else None
    except (TypeError, ValueError, RuntimeError, AttributeError, KeyError):
        return None  # a layout that only looks standard: the layers run as they are
