"""How much time the decoder's output bookkeeping (`_Run.commit`: hand over committed tokens, EOS, stop strings,
streaming) takes over one long generation, and whether it grows with the output.

    python tools/research/bookkeeping_bench.py                       # this checkout's hispec
    python tools/research/bookkeeping_bench.py --repo /tmp/before    # another checkout's (e.g. before commit became linear)

A tiny random llama (tests/tiny.py, context widened) generates `--tokens` new tokens greedily with strategy `ar`
(one token per round: the most rounds, so the most bookkeeping) and no EOS, once without and once with stop strings
that never match (each round checks them). `_Run.commit` is timed on every call in CPU time of the thread (less
sensitive to other processes on a shared machine than wall time); the table gives its total, its share of the
generation's CPU time, and its mean per call in each quarter of the rounds: a constant cost per round is linear in
the output, one that grows with the output is quadratic (the last quarter's mean over the first's says which).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bookkeeping_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", default=str(HERE), help="checkout whose hispec to measure (default: this one)")
    p.add_argument("--tokens", type=int, default=2048, help="new tokens to generate (default 2048)")
    p.add_argument("--batch", type=int, default=1, help="rows generated together (default 1)")
    p.add_argument("--stop", default="zzqqzzqq,<never>", help="comma-separated stop strings that never match")
    args = p.parse_args(argv)
    sys.path[:0] = [str(Path(args.repo).resolve()), str(HERE / "tests")]

    import torch

    import hispec
    from hispec import decoding
    from tiny import char_tokenizer, tiny_config

    torch.set_num_threads(1)
    config = tiny_config("llama")
    config.max_position_embeddings = args.tokens + 64
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(config).eval()
    model = hispec.EarlyExitModel.from_base(base, 2, 4, "linear", tokenizer=char_tokenizer())
    prompt = torch.randint(4, 97, (args.batch, 16), generator=torch.Generator().manual_seed(0))

    calls: list[float] = []
    commit = decoding._Run.commit

    def timed(self):
        t0 = time.thread_time()
        out = commit(self)
        calls.append(time.thread_time() - t0)
        return out

    decoding._Run.commit = timed
    rows = []
    for name, stop in (("no stop strings", None), ("stop strings", [s for s in args.stop.split(",") if s])):
        calls.clear()
        t0 = time.thread_time()
        out = model.generate(prompt, max_new_tokens=args.tokens, strategy="ar", eos_token_id=[], stop_strings=stop)
        total = time.thread_time() - t0
        assert all(len(t) == args.tokens for t in out.new_tokens), "the generation stopped early"
        q = len(calls) // 4
        quarters = [1e6 * sum(calls[i * q : (i + 1) * q]) / q for i in range(4)]
        rows.append({"case": name, "rounds": len(calls), "generate_cpu_s": round(total, 3),
                     "commit_cpu_s": round(sum(calls), 4), "commit_share": round(sum(calls) / total, 4),
                     "us_per_call_by_quarter": [round(x, 1) for x in quarters],
                     "last_over_first": round(quarters[-1] / quarters[0], 2)})
    decoding._Run.commit = commit

    print(f"hispec from {Path(hispec.__file__).parent}; {args.tokens} new tokens x {args.batch} row(s), strategy ar")
    print(f"{'case':<18}{'rounds':>7}{'gen cpu s':>11}{'commit cpu s':>14}{'share':>8}"
          f"{'us/call by quarter of the rounds':>36}{'last/first':>12}")
    for r in rows:
        by_q = " ".join(f"{x:>7.1f}" for x in r["us_per_call_by_quarter"])
        print(f"{r['case']:<18}{r['rounds']:>7}{r['generate_cpu_s']:>11.3f}{r['commit_cpu_s']:>14.4f}"
              f"{r['commit_share']:>8.1%}{by_q:>36}{r['last_over_first']:>12.2f}")
    print(json.dumps({"repo": str(Path(args.repo).resolve()), "tokens": args.tokens, "batch": args.batch,
                      "cases": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
