"""hispec-export: a training run's output -> an early-exit checkpoint folder (+ model card), optionally on the Hub.

    hispec-export runs/smollm2 --output-dir exports/smollm2-hispec
    hispec-export runs/smollm2 --output-dir exports/smollm2-hispec --push-to-hub me/SmolLM2-135M-hispec --private
    hispec-export runs/smollm2 --output-dir exports/smollm2-hispec --calibrate --calibration-num-prompts 8
    hispec-export runs/smollm2-eagle3 --format speculators --output-dir exports/smollm2-eagle3

`--format speculators` writes an EAGLE-3 drafter run (train/heads.py --head_type eagle3) as a `speculators` folder
that vLLM and SGLang serve as it is (hispec.export.speculators; needs `pip install 'hispec[speculators]'`).

The folder is written atomically (temporary sibling, one rename); an existing one is refused unless --overwrite.
With --calibrate the finished checkpoint is loaded and the latency model calibrated on this machine (hispec.latency:
timed unit costs, acceptance rates on the model's own greedy answers to the prompts); the calibration goes into
config.json, the model card states the predicted speeds, and a table of predictions is printed.
The push happens after the local export; if it fails, the command exits non-zero and the local folder stays.
Progress goes to stderr; stdout ends with one JSON line describing the result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

SPEC_BENCH = Path("eval") / "spec_bench_question.jsonl"


def default_calibration_prompts() -> Path | None:
    """Spec-Bench questions: $HISPEC_DATA_DIR/eval/, else the repository's data/eval/ (a source checkout)."""
    roots = [os.environ.get("HISPEC_DATA_DIR"), Path(__file__).resolve().parents[2] / "data"]
    for root in roots:
        if root and (Path(root) / SPEC_BENCH).is_file():
            return Path(root) / SPEC_BENCH
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hispec-export",
        description="Merge a frozen base model and trained exit heads into one hispec checkpoint folder "
        "(stock AutoModelForCausalLM still loads it as the base), write a model card, optionally push it to the Hub.",
    )
    p.add_argument("train_output_dir", metavar="TRAIN_OUTPUT_DIR",
                   help="output folder of train/heads.py (hispec_train.json, hispec_heads.safetensors, metrics.json)")
    p.add_argument("--output-dir", required=True, help="checkpoint folder to write (must not exist, see --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output-dir (atomically)")
    p.add_argument("--format", choices=("hispec", "speculators"), default="hispec",
                   help="hispec: base + exit heads in one checkpoint (default); speculators: an EAGLE-3 drafter run "
                        "as a speculators folder for vLLM / SGLang (--base names the verifier it records)")
    p.add_argument("--drafter", default=None, metavar="DRAFTER_RUN",
                   help="also put an EAGLE-3 drafter run (train/heads.py --head_type eagle3, same base) into the "
                        "checkpoint: it then decodes with strategy eagle / eagle-lookup too")
    p.add_argument("--speculative-tokens", type=int, default=3, metavar="N",
                   help="with --format speculators: drafts per round recorded in its proposal config (default 3)")
    p.add_argument("--base", default=None,
                   help="base model to use instead of the one the run recorded: a local folder, a Hub id or a .gguf "
                   "file; it must match the heads (depth, hidden size, vocabulary, architecture)")
    p.add_argument("--base-revision", default=None,
                   help="Hub revision of the base (default: the one the run recorded, unless --base is given)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="dtype of the exported weights (auto: as stored by the base)")
    p.add_argument("--heads-only", action="store_true",
                   help="write only the heads, tokenizer and a config referencing the base by name and revision")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest base-weight shard, e.g. 5GB or 500MB; larger bases get an index file (default 5GB)")
    p.add_argument("--base-model-id", default=None,
                   help="Hub id for the card's base_model (default: the recorded base name when it is a Hub id)")
    p.add_argument("--license", default=None, help="licence for the model card (default: the base model's, if known)")
    p.add_argument("--draft-vocab-size", type=int, default=None, metavar="K",
                   help="restrict the draft head to the K most frequent tokens (e.g. 8192; 0 = full vocabulary): "
                        "a much cheaper projection, output unchanged")
    p.add_argument("--verify-vocab-size", type=int, default=None, metavar="K",
                   help="the same for the intermediate verifier's head")
    p.add_argument("--vocab-data", nargs="+", default=[], metavar="FILE",
                   help="text/json/jsonl files to count token frequencies on (default: the run's self-distilled "
                        "answers if it kept them, else token id order)")
    p.add_argument("--gamma", type=int, default=None,
                   help="decoding default: drafts per round (default: the run's; choose with hispec-bench --sweep)")
    p.add_argument("--window", type=int, default=None,
                   help="decoding default: tokens gathered before full verification (default: the run's)")
    p.add_argument("--verification", choices=("token", "hsd"), default=None,
                   help="decoding default: acceptance rule when sampling, token or hsd (sequence-level; "
                        "hispec.sampling.hsd_accept) (default: the run's, i.e. token)")
    cal = p.add_argument_group("latency calibration (hispec.latency; stored in config.json, stated on the model card)")
    cal.add_argument("--calibrate", action="store_true",
                     help="after exporting, time the model on this machine and count how often its exits agree with "
                          "it on the model's own greedy answers, store the calibration and print predicted speeds")
    cal.add_argument("--calibration-prompts", default=None, metavar="FILE",
                     help="prompt file (Spec-Bench/MT-Bench question.jsonl, jsonl/json with 'prompt', or text lines; "
                          "default: data/eval/spec_bench_question.jsonl of a source checkout or $HISPEC_DATA_DIR)")
    cal.add_argument("--calibration-num-prompts", type=int, default=8, metavar="N",
                     help="prompts to calibrate on, spread over categories (default 8)")
    cal.add_argument("--calibration-max-new-tokens", type=int, default=64, metavar="N",
                     help="greedy answer length per prompt, in tokens (default 64)")
    cal.add_argument("--calibration-max-seconds", type=float, default=300.0, metavar="S",
                     help="time budget of the calibration: past it, fewer prompts, repeats and decoder runs are "
                          "measured (stated in the calibration) rather than the calibration running on; 0 = no "
                          "limit (default 300)")
    cal.add_argument("--calibration-dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                     help="dtype to calibrate in, the one you will decode in (auto: as the checkpoint is stored); "
                          "a calibration only applies to its own dtype and machine type")
    hub = p.add_argument_group("Hugging Face Hub (token from $HF_TOKEN or `hf auth login`)")
    hub.add_argument("--push-to-hub", metavar="REPO_ID", default=None,
                     help="after the local export, upload the folder to this model repo (created if missing)")
    hub.add_argument("--private", action="store_true", help="create the repo as private")
    hub.add_argument("--revision", default=None, help="branch to push to (created from main if missing)")
    hub.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing directly")
    hub.add_argument("--commit-message", default=None, help="commit (or pull request) title")
    hub.add_argument("--dry-run", action="store_true",
                     help="export locally, then list what --push-to-hub would upload, without contacting the Hub")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.push_to_hub:
        used = [f for f, v in (("--private", args.private), ("--revision", args.revision),
                               ("--create-pr", args.create_pr), ("--commit-message", args.commit_message),
                               ("--dry-run", args.dry_run)) if v]
        if used:
            parser.error(f"{', '.join(used)} only make sense with --push-to-hub REPO_ID")

    from ..export import checkpoint as ex  # heavy imports (torch, transformers) only once arguments are valid
    from ..drafters.eagle3 import is_drafter_run
    from ..model import CheckpointError

    def fail(msg: str) -> int:
        print(f"hispec-export: error: {msg}", file=sys.stderr)
        return 1

    if args.push_to_hub and not args.dry_run and ex.hub_token() is None:
        return fail("--push-to-hub needs a Hugging Face token: set $HF_TOKEN or run `hf auth login` "
                    "(nothing was exported)")
    if args.format == "speculators":
        return _export_speculators(args, parser, ex, fail)
    if is_drafter_run(args.train_output_dir):
        return fail(f"{args.train_output_dir} holds an EAGLE-3 drafter, not exit heads: export it with --format "
                    "speculators (vLLM / SGLang serve that folder)")
    prompts = None
    if args.calibrate:
        from ..prompts import load_prompts

        if args.calibration_num_prompts < 1 or args.calibration_max_new_tokens < 2:
            return fail("--calibration-num-prompts must be >= 1 and --calibration-max-new-tokens >= 2")
        if args.calibration_max_seconds < 0:
            return fail("--calibration-max-seconds must be >= 0 (0 = no limit)")
        source = args.calibration_prompts or default_calibration_prompts()
        if source is None:
            return fail("--calibrate needs prompts: no data/eval/spec_bench_question.jsonl here (or in "
                        "$HISPEC_DATA_DIR); pass --calibration-prompts FILE (nothing was exported)")
        try:
            prompts = load_prompts(source, num=args.calibration_num_prompts)
        except (OSError, ValueError) as e:
            return fail(f"--calibration-prompts: {e} (nothing was exported)")
    else:
        used = [f"--calibration-{f.replace('_', '-')}" for f in ("prompts", "num_prompts", "max_new_tokens", "dtype",
                                                                 "max_seconds")
                if getattr(args, f"calibration_{f}") != parser.get_default(f"calibration_{f}")]
        if used:
            parser.error(f"{', '.join(used)} only make sense with --calibrate")
    try:
        result = ex.export(
            args.train_output_dir, args.output_dir, base=args.base, base_revision=args.base_revision,
            dtype=None if args.dtype == "auto" else args.dtype, heads_only=args.heads_only,
            overwrite=args.overwrite, max_shard_size=args.max_shard_size, base_model_id=args.base_model_id,
            license=args.license, name=args.push_to_hub, draft_vocab_size=args.draft_vocab_size,
            verify_vocab_size=args.verify_vocab_size, vocab_data=args.vocab_data, gamma=args.gamma,
            window=args.window, verification=args.verification, calibration_prompts=prompts,
            calibration_max_new_tokens=args.calibration_max_new_tokens,
            calibration_dtype=None if args.calibration_dtype == "auto" else args.calibration_dtype,
            calibration_max_seconds=args.calibration_max_seconds or None, progress=True,
            drafter=args.drafter,
        )
    except (CheckpointError, ex.ExportError, FileExistsError, ValueError, OSError) as e:
        return fail(str(e))
    summary = {"output_dir": str(result.output_dir), "heads_only": result.heads_only, "files": len(result.files),
               "bytes": result.total_bytes, "hub": None, "calibration": None}
    if result.calibration is not None:
        from ..latency import format_predictions

        cal = result.calibration
        print(format_predictions(cal, result.predictions))
        best = result.predictions[-1]
        summary["calibration"] = {
            "machine": cal.machine, "dtype": cal.dtype, "threads": cal.threads, "acceptance": cal.acceptance,
            "ngram_match": cal.ngram_match, "measured_tokens_per_second": cal.measured, "budget": cal.budget,
            "predictions": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}
                            for r in result.predictions],
            "best": {"levels": best["levels"], "gammas": best["gammas"],
                     "speedup_vs_plain": round(best["speedup_vs_plain"], 4)}}
    if args.push_to_hub:
        target = f"{args.push_to_hub}@{args.revision or 'main'}" + (" (as a pull request)" if args.create_pr else "")
        summary["hub"] = {"repo_id": args.push_to_hub, "revision": args.revision, "create_pr": args.create_pr,
                          "dry_run": args.dry_run, "url": None}
        if args.dry_run:
            print(f"dry run: would upload {len(result.files)} files ({result.total_bytes} bytes) to {target}; "
                  "nothing was uploaded")
            for path, size in result.files:
                print(f"  {size:>14,d}  {path}")
        else:
            print(f"pushing {result.output_dir} to {target}", file=sys.stderr)
            try:
                summary["hub"]["url"] = ex.push_to_hub(
                    result.output_dir, args.push_to_hub, private=args.private or None, revision=args.revision,
                    create_pr=args.create_pr, commit_message=args.commit_message,
                )
            except ex.HubPushError as e:
                return fail(str(e))
    print(json.dumps(summary))
    return 0


