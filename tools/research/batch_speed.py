"""Decoding speed by batch size: does `auto` stay at or above plain decoding when many rows decode together?

    python tools/research/batch_speed.py --model CK --batch-sizes 1,4,16 --num-prompts 16 --max-new-tokens 64 --threads 1

`hispec-bench` times one prompt at a time; this times `model.generate` on left-padded batches of Spec-Bench prompts
(chat template), per batch size, for:
- `hf`: transformers' own greedy `generate` on the same batch, stock linear kernels (what a user gets);
- `ar`: hispec's plain loop (prepacked kernels where `hispec.load` packs): the plain-decoding yardstick here;
- `auto`: the checkpoint's calibrated policy, which prices every row at its batch's pass costs
  (`Calibration.at_batch`): a compute-bound batch pays for every extra verified position, so speculation that wins
  alone can lose there, and `auto` then decodes plainly;
- `auto-batch-blind`: the same policy priced as if every row were alone (the rule before `at_batch` and the
  batch's round, `_AutoPolicy._batch_pays`), to show what batch-aware pricing changes;
- on request (`--strategies`), any fixed hierarchy of hispec's (`ngram`, `self-spec`, `eagle`, `eagle-lookup`,
  ...: `hispec.decoding.levels.NAMED`), to split a batch's speed into its sources (kernels: `ar` over `hf`; the
  lookup: `ngram`; a drafter: `eagle`) and to see what `auto` declined; one the checkpoint cannot run (`eagle`
  without a drafter) is refused before any timing.
Strategies run interleaved per batch (rotated order), so machine drift hits all alike. Two speeds per row: the
whole call (prefill included: what a user waits for) and decoding alone (new tokens after each row's first, over
the seconds after the prefill: hispec's `GenerationStats.prefill_seconds`; for `hf` the time of its first logits
call, which follows its prefill, so its set-up counts as prefill, while hispec's set-up, `auto`'s planning
included, counts as decoding: a bias against hispec). Long padded prompts make the whole-call figure at large
batches mostly prefill, where the strategies do the same work; the decode-only figure is where they differ. Every output is compared
with `ar`'s on the same batch (fp32: identical token for token). Needs a calibrated checkpoint (`hispec-bench
--model CK --calibrate` or `hispec-export ... --calibrate`). Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STRATEGIES = ("hf", "ar", "auto", "auto-batch-blind")


@contextlib.contextmanager
def batch_blind():
    """Price rows as if alone (`Calibration.at_batch` as the identity, no pricing of the batch's round:
    `_AutoPolicy._batch_pays`), for the `auto-batch-blind` comparison."""
    from hispec import decoding, latency

    at_batch, pays = latency.Calibration.at_batch, decoding._AutoPolicy._batch_pays
    latency.Calibration.at_batch = lambda self, rows: self
    decoding._AutoPolicy._batch_pays = lambda self, *a: True
    try:
        yield
    finally:
        latency.Calibration.at_batch, decoding._AutoPolicy._batch_pays = at_batch, pays


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="batch_speed", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a calibrated hispec checkpoint folder")
    p.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / "data/eval/spec_bench_question.jsonl"))
    p.add_argument("--num-prompts", type=int, default=16, help="prompts per batch size (spread over categories)")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--device", default=None, help="torch device (default cpu); timings wait for it (hispec.timing)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-pack", action="store_true", help="stock linear kernels (as the calibration must have been)")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    from hispec.decoding.levels import NAMED

    known = STRATEGIES + tuple(n for n in NAMED if n not in STRATEGIES)
    bad = [s for s in strategies if s not in known]
    if bad or not strategies:
        p.error(f"unknown strategies {bad}; choose from {', '.join(known)}")
    if not sizes or min(sizes) < 1 or any(args.num_prompts % b for b in sizes):
        p.error(f"--batch-sizes must be >= 1 and divide --num-prompts ({args.num_prompts}), got {sizes}")

    import torch
    from tqdm.auto import tqdm
    from transformers import LogitsProcessor, LogitsProcessorList

    import hispec
    from hispec import packed, timing
    from hispec.bench.env import hardware_info
    from hispec.bench.runner import _rotated
    from hispec.prompts import cut_at_eos, encode_prompts, eos_ids, load_prompts, pad_id_of, spread_over_categories

    if args.threads:
        torch.set_num_threads(args.threads)
    model = hispec.load(args.model, dtype=args.dtype, device=args.device, pack=False if args.no_pack else None)
    if not getattr(model.hispec_config, "calibration", None) and any(s.startswith("auto") for s in strategies):
        p.error(f"{args.model} holds no calibration: run `hispec-bench --model {args.model} --calibrate` first")
    drafted = [s for s in strategies if any("eagle3" in lv for lv in NAMED.get(s, ()))]
    if drafted and model.drafter is None:
        p.error(f"{', '.join(drafted)} need an EAGLE-3 drafter and {args.model} has none "
                "(hispec-export RUN --drafter DRAFTER_RUN)")
    tok = model.tokenizer
    texts = [pr.text for pr in spread_over_categories(load_prompts(args.prompts), args.num_prompts)]
    eos = set(eos_ids(generation_config=model.base.generation_config))  # what both decoders stop at
    pad = pad_id_of(tok)

    def run(strategy, ids, mask):  # (timed once the device's queued work is done: hispec.timing)
        """(seconds, prefill seconds, new tokens per row, GenerationStats or None) of one batch."""
        t0 = timing.now(model.device)
        if strategy == "hf":
            first = []  # when transformers first scores the next token: its prefill is done

            class Mark(LogitsProcessor):
                def __call__(self, input_ids, scores):
                    if not first:
                        first.append(timing.now(model.device))
                    return scores

            with torch.no_grad(), packed.stock():
                out = model.base.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                          do_sample=False, pad_token_id=pad,
                                          logits_processor=LogitsProcessorList([Mark()]))
            rows, stats = [cut_at_eos(r[ids.shape[1]:].tolist(), eos)[0] for r in out], None
            prefill = first[0] - t0
        else:
            with batch_blind() if strategy == "auto-batch-blind" else contextlib.nullcontext():
                out = model.generate(ids, mask, max_new_tokens=args.max_new_tokens,
                                     strategy="auto" if strategy.startswith("auto") else strategy)
            rows, stats = [r.tolist() if hasattr(r, "tolist") else list(r) for r in out.new_tokens], out.stats
            prefill = stats.prefill_seconds
        return timing.now(model.device) - t0, prefill, rows, stats

    with torch.no_grad():  # warm-up: one short batch per strategy
        ids, mask = (t.to(model.device) for t in encode_prompts(tok, texts[:1]))
        for s in strategies:
            run(s, ids, mask)
    results = []
    bar = tqdm(total=sum(args.num_prompts // b for b in sizes) * len(strategies), desc="batches", file=sys.stderr)
    for B in sizes:
        acc = {s: {"seconds": 0.0, "prefill": 0.0, "tokens": 0, "decode_tokens": 0, "identical": 0, "rows": 0,
                   "row_rounds": 0, "plain": 0, "plan": None} for s in strategies}
        for k, i in enumerate(range(0, args.num_prompts, B)):
            ids, mask = (t.to(model.device) for t in encode_prompts(tok, texts[i: i + B]))
            order = _rotated(strategies, k)
            outs = {}
            for s in order:
                secs, prefill, rows, stats = run(s, ids, mask)
                outs[s] = rows
                a = acc[s]
                a["seconds"] += secs
                a["prefill"] += prefill
                a["tokens"] += sum(len(r) for r in rows)
                a["decode_tokens"] += sum(max(len(r) - 1, 0) for r in rows)  # each row's first is the prefill's
                if stats is not None:
                    a["row_rounds"] += stats.row_rounds
                    a["plain"] += stats.plain_row_rounds
                    a["plan"] = stats.strategy
                bar.update()
            ref = outs.get("ar")
            for s in strategies:
                acc[s]["rows"] += len(outs[s])
                if ref is not None:
                    acc[s]["identical"] += sum(x == y for x, y in zip(outs[s], ref))
        for s in strategies:
            a = acc[s]
            decode_s = a["seconds"] - a["prefill"]
            results.append({"batch_size": B, "strategy": s, "tokens_per_s": a["tokens"] / a["seconds"],
                            "decode_tokens_per_s": a["decode_tokens"] / decode_s if decode_s > 0 else None,
                            "seconds": a["seconds"], "prefill_seconds": a["prefill"], "new_tokens": a["tokens"],
                            "rows": a["rows"],
                            "identical_to_ar": a["identical"] if "ar" in strategies else None,
                            "plain_row_share": a["plain"] / a["row_rounds"] if a["row_rounds"] else None,
                            "plan": a["plan"]})
    bar.close()
    by = {(r["batch_size"], r["strategy"]): r for r in results}
    for r in results:
        for base in ("ar", "hf"):
            b = by.get((r["batch_size"], base))
            if b is not None:
                r[f"vs_{base}"] = r["tokens_per_s"] / b["tokens_per_s"]
                if r["decode_tokens_per_s"] and b["decode_tokens_per_s"]:
                    r[f"decode_vs_{base}"] = r["decode_tokens_per_s"] / b["decode_tokens_per_s"]

    def x(v):
        return f"{v:>5.2f}x" if v is not None else f"{'-':>6}"

    print(f"{'':<24}{'whole call (prefill included)':<31}{'decoding alone':<23}")
    print(f"{'batch':>5} {'strategy':<17} {'tok/s':>7} {'prefill':>7} {'vs ar':>6} {'vs hf':>6}  {'tok/s':>7} "
          f"{'vs ar':>6} {'vs hf':>6} {'plain rounds':>12} {'same as ar':>10}  plan")
    for r in results:
        share = "-" if r["plain_row_share"] is None else f"{r['plain_row_share']:.0%}"
        same = "-" if r["identical_to_ar"] is None else f"{r['identical_to_ar']}/{r['rows']}"
        dec = r["decode_tokens_per_s"]
        print(f"{r['batch_size']:>5} {r['strategy']:<17} {r['tokens_per_s']:>7.1f} "
              f"{r['prefill_seconds'] / r['seconds']:>7.0%} {x(r.get('vs_ar'))} {x(r.get('vs_hf'))}  "
              f"{'-' if dec is None else f'{dec:.1f}':>7} {x(r.get('decode_vs_ar'))} {x(r.get('decode_vs_hf'))} "
              f"{share:>12} {same:>10}  {r['plan'] or ''}")
    print(json.dumps({"model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
                      "max_new_tokens": args.max_new_tokens, "num_prompts": args.num_prompts,
                      "hardware": hardware_info(), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
