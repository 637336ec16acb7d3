"""The one place that knows how a Hugging Face decoder-only model is laid out.

Contract: `DecoderAdapter(model)` finds, through transformers' public modules and the model's config, the pieces
every decoder-only LM has — token embeddings (plus learned positions / input projection where a family has them),
the list of decoder layers, rotary embeddings, the final norm, the output projection — and runs any contiguous
range of layers `[start, end)` over given hidden states on one shared `hispec.cache.KVCache`.

Inputs are batch-first with absolute per-row positions and a per-token validity mask (left padding and rows with
fewer new tokens than others are simply invalid slots). Attention masks are built from `(valid, position)` per
layer type (full / sliding window), so every range sees exactly what a single full forward would. Nothing else
in hispec touches model internals; there is no dispatch on model names.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from .cache import KVCache

_NORM_NAMES = ("norm", "final_layer_norm", "final_layernorm", "ln_f", "norm_f")
_CACHE_KWARGS = ("cache", "past_key_values", "layer_past", "past_key_value")
_SUPPORTED_ATTN = ("sdpa", "eager")
_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """The model lacks a piece hispec needs; the message names the model type and the missing piece."""


def _model_type(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", type(model).__name__)


@dataclass(frozen=True)
class _Parts:
    body: nn.Module  # the module that owns the decoder layer list
    layers: nn.ModuleList
    embed_tokens: nn.Module
    embed_positions: nn.Module | None
    project_in: nn.Module | None
    project_out: nn.Module | None
    final_norm: nn.Module
    rotary: nn.Module | None
    lm_head: nn.Module


def _find_parts(model: nn.Module, num_layers: int) -> _Parts:
    mtype = _model_type(model)
    # The decoder layer list: the shallowest ModuleList holding exactly num_hidden_layers blocks.
    candidates = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList) and len(mod) == num_layers and len(mod) > 0
    ]
    if not candidates:
        raise UnsupportedModelError(
            f"model type '{mtype}': no list of {num_layers} decoder layers (config.num_hidden_layers) was found"
        )
    layers_name = min(candidates, key=lambda c: c[0].count("."))[0]
    body = model.get_submodule(layers_name.rpartition(".")[0]) if "." in layers_name else model
    layers = model.get_submodule(layers_name)

    embed_tokens = model.get_input_embeddings()
    if embed_tokens is None:
        raise UnsupportedModelError(f"model type '{mtype}': get_input_embeddings() returned nothing")
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise UnsupportedModelError(
            f"model type '{mtype}': get_output_embeddings() returned nothing (is this a *ForCausalLM model?)"
        )
    final_norm = next((getattr(body, n) for n in _NORM_NAMES if isinstance(getattr(body, n, None), nn.Module)), None)
    if final_norm is None:
        raise UnsupportedModelError(
            f"model type '{mtype}': no final norm found next to the decoder layers "
            f"(looked for {', '.join(_NORM_NAMES)} on {type(body).__name__})"
        )
    rotary = getattr(body, "rotary_emb", None)
    embed_positions = getattr(body, "embed_positions", None)
    if rotary is None and embed_positions is None:
        raise UnsupportedModelError(
            f"model type '{mtype}': no position encoding found (neither rotary_emb nor embed_positions on "
            f"{type(body).__name__})"
        )
    return _Parts(
        body=body,
        layers=layers,
        embed_tokens=embed_tokens,
        embed_positions=embed_positions,
        project_in=getattr(body, "project_in", None),
        project_out=getattr(body, "project_out", None),
        final_norm=final_norm,
        rotary=rotary,
        lm_head=lm_head,
    )


class DecoderAdapter:
    """Range-wise access to a decoder-only `PreTrainedModel` (see module docstring).

    Shapes: `B` batch, `T` new tokens, `S` cached slots of the range, `H` hidden size, `V` vocabulary.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        mtype = _model_type(model)
        config = model.config
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        self.config = config
        self.num_layers: int = int(getattr(config, "num_hidden_layers", 0) or 0)
        if self.num_layers < 2:
            raise UnsupportedModelError(f"model type '{mtype}': config.num_hidden_layers is missing or < 2")
        self.hidden_size: int = int(config.hidden_size)
        self.vocab_size: int = int(config.vocab_size)
        self.parts = _find_parts(model, self.num_layers)

        # How each layer takes its cache.
        params = inspect.signature(self.parts.layers[0].forward).parameters
        self._cache_kw = next((k for k in _CACHE_KWARGS if k in params), None)
        if self._cache_kw is None:
            raise UnsupportedModelError(
                f"model type '{mtype}': decoder layer {type(self.parts.layers[0]).__name__}.forward takes none of "
                f"{', '.join(_CACHE_KWARGS)}"
            )
        self._layer_takes_pos_emb = "position_embeddings" in params
        if self.parts.rotary is not None and not self._layer_takes_pos_emb:
            raise UnsupportedModelError(
                f"model type '{mtype}': the model has rotary_emb but its decoder layers take no position_embeddings"
            )
        self._rotary_by_type = self.parts.rotary is not None and (
            "layer_type" in inspect.signature(self.parts.rotary.forward).parameters
        )

        # Attention type per layer.
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:
            layer_types = ["sliding_attention" if window else "full_attention"] * self.num_layers
        layer_types = list(layer_types)[: self.num_layers]
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise UnsupportedModelError(f"model type '{mtype}': unsupported attention layer types {unknown}")
        if "sliding_attention" in layer_types and not window:
            raise UnsupportedModelError(f"model type '{mtype}': sliding layers but no config.sliding_window")
        self.layer_types: list[str] = layer_types
        self.sliding_window: int | None = int(window) if window else None
        self.logit_softcap = getattr(config, "final_logit_softcapping", None)

    # ------------------------------------------------------------------ embeddings and output
    @property
    def attn_implementation(self) -> str:
        impl = getattr(self.model.config, "_attn_implementation", None) or "eager"
        if impl not in _SUPPORTED_ATTN:
            raise UnsupportedModelError(
                f"model type '{_model_type(self.model)}': hispec runs attention through masks it builds itself "
                f"and supports attn_implementation "
                f"sdpa or eager; this model uses '{impl}'. Load it with attn_implementation='sdpa'."
            )
        return impl

    @property
    def dtype(self) -> torch.dtype:
        return self.parts.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.parts.lm_head.weight.device

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids`, `position_ids` `[B, T]` -> hidden states `[B, T, H]` entering layer 0."""
        p = self.parts
        h = p.embed_tokens(input_ids)
        if p.project_in is not None:
            h = p.project_in(h)
        if p.embed_positions is not None:
            pos = position_ids.clamp(min=0)
            h = h + p.embed_positions(None, 0, position_ids=pos).to(h.dtype)
        return h

    @property
    def final_norm(self) -> nn.Module:
        return self.parts.final_norm

    def project(self, normed: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Normed hidden `[.., H]` -> logits `[.., V]` (or `[.., len(vocab)]` over the token ids in `vocab`)."""
        p = self.parts
        if p.project_out is not None:
            normed = p.project_out(normed)
        if vocab is None:
            logits = p.lm_head(normed)
        else:
            weight, bias = self._vocab_rows(vocab)
            logits = nn.functional.linear(normed, weight, bias)
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def _vocab_rows(self, vocab: torch.Tensor):
        """The lm_head rows (and bias) of `vocab`; copies of a frozen lm_head are cached (a reduced-vocabulary head
        projects every decoding step, and gathering 8k x H rows each time costs as much as the product)."""
        w = self.parts.lm_head.weight
        b = getattr(self.parts.lm_head, "bias", None)
        if w.requires_grad:
            return w.index_select(0, vocab), None if b is None else b.index_select(0, vocab)
        key = (vocab.data_ptr(), vocab.numel(), vocab._version, str(vocab.device), w.data_ptr(), w.dtype, w._version)
        cache = self.__dict__.setdefault("_vocab_rows_cache", {})
        hit = cache.get(key)
        if hit is None:
            with torch.no_grad():
                hit = (w.index_select(0, vocab), None if b is None else b.index_select(0, vocab))
            if len(cache) >= 4:
                cache.pop(next(iter(cache)))
            cache[key] = hit
        return hit

    def final_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden after the last layer `[.., H]` -> the model's own logits `[.., V]`."""
        return self.project(self.parts.final_norm(hidden))

    # ------------------------------------------------------------------ layers
    def new_cache(self, batch_size: int, extra: int = 0) -> KVCache:
        """A cache for the model's layers plus `extra` layers of exit heads (indices num_layers, ...)."""
        return KVCache(self.num_layers + extra, batch_size, device=self.device)

    def _masks(self, kv_valid, kv_pos, q_pos, types: set[str], dtype) -> dict[str, torch.Tensor | None]:
        # kv_valid, kv_pos: [B, K]; q_pos: [B, T]; the T queries are the last T slots.
        T, K = q_pos.shape[1], kv_pos.shape[1]
        allowed = kv_valid[:, None, :] & (kv_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, K]
        own = torch.zeros(T, K, dtype=torch.bool, device=allowed.device)
        own[torch.arange(T), torch.arange(K - T, K)] = True  # a padded query attends to itself: no NaN
        impl = self.attn_implementation
        masks = {}
        for t in types:
            m = allowed
            if t == "sliding_attention":
                m = m & ((q_pos[:, :, None] - kv_pos[:, None, :]) < self.sliding_window)
            m = (m | own)[:, None]  # [B, 1, T, K]
            causal = T == 1 or T == K
            if causal and T > 1:
                ref = torch.ones(T, K, dtype=torch.bool, device=m.device).tril(K - T)
                causal = bool(torch.equal(m, ref.expand_as(m)))
            elif causal:
                causal = bool(m.all())
            if impl == "sdpa" and causal:
                # Plain causal attention: give sdpa no mask, as transformers does (is_causal / GQA kernels), so
                # low-precision numerics match a plain forward bit for bit.
                masks[t] = None
                continue
            if impl == "eager":
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
            masks[t] = m
        return masks

    def _prepare(self, hidden, position_ids, valid, cache, slot_layer: int, types: set[str]):
        if valid is None:
            valid = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        old_valid, old_pos = cache.slot_meta(slot_layer)
        kv_valid = torch.cat([old_valid, valid], 1)
        kv_pos = torch.cat([old_pos, position_ids], 1)
        masks = self._masks(kv_valid, kv_pos, position_ids, types, hidden.dtype)
        rotary = {}
        if self.parts.rotary is not None:
            if self._rotary_by_type:
                rotary = {t: self.parts.rotary(hidden, position_ids, t) for t in types}
            else:
                pe = self.parts.rotary(hidden, position_ids)
                rotary = {t: pe for t in types}
        return kv_valid, kv_pos, masks, rotary

    def _call_layer(self, layer, layer_type, hidden, position_ids, cache, masks, rotary):
        kwargs = {"attention_mask": masks[layer_type], "position_ids": position_ids, "use_cache": True}
        kwargs[self._cache_kw] = cache
        if rotary:
            kwargs["position_embeddings"] = rotary[layer_type]
        out = layer(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def run_layers(
        self,
        hidden: torch.Tensor,
        start: int,
        end: int,
        *,
        position_ids: torch.Tensor,
        cache: KVCache,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run decoder layers `[start, end)` over `hidden` `[B, T, H]`, appending T slots to their cache.

        `position_ids` `[B, T]` are absolute; `valid` `[B, T]` (default all True) marks real tokens — invalid
        ones (padding, or a row with fewer new tokens) are written as masked slots and their outputs are junk.
        """
        if not 0 <= start < end <= self.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is out of range for a {self.num_layers}-layer model")
        cache.seq_length(start, end)
        types = set(self.layer_types[start:end])
        kv_valid, kv_pos, masks, rotary = self._prepare(hidden, position_ids, valid, cache, start, types)
        for i in range(start, end):
            hidden = self._call_layer(self.parts.layers[i], self.layer_types[i], hidden, position_ids, cache, masks,
                                      rotary)
        cache.set_slot_meta(start, end, kv_valid, kv_pos)
        return hidden

    def run_module(
        self,
        layer: nn.Module,
        layer_type: str,
        hidden: torch.Tensor,
        *,
        cache_index: int,
        position_ids: torch.Tensor,
        cache: KVCache,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one extra decoder layer (a `layer` exit head: a copy of a base layer whose attention writes to
        cache layer `cache_index`, beyond the model's own) exactly as `run_layers` runs the model's layers."""
        if layer_type not in _LAYER_TYPES:
            raise ValueError(f"unknown layer type {layer_type!r}")
        if not self.num_layers <= cache_index < cache.num_layers:
            raise ValueError(f"cache index {cache_index} is not an extra slot of this cache ({cache.num_layers} layers)")
        kv_valid, kv_pos, masks, rotary = self._prepare(hidden, position_ids, valid, cache, cache_index, {layer_type})
        hidden = self._call_layer(layer, layer_type, hidden, position_ids, cache, masks, rotary)
        cache.set_slot_meta(cache_index, cache_index + 1, kv_valid, kv_pos)
        return hidden

    def forward_all(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        valid: torch.Tensor | None = None,
        exits: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """All layers in one go: returns final logits `[B, T, V]` and the hidden states after each layer in
        `exits` (`{l: [B, T, H]}`, the residual stream after the first l layers)."""
        hidden = self.embed(input_ids, position_ids)
        saved: dict[int, torch.Tensor] = {}
        bounds = sorted({0, self.num_layers, *exits})
        for a, b in zip(bounds[:-1], bounds[1:]):
            hidden = self.run_layers(hidden, a, b, position_ids=position_ids, cache=cache, valid=valid)
            if b in exits:
                saved[b] = hidden
        return self.final_logits(hidden), saved


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left-padded 2-D mask `[B, T]` -> absolute positions `[B, T]` (0 for padding), as HF generate does."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)
