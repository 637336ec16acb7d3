"""Load a GGUF checkpoint as a plain, saveable Hugging Face model.

Contract
--------
``load_gguf_model(path, dtype=None, device=None)`` takes the path of one ``.gguf`` file and returns an ordinary
``transformers.PreTrainedModel`` in eval mode:

* the weights are dequantised by transformers (``from_pretrained(dir, gguf_file=name)``, always fp32), then
  handed with a strict ``load_state_dict(..., assign=True)`` to a FRESH model built from the same config with
  ``quantization_config`` removed (its parameters created empty, on the meta device, so the weights exist once
  in memory: ~4 bytes per parameter at the peak, not 8, and no random initialisation). The result has no trace
  of GGUF: ``save_pretrained`` works (it refuses a GGUF-loaded model) and the saved folder loads with stock
  ``AutoModelForCausalLM``;
* tied embeddings stay tied (``lm_head.weight`` is ``embed_tokens.weight``) when the config says so;
* the generation config read from the GGUF metadata (bos/eos/pad ids) is kept; normalisation epsilons stored as
  f32 in the file are given back their short decimal value (``9.9999997e-06`` -> ``1e-05``);
* ``dtype`` (a ``torch.dtype`` or its name, e.g. ``"bfloat16"``; default fp32) and ``device`` (default CPU)
  are applied last. The dtype goes to the parameters and persistent buffers only (``cast_parameters``):
  buffers computed at construction (rotary ``inv_freq``) keep their fp32 values, as in a model that
  ``from_pretrained(..., dtype=...)`` loads; ``model.to(torch.bfloat16)`` would round them and shift every
  position's rotation (logits off by ~2 on a 1.5B Qwen2).

``load_gguf_tokenizer(path)`` returns the tokenizer stored in the same file (chat template included when the
file has one).

Errors: ``FileNotFoundError`` when the file does not exist, ``ValueError`` when the path is not a ``.gguf``
file, ``ImportError`` naming ``pip install 'hispec[gguf]'`` when the ``gguf`` package is missing.

Importing this module has no side effects and does not import the ``gguf`` package; transformers and torch are
imported lazily, on the first call.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["cast_parameters", "load_gguf_model", "load_gguf_tokenizer"]

_INSTALL_HINT = "pip install 'hispec[gguf]'"


def _check_gguf_file(path: str | os.PathLike) -> tuple[str, str]:
    """Validate ``path`` and the ``gguf`` dependency; return (directory, file name)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not os.path.isfile(path) or not path.lower().endswith(".gguf"):
        raise ValueError(f"expected the path of a .gguf file, got: {path}")
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as exc:
        raise ImportError(
            f"loading a GGUF file needs the 'gguf' package, which is not installed; run: {_INSTALL_HINT}"
        ) from exc
    return os.path.dirname(path), os.path.basename(path)


def _resolve_dtype(dtype: Any) -> "torch.dtype":
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(resolved, torch.dtype):
            return resolved
    raise ValueError(f"unknown dtype: {dtype!r}")


def _unround_f32_fields(config) -> None:
    """GGUF stores float hyper-parameters as f32 (1e-5 reads back as 9.9999997e-06): restore the short decimal."""
    import numpy as np

    for key, value in vars(config).items():
        if key.endswith("_eps") and isinstance(value, float):
            setattr(config, key, float(repr(np.float32(value)).removeprefix("np.float32(").removesuffix(")")))


def _param_name(model, param) -> str | None:
    return next((k for k, p in model.named_parameters(remove_duplicate=False) if p is param), None)


def cast_parameters(model: "torch.nn.Module", dtype) -> "torch.nn.Module":
    """Cast ``model``'s floating parameters and persistent floating buffers to ``dtype`` in place (one tensor at
    a time: no second full copy) and return it. Non-persistent buffers (rotary ``inv_freq`` tables, computed in
    fp32 at construction and absent from checkpoints) are left alone, unlike ``model.to(dtype)``, so the result
    computes what ``from_pretrained(saved_folder, dtype=dtype)`` computes."""
    dtype = _resolve_dtype(dtype)
    for param in model.parameters():  # tied parameters come once
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if (buf is not None and buf.is_floating_point() and buf.dtype != dtype
                    and name not in module._non_persistent_buffers_set):
                module._buffers[name] = buf.to(dtype)
    return model


def load_gguf_model(path: str | os.PathLike, dtype=None, device=None) -> "PreTrainedModel":
    """Load the ``.gguf`` file at ``path`` into a fresh, saveable HF causal LM (see the module docstring)."""
    directory, name = _check_gguf_file(path)
    import torch
    from transformers import AutoModelForCausalLM

    target_dtype = _resolve_dtype(dtype)
    gguf_model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)

    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    _unround_f32_fields(config)
    from accelerate import init_empty_weights  # transformers needs accelerate to read GGUF anyway

    with init_empty_weights(include_buffers=False):  # parameters on "meta"; buffers (rotary tables) are real
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    state = gguf_model.state_dict()
    expected = set(model.state_dict())
    tied = bool(getattr(config, "tie_word_embeddings", False))
    out_emb = model.get_output_embeddings()
    if tied and out_emb is not None:
        # With tied embeddings the output weight IS the input embedding; add its name if the GGUF side lacks it.
        out_key = _param_name(model, out_emb.weight)
        if out_key is not None and out_key not in state:
            state[out_key] = gguf_model.get_input_embeddings().weight
    missing = expected - set(state)
    unexpected = set(state) - expected
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not fit a fresh {type(model).__name__}: "
                           f"missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    model.load_state_dict(state, strict=True, assign=True)  # take the dequantised tensors, no copy
    if tied:
        model.tie_weights()
        if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
            raise RuntimeError("tie_word_embeddings is set but lm_head and embeddings are not tied")
    left_empty = [k for k, t in model.state_dict().items() if t.is_meta]
    if left_empty:
        raise RuntimeError(f"GGUF weights left {left_empty} of {type(model).__name__} unset")
    if gguf_model.generation_config is not None:
        model.generation_config = copy.deepcopy(gguf_model.generation_config)
    del gguf_model, state

    cast_parameters(model, target_dtype)
    if device is not None:
        model = model.to(device)
    return model.eval()


def load_gguf_tokenizer(path: str | os.PathLike) -> "PreTrainedTokenizerBase":
    """The tokenizer stored in the ``.gguf`` file at ``path`` (chat template included when present)."""
    directory, name = _check_gguf_file(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, gguf_file=name)
