"""hispec-export: a training run's output -> an early-exit checkpoint folder (+ model card), optionally on the Hub.

    hispec-export runs/smollm2 --output-dir exports/smollm2-hispec
    hispec-export runs/smollm2 --output-dir exports/smollm2-hispec --push-to-hub me/SmolLM2-135M-hispec --private

The folder is written atomically (temporary sibling, one rename); an existing one is refused unless --overwrite.
The push happens after the local export; if it fails, the command exits non-zero and the local folder stays.
Progress goes to stderr; stdout ends with one JSON line describing the result.
"""

from __future__ import annotations

import argparse
import json
import sys


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

    from .. import export as ex  # heavy imports (torch, transformers) only once arguments are valid
    from ..model import CheckpointError

    def fail(msg: str) -> int:
        print(f"hispec-export: error: {msg}", file=sys.stderr)
        return 1

    if args.push_to_hub and not args.dry_run and ex.hub_token() is None:
        return fail("--push-to-hub needs a Hugging Face token: set $HF_TOKEN or run `hf auth login` "
                    "(nothing was exported)")
    try:
        result = ex.export(
            args.train_output_dir, args.output_dir, base=args.base, base_revision=args.base_revision,
            dtype=None if args.dtype == "auto" else args.dtype, heads_only=args.heads_only,
            overwrite=args.overwrite, max_shard_size=args.max_shard_size, base_model_id=args.base_model_id,
            license=args.license, name=args.push_to_hub, draft_vocab_size=args.draft_vocab_size,
            verify_vocab_size=args.verify_vocab_size, vocab_data=args.vocab_data, gamma=args.gamma,
            window=args.window,
        )
    except (CheckpointError, ex.ExportError, FileExistsError, ValueError, OSError) as e:
        return fail(str(e))
    summary = {"output_dir": str(result.output_dir), "heads_only": result.heads_only, "files": len(result.files),
               "bytes": result.total_bytes, "hub": None}
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


if __name__ == "__main__":
    sys.exit(main())