def _export_speculators(args, parser, ex, fail) -> int:
    """`--format speculators`: only the flags that apply to a drafter folder."""
    hispec_only = [f for f, v in (("--heads-only", args.heads_only), ("--calibrate", args.calibrate),
                                  ("--drafter", args.drafter is not None),
                                  ("--draft-vocab-size", args.draft_vocab_size is not None),
                                  ("--verify-vocab-size", args.verify_vocab_size is not None),
                                  ("--vocab-data", bool(args.vocab_data)), ("--gamma", args.gamma is not None),
                                  ("--window", args.window is not None),
                                  ("--verification", args.verification is not None)) if v]
    if hispec_only:
        parser.error(f"{', '.join(hispec_only)} only apply to hispec checkpoints, not to --format speculators")
    from ..io import parse_dtype
    from ..export.speculators import SpeculatorsExportError, export_speculators

    try:
        out = export_speculators(args.train_output_dir, args.output_dir, verifier=args.base,
                                 revision=args.base_revision,
                                 dtype=None if args.dtype == "auto" else parse_dtype(args.dtype),
                                 speculative_tokens=args.speculative_tokens, overwrite=args.overwrite)
    except (SpeculatorsExportError, FileExistsError, FileNotFoundError, ValueError, OSError) as e:
        return fail(str(e))
    files = sorted(p for p in out.rglob("*") if p.is_file())
    summary = {"output_dir": str(out), "format": "speculators", "files": len(files),
               "bytes": sum(p.stat().st_size for p in files), "hub": None}
    if args.push_to_hub:
        summary["hub"] = {"repo_id": args.push_to_hub, "revision": args.revision, "dry_run": args.dry_run,
                          "url": None}
        if args.dry_run:
            print(f"dry run: would upload {len(files)} files to {args.push_to_hub}; nothing was uploaded")
        else:
            try:
                summary["hub"]["url"] = ex.push_to_hub(out, args.push_to_hub, private=args.private or None,
                                                       revision=args.revision, create_pr=args.create_pr,
                                                       commit_message=args.commit_message)
            except ex.HubPushError as e:
                return fail(str(e))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
