"""The one place that knows how a Hugging Face decoder-only model is laid out.

Contract: `DecoderAdapter(model)` finds, through transformers' public modules and the model's config, the pieces
every decoder-only LM has — token embeddings (plus learned positions / input projection where a family has them),
the list of decoder layers, rotary embeddings, the final norm, the output projection — and runs any contiguous
range of layers `[start, end)` over given hidden states on one shared `hispec.cache.KVCache`.

Inputs are batch-first with absolute per-row positions and a per-token validity mask (left padding and rows with
fewer new tokens than others are simply invalid slots). Attention masks are built from `(valid, position)` per
layer type (full / sliding window), so every range sees exactly what a single full forward would. Nothing else
in hispec touches model internals; there is no dispatch on model names.

What a family does outside its public modules is taken from the model's own code, never from a list of known quirks:

* Logits. A `*ForCausalLM.forward` may transform the logits after (or the hidden states before) its lm_head —
  Gemma2 soft-caps, Cohere multiplies by `logit_scale`, Granite divides by `logits_scaling`, and a custom model may
  do anything. `final_logits` / `project` therefore run that forward itself, with the decoder body (the module
  holding the layer list, or the first ancestor the forward actually calls) standing aside for the duration of the
  call and handing over the given final hidden states as its `last_hidden_state`: lm_head, scaling, capping and
  whatever else the forward does happen exactly as in `model(...)`. See `DecoderAdapter._model_head`.
* Embeddings. The hidden states entering layer 0 are `embed_tokens` (+ `project_in`, + learned positions) when
  that reproduces the model's own forward bit for bit (checked once at construction); otherwise (Granite's
  `embedding_multiplier`, say) `embed` runs the body's own forward and takes what it hands to layer 0.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass

import torch
from torch import nn

from . import packed
from .cache import KVCache
from .fused import standard_layers

_NORM_NAMES = ("norm", "final_layer_norm", "final_layernorm", "ln_f", "norm_f")
_CACHE_KWARGS = ("cache", "past_key_values", "layer_past", "past_key_value")
_SUPPORTED_ATTN = ("sdpa", "eager")
_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModelError(ValueError):
    """The model lacks a piece hispec needs; the message names the model type and the missing piece."""


# Module swaps (`_model_head`) are serialised process-wide: two threads swapping on one model would otherwise
# restore each other's stand-ins. A stand-in called from any thread but the one that placed it passes the call on
# to the real module, so other code may run the same model concurrently.
_SWAP_LOCK = threading.RLock()


class _StandIn(nn.Module):
    """Takes a submodule's place during one call of the model's own forward (see `DecoderAdapter._model_head`).
    Attribute reads it does not answer go to the real module; so do calls from other threads."""

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "_real", None)
        object.__setattr__(self, "_owner", None)
        object.__setattr__(self, "calls", 0)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            real = object.__getattribute__(self, "_real")
            if real is None:
                raise
            return getattr(real, name)

    def __call__(self, *args, **kwargs):
        if threading.get_ident() != self._owner:
            return self._real(*args, **kwargs)
        object.__setattr__(self, "calls", self.calls + 1)
        return self.answer(*args, **kwargs)

    def answer(self, *args, **kwargs):
        raise NotImplementedError


class _GivenHidden(_StandIn):
    """Stands in for the decoder body: whatever it is asked, its output is the given final hidden states (one
    output object, refilled per call: building a ModelOutput costs ~10 us)."""

    hidden: torch.Tensor | None = None
    _out = None

    def answer(self, *args, **kwargs):
        out = self._out
        if out is None:
            from transformers.modeling_outputs import BaseModelOutputWithPast

            out = BaseModelOutputWithPast(last_hidden_state=self.hidden)
            object.__setattr__(self, "_out", out)
        else:
            out["last_hidden_state"] = self.hidden
        return out


class _Rows(_StandIn):
    """Stands in for lm_head: the product with a subset of its rows (`weight`, `bias` set before each call)."""

    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def answer(self, x, *args, **kwargs):
        return nn.functional.linear(x, self.weight, self.bias)


class _Fixed(_StandIn):
    """Stands in for lm_head in the construction-time probe: returns given logits whatever its input, and keeps
    that input."""

    logits: torch.Tensor | None = None
    seen: torch.Tensor | None = None

    def answer(self, x, *args, **kwargs):
        object.__setattr__(self, "seen", x)
        return self.logits


class _Captured(Exception):
    """Raised by the layer-0 pre-hook of `DecoderAdapter._model_embed` to stop the body's forward there."""


