"""Pack a train/heads.py output folder as a shippable artifact (`recipes/artifacts/<model>/`).

An artifact is a `hispec-export` input folder whose plain export (`hispec-export ARTIFACT --base MODEL --output-dir
OUT`, no other flags) reproduces the fastest measured configuration. So this writes into it what export would
otherwise take from flags: the output vocabularies (as integer ids inside the heads file), the decoding defaults
(gamma, window) and the heads' storage dtype (bf16 halves a shipped artifact). Everything else of the run folder
(metrics.json, a README, plots) is copied; training checkpoints and caches are not. Packing a new run over an
existing artifact keeps the artifact's own files the run does not bring (its benchmark reports and plots, which
the README cites; a file of the same name comes from the run), and says which. The write is atomic, so packing in
place (RUN == OUT) keeps its other files and never leaves a half-written folder.

It reuses export's own loading (`build_model`: base + heads, checked against each other) and vocabulary choice
(`apply_options` / `restrict_vocab`: the run's self-distilled answers, `--vocab-data` files, else token-id order), so the packed
heads are exactly what that export would have produced.

    python tools/pack_artifact.py runs/my-run recipes/artifacts/my-model --gamma 1 --window 2 --heads-dtype bf16
    python tools/pack_artifact.py runs/qwen2.5-coder-1.5b-eagle3 recipes/artifacts/qwen2.5-coder-1.5b-instruct/eagle3 \
        --drafter-storage int8       # an EAGLE-3 drafter run (hispec_drafter.*): its weights as per-row int8
    python tools/pack_artifact.py runs/my-drafter-run recipes/artifacts/smollm2-135m/eagle3 --drafter-dtype bf16
    python tools/pack_artifact.py recipes/artifacts/smollm2-135m recipes/artifacts/smollm2-135m \\
        --draft-vocab-size 8192 --verify-vocab-size 8192 --gamma 2 --window 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from hispec.export import (HEADS_FILE, TRAIN_FILE, ExportError, apply_options, build_model,  # noqa: E402
                           check_options, read_train_output)
from hispec.io import atomic_dir, dtype_name, parse_dtype, read_json, write_json  # noqa: E402


def _copy_files(run_dir: Path, out_dir: Path, tmp: Path, skip: tuple) -> list:
    """Into the new artifact `tmp`: the existing artifact's files the run does not have (when OUT is not the run),
    then every file of the run; `skip` (the rewritten pair) from neither. -> the names kept from the old artifact."""
    run_names = {f.name for f in run_dir.iterdir() if f.is_file()}
    kept = []
    if out_dir.is_dir() and out_dir != run_dir:
        for f in sorted(out_dir.iterdir()):
            if f.is_file() and f.name not in skip and f.name not in run_names:
                shutil.copy2(f, tmp / f.name)
                kept.append(f.name)
    for f in run_dir.iterdir():  # keep README, metrics, plots; skip checkpoints, caches, the rewritten pair
        if f.is_file() and f.name not in skip:
            shutil.copy2(f, tmp / f.name)
    return kept


def _say_kept(kept: list, out_dir: Path) -> None:
    if kept:
        print(f"pack_artifact: kept {len(kept)} file(s) of the existing {out_dir} the run does not have: "
              f"{', '.join(kept)}", file=sys.stderr)


def pack(run_dir, out_dir, *, base=None, draft_vocab_size=None, verify_vocab_size=None, vocab_data=(),
         gamma=None, window=None, heads_dtype=None) -> dict:
    """Write the artifact; returns its hispec section (exits, vocabularies, decoding)."""
    check_options(gamma=gamma, window=window)
    run_dir, out_dir = Path(run_dir).absolute(), Path(out_dir).absolute()
    run = read_train_output(run_dir)
    train = read_json(run_dir / TRAIN_FILE)
    dtype = parse_dtype(heads_dtype or train.get("heads_dtype") or "fp32")
    model = build_model(run, base, dtype=dtype)
    apply_options(model, run, gamma=gamma, window=window, draft_vocab_size=draft_vocab_size,
                  verify_vocab_size=verify_vocab_size, vocab_data=list(vocab_data))
    # the run's base identity as recorded (e.g. ~/.cache/... so the artifact works on any machine), not the
    # absolute path this machine resolved it to
    hispec = {**model.hispec_config.to_dict(), "base": run.hispec.get("base", model.hispec_config.base)}
    train["hispec"] = hispec
    train["heads_dtype"] = dtype_name(model.dtype)
    state = model.heads_state_dict()
    with atomic_dir(out_dir, overwrite=True) as tmp:
        tmp = Path(tmp)
        kept = _copy_files(run_dir, out_dir, tmp, (HEADS_FILE, TRAIN_FILE))
        save_file(state, str(tmp / HEADS_FILE), metadata={"format": "pt", "hispec": "1"})
        write_json(tmp / TRAIN_FILE, train)
        tmp.chmod(0o755)  # a temporary folder is private; a shipped one is not
        for f in tmp.iterdir():
            f.chmod(0o644)
    _say_kept(kept, out_dir)
    return hispec


def pack_drafter(run_dir, out_dir, *, storage: str = "float", dtype: str | None = None) -> dict:
    """An EAGLE-3 drafter run (`hispec_drafter.*`, `hispec.drafters.eagle3`) as an artifact: the drafter rewritten with
    `storage` ("int8": per-row int8 weights, `hispec.drafters.eagle3.quantize_int8`, a quarter of fp32 and loaded back as
    floats) and, for float storage, in `dtype` ("bf16": half of fp32; None: as the run stored it), every other file
    of the run folder copied (not checkpoints); atomic like `pack`. -> its json."""
    from hispec.drafters.eagle3 import DRAFTER_CONFIG, DRAFTER_FILE, load_drafter, save_drafter
    from hispec.io import parse_dtype

    run_dir, out_dir = Path(run_dir).absolute(), Path(out_dir).absolute()
    drafter, meta = load_drafter(run_dir, dtype=parse_dtype(dtype) if dtype else None)
    extra = {k: v for k, v in meta.items() if k not in ("format", "version", "config", "base", "storage")}
    with atomic_dir(out_dir, overwrite=True) as tmp:
        tmp = Path(tmp)
        kept = _copy_files(run_dir, out_dir, tmp, (DRAFTER_FILE, DRAFTER_CONFIG))
        save_drafter(drafter, tmp, base=meta.get("base", {}), extra=extra, storage=storage)
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
    _say_kept(kept, out_dir)
    return read_json(out_dir / DRAFTER_CONFIG)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="train/heads.py output folder (or an artifact to repack)")
    p.add_argument("output", help="artifact folder to write (may be the same folder)")
    p.add_argument("--base", help="base model (default: the one the run recorded)")
    p.add_argument("--draft-vocab-size", type=int, help="draft head's output vocabulary (0 = full)")
    p.add_argument("--verify-vocab-size", type=int, help="verifier head's output vocabulary (0 = full)")
    p.add_argument("--vocab-data", nargs="*", default=[], help="files to count tokens on (default: the run's "
                   "self-distilled answers, else token-id order)")
    p.add_argument("--gamma", type=int, help="decoding default: drafts per round")
    p.add_argument("--window", type=int, help="decoding default: tokens before full verification")
    p.add_argument("--heads-dtype", help="store the heads as fp32 or bf16 (default: as the run stored them)")
    p.add_argument("--drafter-storage", choices=["float", "int8"], default="float",
                   help="an EAGLE-3 drafter run: store its weights as floats (default) or per-row int8")
    p.add_argument("--drafter-dtype", choices=["fp32", "bf16"],
                   help="an EAGLE-3 drafter run, float storage: the weights' dtype (default: as the run stored them)")
    args = p.parse_args(argv)
    from hispec.drafters.eagle3 import is_drafter_run

    if is_drafter_run(args.run):
        heads_only = {"--base": args.base, "--draft-vocab-size": args.draft_vocab_size, "--gamma": args.gamma,
                      "--verify-vocab-size": args.verify_vocab_size, "--vocab-data": args.vocab_data or None,
                      "--window": args.window, "--heads-dtype": args.heads_dtype}
        given = [k for k, v in heads_only.items() if v is not None]
        if given:
            print(f"pack_artifact: error: {', '.join(given)} apply to exit-head runs; {args.run} is an EAGLE-3 "
                  "drafter run (only --drafter-storage / --drafter-dtype apply)", file=sys.stderr)
            return 2
        if args.drafter_dtype and args.drafter_storage == "int8":
            print("pack_artifact: error: --drafter-dtype applies to float storage, not int8", file=sys.stderr)
            return 2
        try:
            meta = pack_drafter(args.run, args.output, storage=args.drafter_storage, dtype=args.drafter_dtype)
        except (OSError, ValueError) as e:
            print(f"pack_artifact: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps({"output": str(Path(args.output).absolute()), "drafter": meta["config"]["aux_layers"],
                          "storage": meta.get("storage", "float")}))
        return 0
    try:
        h = pack(args.run, args.output, base=args.base, draft_vocab_size=args.draft_vocab_size,
                 verify_vocab_size=args.verify_vocab_size, vocab_data=args.vocab_data, gamma=args.gamma,
                 window=args.window, heads_dtype=args.heads_dtype)
    except (ExportError, OSError, ValueError) as e:
        print(f"pack_artifact: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"output": str(Path(args.output).absolute()), "exits": h.get("exits"),
                      "decoding": h.get("decoding")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
