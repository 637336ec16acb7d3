"""How well an EAGLE-3 drafter run predicts its target on held-out prompts, per category (Spec-Bench by default).

    python tools/drafter_eval.py --run runs/smollm2-135m-eagle3 --num-prompts 40 --max-new-tokens 128 --dtype bf16
    python tools/drafter_eval.py --run recipes/artifacts/smollm2-135m/eagle3 runs/smollm2-135m-eagle3 ...   # side by side

The target answers each prompt greedily (its own output, as in decoding), one frozen pass over prompt + answer gives
the drafter's aux layers and the target's top-k at every position, and the drafter runs its training-time test over
the whole sequences (`hispec.distill.drafter.ttt_loss`, exactly the training evaluation): per draft step s the top-1
agreement with the target's argmax on answer tokens (step 0 = the first draft of a round, with the target's states
up to the previous token: "d = 1"), the chained agreement (steps 0..s all right: s + 1 drafts accepted) and their
sum, the expected accepted drafts per round of `--steps` greedy drafts; the share of the target's tokens inside the
draft vocabulary (in-vocab, top1@0's ceiling: `eagle3_draft_vocab_size` larger than a drafter's widens it when
training on from it); and what a confidence gate would do (drafting stops at the first draft whose probability
under the drafter is below g: drafts proposed and accepted per round).
Prints a per-category table and ends with one JSON line. Evaluation only: these prompts must never be training data.

Several `--run`s (drafters of the same target) are scored on the very same target answers, generated once -- the
expensive part -- followed by a table of top1@0 and accepted drafts per round side by side; the JSON line then holds
`{"runs": [one result per run], ...}`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="drafter_eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, nargs="+",
                   help="train/heads.py output folder of an eagle3 run (several: compared on the same answers)")
    p.add_argument("--model", default=None, help="the target (default: the base the first run recorded)")
    p.add_argument("--prompts", default=str(REPO / "data" / "eval" / "spec_bench_question.jsonl"),
                   help="prompt file (Spec-Bench / MT-Bench question.jsonl, jsonl with 'prompt', text lines)")
    p.add_argument("--num-prompts", type=int, default=40, help="prompts, spread over categories (default 40)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="greedy answer length in tokens (default 128)")
    p.add_argument("--steps", type=int, default=None, help="draft steps per round (default: the run's ttt steps)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="target dtype (default fp32)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts answered per batch (default 8)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--json-out", default=None, help="also write the result here")
    return p


def _sequences(base, tokenizer, prompts, max_new_tokens: int, batch_size: int):
    """(token ids prompt + greedy answer, index of the first answer token) per prompt."""
    from hispec import packed
    from hispec.distill.generate import answer_batches
    from hispec.prompts import eos_ids, pad_id_of, render

    ids = [render(tokenizer, p.text) for p in prompts]
    out = [None] * len(ids)
    with packed.for_generation(base):
        for idx, rows in answer_batches(base, ids, batch_size=batch_size, pad_id=pad_id_of(tokenizer),
                                        eos=eos_ids(tokenizer, base.generation_config), max_new_tokens=max_new_tokens):
            for i, (toks, _) in zip(idx, rows):
                out[i] = (ids[i] + toks, len(ids[i]))
    return out


def totals(drafter, embed, items, steps: int) -> dict[str, float]:
    """Summed `ttt_loss` statistics over items (one sequence a batch); `summarize` turns them into metrics, and
    sums of them (categories -> all) summarize exactly as the items together would."""
    import torch

    from hispec.distill.drafter import DrafterCollator, DrafterForTraining, ttt_loss

    model = DrafterForTraining(drafter, embed).eval()
    collate = DrafterCollator(drafter.config.aux_layers, steps)
    out: dict[str, float] = {}
    with torch.no_grad():
        for it in items:
            for key, v in ttt_loss(model, collate([it]), steps).sums.items():
                out[key] = out.get(key, 0.0) + v
    return out


def _table(run, args, n_prompts, steps, rows, overall) -> None:
    head = f"{'category':<24}{'tokens':>8}" + "".join(f"{'top1@' + str(s):>9}" for s in range(steps)) \
        + "".join(f"{'chain@' + str(s):>9}" for s in range(steps)) + f"{'acc/round':>11}{'in-vocab':>10}"
    print(f"EAGLE-3 drafter {run} on {args.prompts} ({n_prompts} prompts x {args.max_new_tokens} greedy "
          f"tokens, target {args.dtype}); top1@s: step s agrees with the target's argmax; chain@s: steps 0..s all do; "
          "in-vocab: the target's token is in the draft vocabulary (top1@0's ceiling)")
    print(head)
    for name, r in [*rows.items(), ("all", overall)]:
        print(f"{name:<24}{r['tokens']:>8}" + "".join(f"{x:>9.3f}" for x in r["top1"])
              + "".join(f"{x:>9.3f}" for x in r["chain"]) + f"{r['accepted_per_round']:>11.3f}"
              + f"{r['in_vocab']:>10.3f}")
    print("confidence gate (drafting stops at the first draft the drafter gives less than g; all prompts):")
    print(f"{'gate g':>8}{'drafted/round':>15}{'accepted/round':>16}{'accepted/draft':>16}")
    for row in overall["gated"]:
        print(f"{row['gate']:>8.1f}{row['drafted']:>15.3f}{row['accepted']:>16.3f}"
              f"{row['accepted'] / max(row['drafted'], 1e-9):>16.3f}")


def _side_by_side(results: list[dict]) -> None:
    """top1@0 and accepted drafts per round of every run, per category."""
    print(f"\nside by side (top1@0 / accepted drafts per round), the same {results[0]['num_prompts']} answers:")
    print(f"{'category':<24}" + "".join(f"{'run ' + str(i):>18}" for i in range(len(results))))
    cats = [*results[0]["by_category"], "all"]
    for c in cats:
        cells = [r["overall"] if c == "all" else r["by_category"][c] for r in results]
        print(f"{c:<24}" + "".join(f"{x['top1'][0]:>10.3f} /{x['accepted_per_round']:>6.3f}" for x in cells))
    for i, r in enumerate(results):
        print(f"run {i}: {r['run']}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from hispec.distill.drafter import sequence_items, summarize
    from hispec.drafters.eagle3 import load_drafter
    from hispec.layers import DecoderAdapter
    from hispec.model import load_base_model, load_tokenizer
    from hispec.prompts import load_prompts

    if args.threads:
        torch.set_num_threads(args.threads)
    drafters = [load_drafter(run) for run in args.run]
    meta = drafters[0][1]
    model_path = args.model or str(Path((meta.get("base") or {}).get("name_or_path", "")).expanduser())
    if not model_path:
        print("drafter_eval: error: the run records no target; pass --model", file=sys.stderr)
        return 2
    sizes = {(d.config.hidden_size, d.config.vocab_size) for d, _ in drafters}
    if len(sizes) > 1:
        print(f"drafter_eval: error: the runs draft for different targets (hidden size, vocabulary: {sorted(sizes)})",
              file=sys.stderr)
        return 2
    t0 = time.time()
    base = load_base_model(model_path, dtype=args.dtype)
    tokenizer = load_tokenizer(model_path)
    adapter = DecoderAdapter(base)
    prompts = load_prompts(args.prompts, num=args.num_prompts)
    seqs = _sequences(base, tokenizer, prompts, args.max_new_tokens, args.batch_size)
    embed = base.get_input_embeddings()
    results, items_by_layers = [], {}
    for run, (drafter, meta) in zip(args.run, drafters):
        steps = args.steps or int(meta.get("ttt_steps") or 3)
        layers = tuple(drafter.config.aux_layers)
        if layers not in items_by_layers:
            items_by_layers[layers] = sequence_items(adapter, seqs, list(layers))
        items = items_by_layers[layers]
        by_cat: dict[str, list] = {}
        for p, it in zip(prompts, items):
            by_cat.setdefault(p.category, []).append(it)
        cat_totals = {c: totals(drafter, embed, its, steps) for c, its in sorted(by_cat.items())}
        all_totals: dict[str, float] = {}
        for t in cat_totals.values():
            for key, v in t.items():
                all_totals[key] = all_totals.get(key, 0.0) + v
        rows = {c: summarize(t, steps) for c, t in cat_totals.items()}
        overall = summarize(all_totals, steps)
        _table(run, args, len(prompts), steps, rows, overall)
        results.append({"run": str(run), "prompts": str(args.prompts), "num_prompts": len(prompts),
                        "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "steps": steps,
                        "aux_layers": drafter.config.aux_layers, "overall": overall, "by_category": rows})
    seconds = round(time.time() - t0, 1)
    if len(results) == 1:
        result = {**results[0], "seconds": seconds}
    else:
        _side_by_side(results)
        result = {"prompts": str(args.prompts), "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                  "dtype": args.dtype, "runs": results, "seconds": seconds}
    from hispec.io import emit_result

    return emit_result(result, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
