"""Agreement of a checkpoint's exit heads with the model's final layer on real prompts, by frontier distance.

    python tools/head_agreement.py --model CKPT [CKPT2 ...] --prompts data/eval/spec_bench_question.jsonl \
        --num-prompts 40 --max-new-tokens 96 --dtype bf16 --threads 1

For each prompt the model answers greedily (plain decoding); prompt + answer are then teacher-forced once and, at
every answer position, each exit head's top-1 / top-5 tokens are compared with the final layer's argmax (the
token the decoder would accept). `context` heads are measured at each frontier distance d = 1..D (the final
layer's states are available up to t - d, as in decoding after the full model verified t - d); other head types
do not depend on d. This is what decides acceptance in `self-spec` (draft > full) and `hispec`'s last level, on
the prompts you choose, not on the training data (`metrics.json` of a training run holds the in-distribution
figures). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from tqdm.auto import tqdm

import hispec
from hispec.layers import positions_from_mask
from hispec.prompts import load_prompts, render


def agreement(model, texts, max_new_tokens: int, distances: int, progress: bool = True) -> dict:
    """{exit: {d: {"top1": a, "top5": a5}}} over all answer positions of `texts` (d = 0 for non-context heads)."""
    ad = model.adapter
    exits = {"draft": model.draft_layer, "verify": model.verify_layer}
    layers = tuple(sorted({*exits.values(), ad.num_layers}))
    hits: dict = {}
    n = 0
    for text in tqdm(texts, desc="prompts", disable=not progress, file=sys.stderr):
        ids = torch.tensor([render(model.tokenizer, text, True)], device=ad.device)
        ans = model.generate(ids, strategy="ar", max_new_tokens=max_new_tokens).new_tokens[0]
        P, N = ids.shape[1], len(ans)
        if N < 2:
            continue
        seq = torch.cat([ids, torch.tensor([ans], device=ad.device)], 1)
        with torch.no_grad():
            logits, states = ad.forward_all(seq, positions_from_mask(torch.ones_like(seq)), ad.new_cache(1),
                                            exits=layers)
            target = logits[0, P: P + N - 1].argmax(-1)
            for name, layer in exits.items():
                head = model.heads[name]
                ds = range(1, distances + 1) if head.needs_context else [0]
                for d in ds:
                    if head.needs_context:
                        feats = head(states[layer], context=head.sequence_context(states, d))
                    else:
                        feats = head(states[layer], head.run_layer_fresh(ad) if head.stateful else None)
                    top = model.project_exit(name, feats[:, P: P + N - 1])[0].topk(5, dim=-1).indices
                    h = hits.setdefault(name, {}).setdefault(d, [0, 0])
                    h[0] += int((top[:, 0] == target).sum())
                    h[1] += int((top == target[:, None]).any(-1).sum())
        n += N - 1
    return {name: {d: {"top1": h[0] / n, "top5": h[1] / n} for d, h in by.items()} for name, by in hits.items()}, n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", required=True, help="hispec checkpoint folder(s)")
    p.add_argument("--prompts", required=True, help="Spec-Bench/MT-Bench question.jsonl or any hispec prompt file")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--distances", type=int, default=4, help="context heads: frontier distances 1..D (default 4)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    texts = [q.text for q in load_prompts(args.prompts, num=args.num_prompts)]
    rows, out = [], {}
    for path in args.model:
        t0 = time.perf_counter()
        model = hispec.load(path, dtype=args.dtype)
        res, n = agreement(model, texts, args.max_new_tokens, args.distances, not args.no_progress)
        kind = model.hispec_config.head_type
        if kind == "context":
            kind += f" (frontier {model.hispec_config.context.get('frontier', 0)})"
        out[str(path)] = {"head_type": kind, "positions": n, "agreement": res,
                          "seconds": round(time.perf_counter() - t0, 1)}
        for name, by in res.items():
            for d, r in by.items():
                rows.append((str(path), kind, f"{name} L{getattr(model, name + '_layer')}", d or "-", r["top1"],
                             r["top5"]))
    w = max(len(r[0]) for r in rows) + 2
    print(f"{'checkpoint':<{w}}{'head':<22}{'exit':<12}{'d':>3}{'top-1':>8}{'top-5':>8}")
    for path, kind, ex, d, a1, a5 in rows:
        print(f"{path:<{w}}{kind:<22}{ex:<12}{d!s:>3}{a1:>8.3f}{a5:>8.3f}")
    print(json.dumps({"prompts": len(texts), "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                      "checkpoints": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
