"""Agreement of a checkpoint's exit heads with the model's final layer on real prompts, by frontier distance.

    python tools/research/head_agreement.py --model CKPT [CKPT2 ...] --prompts data/eval/spec_bench_question.jsonl \
        --num-prompts 40 --max-new-tokens 96 --dtype bf16 --threads 1

For each prompt the model answers greedily (plain decoding); prompt + answer are then teacher-forced once and, at
every answer position, each exit head's top-1 / top-5 tokens are compared with the final layer's argmax (the
token the decoder would accept). `context` heads are measured at each frontier distance d = 1..D (the final
layer's states are available up to t - d, as in decoding after the full model verified t - d); other head types
do not depend on d. This is what decides acceptance in `self-spec` (draft > full) and `hispec`'s last level, on
the prompts you choose, not on the training data (`metrics.json` of a training run holds the in-distribution
figures). Prints a table, then one JSON line.

The answers are generated once: a later checkpoint reuses a prompt's answer when its own final layer, teacher-forced
on it, reproduces it (>= 98% of the answer's tokens: the same backbone, up to bf16 ties), and answers afresh
otherwise, so every checkpoint is measured on its own model's greedy answers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hispec  # noqa: E402
from hispec.distill.items import Sequence  # noqa: E402
from hispec.distill.metrics import EXIT_NAMES, exit_head_predictions  # noqa: E402
from hispec.prompts import load_prompts, render  # noqa: E402


REUSE_MATCH = 0.98  # share of an earlier checkpoint's answer its final layer must reproduce for the answer to be reused


def _sequences(model, prompts, answers: dict, max_new_tokens: int, fresh: set) -> list[Sequence]:
    """Prompt + answer per prompt (answer scored from its second token: the first comes from the prefill); answers
    generated greedily where `answers` has none or the prompt is in `fresh` (`answers` is updated)."""
    seqs = []
    for q in prompts:
        ids = render(model.tokenizer, q.text, True)
        if q.text not in answers or q.text in fresh:
            x = torch.tensor([ids], device=model.adapter.device)
            answers[q.text] = list(model.generate(x, strategy="ar", max_new_tokens=max_new_tokens).new_tokens[0])
        ans = answers[q.text]
        seqs.append(Sequence(ids + ans, [(len(ids) + 1, len(ids) + len(ans))], q.category))
    return seqs


def agreement(model, prompts, max_new_tokens: int, distances: int, progress: bool = True,
              answers: dict | None = None) -> tuple[dict, int, dict]:
    """Top-1 / top-5 agreement with the final layer's argmax over all answer positions of `prompts`
    (`hispec.prompts.Prompt`s) through `hispec.distill.metrics.exit_head_predictions`: ({exit: {d: {"top1", "top5"}}}
    (d = 0 for heads that read no context), positions, {category: {exit: top-1 at the first distance}}).

    `answers` ({prompt text: token ids}) holds answers of earlier checkpoints: reused where this model's final layer
    reproduces them (REUSE_MATCH), replaced by this model's own greedy answer otherwise (the dict is updated)."""
    answers = {} if answers is None else answers
    for q in tqdm(prompts, desc="answers", disable=not progress, file=sys.stderr):
        _sequences(model, [q], answers, max_new_tokens, set())  # answers what no earlier checkpoint answered
    prompts = [q for q in prompts if len(answers[q.text]) >= 2]  # a scored position needs two answer tokens
    ds = tuple(range(1, distances + 1))
    seqs = _sequences(model, prompts, answers, max_new_tokens, set())
    pred = exit_head_predictions(model, seqs, distances=ds)
    lay = pred["layout"]
    match = [float((pred["final"] == lay.next_token)[lay.sequence == i].float().mean()) if seqs[i].n_scored else 1.0
             for i in range(len(seqs))]
    redo = [i for i, m in enumerate(match) if m < REUSE_MATCH]
    if redo:  # another backbone: answer those prompts afresh and measure them again
        again = _sequences(model, [prompts[i] for i in redo], answers, max_new_tokens, {prompts[i].text for i in redo})
        for i, s in zip(redo, again):
            seqs[i] = s
        pred = exit_head_predictions(model, seqs, distances=ds)
        lay = pred["layout"]
    final, res, cats = pred["final"], {}, {}
    for name in EXIT_NAMES:
        by = pred[f"{name}_by_distance"]
        keyed = by if model.heads[name].needs_context else {0: by[ds[0]]}
        res[name] = {d: {"top1": float((t1 == final).float().mean()), "top5": float(t5.float().mean())}
                     for d, (t1, t5) in keyed.items()}
        for ci, c in enumerate(lay.categories):
            sel = lay.category == ci
            cats.setdefault(c, {})[name] = float((pred[f"{name}_top1"] == final)[sel].float().mean())
    return res, lay.n, cats


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
    prompts = load_prompts(args.prompts, num=args.num_prompts)
    rows, out, answers = [], {}, {}
    for path in args.model:
        t0 = time.perf_counter()
        model = hispec.load(path, dtype=args.dtype)
        res, n, cats = agreement(model, prompts, args.max_new_tokens, args.distances, not args.no_progress, answers)
        kind = model.hispec_config.head_type
        if kind == "context":
            kind += f" (frontier {model.hispec_config.context.get('frontier', 0)})"
        out[str(path)] = {"head_type": kind, "positions": n, "agreement": res, "top1_by_category": cats,
                          "seconds": round(time.perf_counter() - t0, 1)}
        for name, by in res.items():
            for d, r in by.items():
                rows.append((str(path), kind, f"{name} L{getattr(model, name + '_layer')}", d or "-", r["top1"],
                             r["top5"]))
    w = max(len(r[0]) for r in rows) + 2
    print(f"{'checkpoint':<{w}}{'head':<22}{'exit':<12}{'d':>3}{'top-1':>8}{'top-5':>8}")
    for path, kind, ex, d, a1, a5 in rows:
        print(f"{path:<{w}}{kind:<22}{ex:<12}{d!s:>3}{a1:>8.3f}{a5:>8.3f}")
    print(json.dumps({"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                      "checkpoints": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