def _slot_of(root: nn.Module, target: nn.Module) -> tuple[nn.Module, str] | None:
    """(parent, attribute name) under which `target` is registered inside `root`; None if it is not."""
    for name, mod in root.named_modules(remove_duplicate=False):
        if mod is target and name:
            parent, _, attr = name.rpartition(".")
            return root.get_submodule(parent), attr
    return None


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
        self._setup_logit_path(mtype)
        self._setup_embed(mtype)
        # Standard layers are called without their wrappers (`hispec.fused`, checked bit for bit); None: as they are.
        self.standard = standard_layers(self)

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
        """`input_ids`, `position_ids` `[B, T]` -> hidden states `[B, T, H]` entering layer 0, as the model's own
        forward computes them (see `_setup_embed`)."""
        if self.embeds_by_model:
            return self._model_embed(input_ids, position_ids)
        return self._plain_embed(input_ids, position_ids)

    def _plain_embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        p = self.parts
        h = p.embed_tokens(input_ids)
        if p.project_in is not None:
            h = p.project_in(h)
        if p.embed_positions is not None:
            pos = position_ids.clamp(min=0)
            h = h + p.embed_positions(None, 0, position_ids=pos).to(h.dtype)
        return h

    def _model_embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The body's own forward over `input_ids`, stopped where it hands its hidden states to layer 0."""
        owner = threading.get_ident()

        def grab(module, args, kwargs):
            if threading.get_ident() == owner:
                raise _Captured(args[0] if args else kwargs["hidden_states"])

        kwargs = {"input_ids": input_ids}
        if self._embed_takes_positions:
            kwargs["position_ids"] = position_ids.clamp(min=0)
        if self._embed_takes_use_cache:
            kwargs["use_cache"] = False
        handle = self.parts.layers[0].register_forward_pre_hook(grab, with_kwargs=True, prepend=True)
        try:
            self.parts.body(**kwargs)
        except _Captured as got:
            return got.args[0]
        finally:
            handle.remove()
        raise UnsupportedModelError(
            f"model type '{_model_type(self.model)}': {type(self.parts.body).__name__}.forward returned without "
            f"calling its first decoder layer"
        )

    def _setup_embed(self, mtype: str) -> None:
        """Decide, once, how `embed` follows the model's own code: the plain composition of public modules when it
        equals, bit for bit, what the body's forward hands to layer 0 on a probe; the body's forward otherwise."""
        params = inspect.signature(self.parts.body.forward).parameters
        self._embed_takes_positions = "position_ids" in params
        self._embed_takes_use_cache = "use_cache" in params
        self.embeds_by_model = False
        weight = getattr(self.parts.embed_tokens, "weight", None)
        device = weight.device if isinstance(weight, torch.Tensor) else self.device
        rows = min(self.vocab_size, weight.shape[0]) if isinstance(weight, torch.Tensor) else self.vocab_size
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, rows, (2, 5), generator=g).to(device)
        pos = torch.arange(5, device=device).expand(2, 5)
        try:
            with torch.no_grad():
                own = self._model_embed(ids, pos)
                plain = self._plain_embed(ids, pos)
        except UnsupportedModelError:
            raise
        except Exception as e:
            raise UnsupportedModelError(
                f"model type '{mtype}': could not run {type(self.parts.body).__name__}.forward up to its first "
                f"decoder layer ({type(e).__name__}: {e})"
            ) from e
        self.embeds_by_model = not (own.shape == plain.shape and own.dtype == plain.dtype and torch.equal(own, plain))

    @property
    def final_norm(self) -> nn.Module:
        return self.parts.final_norm

    def project(self, normed: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Normed hidden `[.., H]` -> logits `[.., V]` (or `[.., len(vocab)]` over the token ids in `vocab`).

        The full projection is the model's own forward from its body's output on (`_model_head`): lm_head and
        whatever the forward does around it. Over a vocabulary subset (exit heads, which are proposals) the same
        forward runs with lm_head narrowed to the rows of `vocab` when the construction-time probe found the
        forward's post-lm_head code elementwise (scaling, capping: `logits_elementwise`); otherwise the full logits
        are computed and gathered. When the probe found the forward to be lm_head alone (its input is the given
        hidden states and its output lm_head's, bit for bit: most families), the subset product is taken directly.
        Either way `project(x, vocab) == project(x)[..., vocab]` up to rounding; exit heads only propose, so none of
        this bears on losslessness, but it keeps drafts as close to the model as the full path.
        """
        p = self.parts
        if p.project_out is not None:
            normed = p.project_out(normed)
        if vocab is None:
            return self._model_head(normed, p.lm_head)
        if not self.logits_elementwise:
            return self._model_head(normed, p.lm_head).index_select(-1, vocab)
        weight, bias, rows = self._vocab_rows(vocab, product=True)
        if self._head_is_plain:  # the forward is lm_head and nothing else: skip its Python (~20 us a call)
            return nn.functional.linear(normed, weight, bias) if rows is None else rows(normed)
        rows = self._rows_stand_in
        object.__setattr__(rows, "weight", weight)
        object.__setattr__(rows, "bias", bias)
        try:
            return self._model_head(normed, rows)
        finally:
            object.__setattr__(rows, "weight", None)
            object.__setattr__(rows, "bias", None)

    def _model_head(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """Logits from the model's own `forward`, given the output of its decoder body.

        `hidden` `[.., H']` is what the body would return as `last_hidden_state` (after its final norm and
        `project_out`); `head` is the lm_head to use (the model's own, a copy of it, or a row subset). For the
        duration of one `model.forward()` call the body slot (`_body_slot`) holds a stand-in returning `hidden`
        and, unless `head` is already there, the lm_head slot holds `head`; both are put back before returning.
        `forward` is called directly, not through `model(...)`: hooks observing the model's calls (benchmark pass
        counters) see no extra pass.

        Why the model's code at every call rather than a transform derived once: it is exact by construction, for
        any family, and it is cheap. Its cost is the forward's Python, about 20 us a call on CPU (transformers 5.x,
        one thread; mostly building the CausalLMOutputWithPast), against 6.5-13 ms for a SmolLM2-sized lm_head
        (49152 x 576, fp32, T = 1..8): 0.2-0.3%. A vocabulary subset through a transforming forward pays the same
        20 us against a cheaper product (8k rows: 0.35-1.5 ms, so 1.5-6%); through a plain forward it pays nothing.
        """
        lead = hidden.shape[:-1]
        x = hidden.reshape(1, -1, hidden.shape[-1])
        body_parent, body_name = self._body_slot
        stand = self._body_stand_in
        swap_head = head is not self._model_lm_head
        if swap_head and self._head_slot is None:
            raise UnsupportedModelError(
                f"model type '{_model_type(self.model)}': its lm_head is not a registered submodule, so a "
                f"substitute lm_head cannot be used"
            )
        with _SWAP_LOCK:
            real_body = body_parent._modules[body_name]
            object.__setattr__(stand, "_real", real_body)
            object.__setattr__(stand, "_owner", threading.get_ident())
            object.__setattr__(stand, "hidden", x)
            if swap_head:
                head_parent, head_name = self._head_slot
                real_head = head_parent._modules[head_name]
                if isinstance(head, _StandIn):
                    object.__setattr__(head, "_real", real_head)
                    object.__setattr__(head, "_owner", threading.get_ident())
            try:
                body_parent._modules[body_name] = stand
                if swap_head:
                    head_parent._modules[head_name] = head
                out = self.model.forward()
            finally:
                body_parent._modules[body_name] = real_body
                if swap_head:
                    head_parent._modules[head_name] = real_head
                object.__setattr__(stand, "hidden", None)
                object.__setattr__(stand, "_real", None)
                if stand._out is not None:
                    stand._out["last_hidden_state"] = None  # hold no reference to the caller's tensor
        logits = out.logits if hasattr(out, "logits") else out[0]
        return logits.reshape(*lead, logits.shape[-1])

    def _setup_logit_path(self, mtype: str) -> None:
        """Find, once, how to run the model's own forward from its body's output on, and whether its
        post-lm_head code is elementwise (so a vocabulary subset can go through it too).

        The stand-in for the body goes into the deepest module on the path from the model to the layer list that
        the forward actually calls (the body itself for most families; OPT's forward calls `model.decoder`, a
        multimodal wrapper may call an ancestor). The elementwise probe hands the forward fixed logits `Z` in
        place of lm_head's output, then `Z[..., ids]` for a permutation and a short subset with repeats: the code
        is elementwise iff the second outputs are the first's columns `ids` (to a few ulps)."""
        lm_head = self.parts.lm_head
        self._model_lm_head = lm_head
        self._head_slot = _slot_of(self.model, lm_head)
        self._body_stand_in = _GivenHidden()
        self._rows_stand_in = _Rows()
        body_path = next(n for n, m in self.model.named_modules(remove_duplicate=False) if m is self.parts.body)
        parts_of_path = body_path.split(".") if body_path else []
        slots = []
        for depth in range(len(parts_of_path), 0, -1):
            parent = self.model.get_submodule(".".join(parts_of_path[: depth - 1]))
            slots.append((parent, parts_of_path[depth - 1]))
        w = lm_head.weight
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1, 3, w.shape[1], generator=g).to(w.device, w.dtype)
        errors = []
        self._body_slot = None
        for slot in slots:
            self._body_slot = slot
            object.__setattr__(self._body_stand_in, "calls", 0)
            try:
                with torch.no_grad():
                    logits = self._model_head(x, lm_head)
            except Exception as e:
                errors.append(f"{type(slot[0]._modules[slot[1]]).__name__}: {type(e).__name__}: {e}")
                continue
            if self._body_stand_in.calls == 1 and tuple(logits.shape[:-1]) == (1, 3):
                break
            errors.append(f"{type(slot[0]._modules[slot[1]]).__name__}: forward did not use its output once")
        else:
            self._body_slot = None
            raise UnsupportedModelError(
                f"model type '{mtype}': could not run {type(self.model).__name__}.forward on given final hidden "
                f"states ({'; '.join(errors) or 'the decoder layers are not inside a submodule'})"
            )
        self._head_is_plain = False
        self.logits_elementwise = self._head_slot is not None and self._probe_elementwise(x, w.shape[0])

    def _probe_elementwise(self, x: torch.Tensor, rows: int) -> bool:
        g = torch.Generator().manual_seed(1)
        z = (torch.randn(1, 3, rows, generator=g) * 8).to(x.device, x.dtype)
        fixed = _Fixed()
        subsets = [torch.randperm(rows, generator=g), torch.randint(0, rows, (min(rows, 7),), generator=g)]
        try:
            with torch.no_grad():
                object.__setattr__(fixed, "logits", z)
                full = self._model_head(x, fixed)
                if fixed.calls != 1 or full.shape != (1, 3, rows):
                    return False
                seen = fixed.seen
                plain = (isinstance(seen, torch.Tensor) and seen.shape == x.shape and seen.dtype == x.dtype
                         and torch.equal(seen, x) and full.dtype == z.dtype and torch.equal(full, z))
                for ids in subsets:
                    object.__setattr__(fixed, "logits", z[..., ids.to(z.device)])
                    sub = self._model_head(x, fixed)
                    ref = full[..., ids.to(full.device)]
                    if sub.shape != ref.shape or not bool(torch.isfinite(ref).all()):
                        return False
                    eps = torch.finfo(ref.dtype).eps if ref.dtype.is_floating_point else 0.0
                    tol = 4 * eps * (1.0 + float(ref.abs().max()))
                    if not torch.allclose(sub.float(), ref.float(), rtol=4 * eps, atol=tol):
                        return False
        except Exception:
            return False
        self._head_is_plain = plain
        return True

    def _vocab_rows(self, vocab: torch.Tensor, product: bool = False):
        """The lm_head rows (and bias) of `vocab`; copies of a frozen lm_head are cached (a reduced-vocabulary head
        projects every decoding step, and gathering 8k x H rows each time costs as much as the product). With
        `product`, a third item: a `hispec.packed.PackedLinear` over those rows when the model's lm_head is packed
        (made once per cached copy), else None."""
        w = self.parts.lm_head.weight
        b = getattr(self.parts.lm_head, "bias", None)
        if w.requires_grad:
            rows = (w.index_select(0, vocab), None if b is None else b.index_select(0, vocab))
            return (*rows, None) if product else rows
        key = (vocab.data_ptr(), vocab.numel(), vocab._version, str(vocab.device), w.data_ptr(), w.dtype, w._version)
        cache = self.__dict__.setdefault("_vocab_rows_cache", {})
        hit = cache.get(key)
        if hit is None:
            with torch.no_grad():
                hit = [w.index_select(0, vocab), None if b is None else b.index_select(0, vocab), None]
            if len(cache) >= 4:
                cache.pop(next(iter(cache)))
            cache[key] = hit
        if not product:
            return hit[0], hit[1]
        if hit[2] is None and isinstance(self.parts.lm_head, packed.PackedLinear):
            hit[2] = packed.rows_of(hit[0], hit[1])
        return tuple(hit)

    def refresh_modules(self) -> None:
        """Find the model's parts again after its modules were replaced in place (`hispec.packed.apply` swaps every
        nn.Linear, lm_head included); the construction-time probes still hold (the same computation)."""
        self.parts = _find_parts(self.model, self.num_layers)
        self._model_lm_head = self.parts.lm_head
        self._head_slot = _slot_of(self.model, self.parts.lm_head)
        self.__dict__.pop("_vocab_rows_cache", None)

    def final_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden after the last layer `[.., H]` -> the model's own logits `[.., V]`."""
        return self.project(self.parts.final_norm(hidden))

    # ------------------------------------------------------------------ layers
    def new_cache(self, batch_size: int, extra: int = 0) -> KVCache:
        """A cache for the model's layers plus `extra` layers of exit heads (indices num_layers, ...)."""
        return KVCache(self.num_layers + extra, batch_size, device=self.device)

    def _masks(self, kv_valid, kv_pos, q_pos, types: set[str], dtype, allow=None) -> dict[str, torch.Tensor | None]:
        # kv_valid, kv_pos: [B, K]; q_pos: [B, T]; the T queries are the last T slots. `allow` ([B or 1, T, K]
        # bool, optional) is ANDed in: a tree pass's ancestry (siblings share a position, so (valid, position)
        # alone cannot keep a node from seeing its siblings and their descendants).
        T, K = q_pos.shape[1], kv_pos.shape[1]
        allowed = kv_valid[:, None, :] & (kv_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, K]
        if allow is not None:
            if allow.shape[-2:] != (T, K):
                raise ValueError(f"allow mask {tuple(allow.shape)} does not match {T} queries over {K} slots")
            allowed = allowed & allow.to(allowed.device)
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

    def _prepare(self, hidden, position_ids, valid, cache, slot_layer: int, types: set[str], allow=None):
        if valid is None:
            valid = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
        old_valid, old_pos = cache.slot_meta(slot_layer)
        kv_valid = torch.cat([old_valid, valid], 1)
        kv_pos = torch.cat([old_pos, position_ids], 1)
        masks = self._masks(kv_valid, kv_pos, position_ids, types, hidden.dtype, allow)
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
        allow: torch.Tensor | None = None,
        capture: dict | None = None,
    ) -> torch.Tensor:
        """Run decoder layers `[start, end)` over `hidden` `[B, T, H]`, appending T slots to their cache.

        `position_ids` `[B, T]` are absolute; `valid` `[B, T]` (default all True) marks real tokens — invalid
        ones (padding, or a row with fewer new tokens) are written as masked slots and their outputs are junk.
        `allow` `[B or 1, T, S + T]` (S: the slots already cached) further restricts what each query may attend
        to (tree drafts: a node sees only its ancestors among the tree's slots). `capture`: a dict whose keys are
        layer ids i in [start, end]; each gets the residual stream after i layers (an EAGLE-3 drafter's aux
        states), at no extra cost.
        """
        if not 0 <= start < end <= self.num_layers:
            raise ValueError(f"layer range [{start}, {end}) is out of range for a {self.num_layers}-layer model")
        cache.seq_length(start, end)
        if hasattr(cache, "begin_pass"):  # a paged cache (hispec.serve.paged) computes its block indices per pass
            cache.begin_pass(start, end, position_ids, valid)
        types = set(self.layer_types[start:end])
        kv_valid, kv_pos, masks, rotary = self._prepare(hidden, position_ids, valid, cache, start, types, allow)
        fast = self.standard
        if fast is not None and fast.global_hooks():
            fast = None
        for i in range(start, end):
            if capture is not None and i in capture:
                capture[i] = hidden
            t = self.layer_types[i]
            layer = self.parts.layers[i]
            if fast is not None and not (layer._forward_hooks or layer._forward_pre_hooks):  # hooks: the layer's call
                hidden = fast.run(i, hidden, position_ids, cache, masks[t], rotary.get(t))
            else:
                hidden = self._call_layer(layer, t, hidden, position_ids, cache, masks, rotary)
        if capture is not None and end in capture:
            capture[end] = hidden
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
        allow: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run one extra decoder layer (a `layer` exit head: a copy of a base layer whose attention writes to
        cache layer `cache_index`, beyond the model's own) exactly as `run_layers` runs the model's layers."""
        if layer_type not in _LAYER_TYPES:
            raise ValueError(f"unknown layer type {layer_type!r}")
        if not self.num_layers <= cache_index < cache.num_layers:
            raise ValueError(f"cache index {cache_index} is not an extra slot of this cache ({cache.num_layers} layers)")
        if hasattr(cache, "begin_pass"):
            cache.begin_pass(cache_index, cache_index + 1, position_ids, valid)
        kv_valid, kv_pos, masks, rotary = self._prepare(hidden, position_ids, valid, cache, cache_index, {layer_type},
                                                        allow)
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
