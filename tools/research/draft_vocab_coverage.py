"""Which share of a target's own answers a draft vocabulary of each size would hold, per category (Spec-Bench by
default): the ceiling of an EAGLE-3 drafter's agreement before any training, for choosing `eagle3_draft_vocab_size`.

    python tools/research/draft_vocab_coverage.py --model ~/.cache/hispec/models/Qwen2.5-Coder-1.5B-Instruct \\
        --feature-cache runs/qwen2.5-coder-1.5b-eagle3-data/features_s31 --sizes 8192 16384 32768 \\
        --drafter recipes/artifacts/qwen2.5-coder-1.5b-instruct/eagle3 --dtype bf16

A size's vocabulary is what training would choose (`hispec.distill.drafter.draft_vocab_from_cache`): the most frequent
teacher top-1 tokens over the feature cache's training split (only that column is read, not the hidden states).
The target answers each prompt greedily (as in `tools/drafter_eval.py`, which prints the same share for a trained
drafter as `in-vocab`); a token counts as covered when it is in the vocabulary. `--drafter` adds the vocabulary of
trained drafters as columns. A drafter's vocabulary widens without retraining from scratch: `eagle3_init_from` it
with a larger `eagle3_draft_vocab_size`. Prints a table and ends with one JSON line. Evaluation prompts only.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

REPO = Path(__file__).resolve().parents[2]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draft_vocab_coverage", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the target: a local folder or Hub id")
    p.add_argument("--feature-cache", required=True,
                   help="a complete feature cache of that target (train/heads.py feature_cache): its train split "
                        "ranks the tokens")
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768], help="draft vocabulary sizes")
    p.add_argument("--drafter", nargs="*", default=[], help="trained drafter folders whose vocabularies to add")
    p.add_argument("--prompts", default=str(REPO / "data" / "eval" / "spec_bench_question.jsonl"),
                   help="prompt file (Spec-Bench / MT-Bench question.jsonl, jsonl with 'prompt', text lines)")
    p.add_argument("--num-prompts", type=int, default=40, help="prompts, spread over categories (default 40)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="greedy answer length in tokens (default 128)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="target dtype (default fp32)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts answered per batch (default 8)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--json-out", default=None, help="also write the result here")
    return p


def coverage(answers_by_category: dict[str, list[int]], vocabularies: dict[str, set[int]]) -> dict[str, dict]:
    """Per category (and "all"): the share of answer tokens inside each vocabulary, and the token count."""
    rows = {c: toks for c, toks in sorted(answers_by_category.items())}
    rows["all"] = [t for toks in answers_by_category.values() for t in toks]
    return {c: {"tokens": len(toks), **{name: round(sum(t in v for t in toks) / max(len(toks), 1), 4)
                                         for name, v in vocabularies.items()}} for c, toks in rows.items()}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from hispec.distill.drafter import teacher_top1_ranking
    from hispec.distill.features import CachedSequences, FeatureCacheError
    from hispec.drafters.eagle3 import load_drafter
    from hispec.model import load_base_model, load_tokenizer
    from hispec.prompts import load_prompts

    sys.path.insert(0, str(REPO / "tools"))
    from drafter_eval import _sequences

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    try:
        cache = CachedSequences(Path(args.feature_cache).expanduser() / "train", layers=[])
    except (FeatureCacheError, FileNotFoundError) as e:
        print(f"draft_vocab_coverage: error: {e}", file=sys.stderr)
        return 2
    drafters = [(str(d), load_drafter(Path(d).expanduser())[0]) for d in args.drafter]
    base = load_base_model(args.model, dtype=args.dtype)
    V = base.config.vocab_size
    sizes = sorted(set(args.sizes))
    bad = [s for s in sizes if not 0 < s < V] + [d for d, m in drafters if m.config.vocab_size != V]
    if bad:
        print(f"draft_vocab_coverage: error: sizes must be in 1..{V - 1} and drafters must draft for this target "
              f"(vocabulary {V}): {bad}", file=sys.stderr)
        return 2
    ranking = teacher_top1_ranking(cache, V)
    vocabularies = {str(s): set(ranking[:s]) for s in sizes}
    for name, d in drafters:
        ids = d.draft_token_ids()
        vocabularies[name] = set(range(V)) if ids is None else set(ids.tolist())
    tokenizer = load_tokenizer(args.model)
    prompts = load_prompts(args.prompts, num=args.num_prompts)
    seqs = _sequences(base, tokenizer, prompts, args.max_new_tokens, args.batch_size)
    by_cat: dict[str, list[int]] = {}
    for p, (seq, start) in zip(prompts, seqs):
        by_cat.setdefault(p.category, []).extend(seq[start:])
    rows = coverage(by_cat, vocabularies)
    names = list(vocabularies)
    labels = [*names[: len(sizes)], *(f"drafter {i + 1}" for i in range(len(drafters)))]
    print(f"share of the target's greedy answer tokens inside a draft vocabulary ({args.model}, {len(prompts)} "
          f"prompts x {args.max_new_tokens} tokens, {args.dtype}; sizes ranked on {args.feature_cache})")
    print(f"{'category':<18}{'tokens':>8}" + "".join(f"{lab:>12}" for lab in labels))
    for c, r in rows.items():
        print(f"{c:<18}{r['tokens']:>8}" + "".join(f"{r[n]:>12.3f}" for n in names))
    for lab, n in zip(labels[len(sizes):], names[len(sizes):]):
        print(f"{lab}: {n} ({len(vocabularies[n])} tokens)")
    result = {"model": args.model, "feature_cache": args.feature_cache, "prompts": args.prompts,
              "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
              "sizes": sizes, "drafters": [n for n, _ in drafters], "coverage": rows,
              "seconds": round(time.time() - t0, 1)}
    from hispec.io import emit_result

    return emit_result(result, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
