"""Where decoding time goes: measured unit costs of one decoder layer and of the output projection, and what they
imply for speculative decoding — the break-even draft agreement and the speedup at given agreement rates.

    python tools/cost_model.py --model ~/.cache/hispec/models/SmolLM2-135M-Instruct --dtype bf16 --threads 2
    python tools/cost_model.py --model CKPT --agreement 0.38,0.41 --plot costs.png --json-out costs.json

Measured (median of --repeats runs, one process): a decoder layer over T new rows with a KV cache of --context
slots, the full lm_head over T rows, the lm_head restricted to K rows (--vocab-sizes), and the exit head body
(norm + d x d adapter). The model is analytic on top of these, per full-model pass of `self-spec` with gamma drafts
at L_d and of `hispec` (drafts at L_d, window at L_i, full pass at L), with per-token acceptance rates assumed
independent (a_d: the draft exit agrees with the level above it, a_v: the verifier exit agrees with the model):

    self-spec  tokens/pass = (1 - a^(g+1)) / (1 - a)
               time/pass   = g * [L_d*layer(1) + head(1) + proj_K(1)] + (L-L_d)*layer(g+1) + L_d*layer(1) + proj_V(g+1)
    plain      time/token  = L*layer(1) + proj_V(1)

The hierarchical estimate simulates the rounds (Monte Carlo over Bernoulli acceptances) with the same unit costs.
Python overhead of the decoder (bookkeeping per step) is not in the model; `hispec-bench` shows the real thing.
Prints a table, ends with one JSON line.

The layer measurement and the self-spec formula are `hispec.latency`'s (`measure_layer_costs`, `time_per_token`
with no per-step overhead). This tool explores break-even and what-if agreements; `hispec-export --calibrate`
measures the whole latency model (acceptances, heads as exported, the decoder's overhead) into a checkpoint.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(model, rows=(1, 2, 4, 5, 8), context: int = 256, vocab_sizes=(8192, 16384), repeats: int = 30) -> dict:
    """Unit costs in seconds by rows T: the decoder layer (`hispec.latency.measure_layer_costs`: a pass over all
    layers behind a KV cache of `context` slots, per layer), the full lm_head, the lm_head restricted to K rows and
    the draft head's body (norm + adapter), timed interleaved (`hispec.latency.median_times`)."""
    import torch

    from hispec.latency import KVBench, measure_layer_costs, median_times
    from hispec.vocab import select_vocab

    ad = model.adapter
    bench = KVBench(model, context)
    ids = {K: select_vocab(min(K, ad.vocab_size), ad.vocab_size).to(ad.device) for K in vocab_sizes}
    fns = {}
    with torch.no_grad():
        for T in rows:
            normed = bench.hidden(T)
            fns[("proj_full", T)] = lambda x=normed: ad.project(x)
            fns[("head_body", T)] = lambda x=normed: model.heads["draft"](x)
            for K in vocab_sizes:
                fns[(K, T)] = lambda x=normed, v=ids[K]: ad.project(x, v)
        t = median_times(fns, repeats, device=ad.device)
    return {"layer": measure_layer_costs(model, rows, context, repeats, bench),
            "proj_full": {T: t[("proj_full", T)] for T in rows},
            "proj": {K: {T: t[(K, T)] for T in rows} for K in vocab_sizes},
            "head_body": {T: t[("head_body", T)] for T in rows}}


def _interp(table: dict, T: int) -> float:
    from hispec.latency import interp

    return interp(table, T)


def plain_time(c: dict, L: int) -> float:
    return L * c["layer"][1] + c["proj_full"][1]


def proj_cost(c: dict, K: int | None, T: int) -> float:
    return _interp(c["proj_full"] if K is None else c["proj"][K], T)


def _calibration(c: dict, L: int, Ld: int, K: int | None):
    """These unit costs as a `hispec.latency.Calibration` (no per-step overhead) with a draft exit at L_d."""
    from hispec.latency import Calibration

    rows = sorted(c["layer"])
    head = {T: c["head_body"][T] + proj_cost(c, K, T) for T in rows}
    return Calibration(machine={}, dtype="", threads=0, model={"num_layers": L, "exits": {"draft": Ld}},
                       costs={"layer": c["layer"], "head": {f"L{Ld}": head}, "final": c["proj_full"],
                              "ngram": None, "step_overhead": 0.0}, acceptance={})


def self_spec(c: dict, L: int, Ld: int, a: float, gamma: int, K: int | None) -> dict:
    """`hispec.latency.time_per_token` of L_d -> full with these costs and draft agreement a."""
    from hispec.latency import expected_tokens, time_per_token

    cal = _calibration(c, L, Ld, K)
    t = time_per_token([f"L{Ld}", "full"], [gamma], cal, acceptance={f"L{Ld}>full": a})
    return {"tokens_per_pass": expected_tokens(a, gamma), "speedup": plain_time(c, L) / t}


def hierarchy(c: dict, L: int, Ld: int, Li: int, ad: float, av: float, gamma: int, window: int, K: int | None,
           Kv: int | None, tokens: int = 20000, seed: int = 0) -> dict:
    """Monte Carlo of the hierarchy: drafts accepted by L_i with prob ad each (a run), L_i's tokens accepted by L
    with prob av each; unit costs as in `self_spec`."""
    rnd = random.Random(seed)
    layer1, hb = c["layer"][1], c["head_body"][1]
    t = 0.0
    done = passes = 0
    while done < tokens:
        gathered = 0
        while gathered < window:  # intermediate rounds
            t += gamma * (Ld * layer1 + hb + proj_cost(c, K, 1))
            acc = 0
            while acc < gamma and rnd.random() < ad:
                acc += 1
            # L_i verifies gamma drafts: layers Ld..Li over gamma+1 rows, its head over them
            t += Ld * layer1 + (Li - Ld) * _interp(c["layer"], gamma + 1) + hb + proj_cost(c, Kv, gamma + 1)
            gathered += acc + 1  # accepted drafts + L_i's own token
        # full verification of the window
        t += (Li - Ld) * layer1 + (L - Li) * _interp(c["layer"], gathered + 1) + proj_cost(c, None, gathered + 1)
        acc = 0
        while acc < gathered and rnd.random() < av:
            acc += 1
        done += acc + 1
        passes += 1
    return {"tokens_per_pass": done / passes, "speedup": plain_time(c, L) * done / t}


def break_even(c: dict, L: int, Ld: int, gamma: int, K: int | None) -> float | None:
    lo, hi = 0.0, 0.999
    if self_spec(c, L, Ld, hi, gamma, K)["speedup"] < 1:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        if self_spec(c, L, Ld, mid, gamma, K)["speedup"] < 1:
            lo = mid
        else:
            hi = mid
    return hi


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="cost_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="hispec checkpoint or base model folder")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--draft-layer", type=int, default=None, help="default: the checkpoint's (or depth/8)")
    p.add_argument("--verify-layer", type=int, default=None, help="default: the checkpoint's (or depth/4)")
    p.add_argument("--context", type=int, default=256, help="KV slots before the measured rows")
    p.add_argument("--vocab-sizes", default="8192,16384")
    p.add_argument("--gammas", default="1,2,3,4,5")
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--agreement", default=None,
                   help="measured a_d,a_v (draft vs L_i, verifier vs L) to predict speedups for, e.g. 0.38,0.41")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json-out", default=None)
    p.add_argument("--plot", default=None, help="PNG: predicted self-spec speedup vs draft agreement")
    args = p.parse_args(argv)

    import torch

    import hispec

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model = hispec.load(args.model, dtype=args.dtype)
    except hispec.CheckpointError:
        model = hispec.EarlyExitModel.from_base(args.model, args.draft_layer, args.verify_layer, "linear",
                                                dtype=args.dtype)
    L = model.num_layers
    Ld = args.draft_layer or model.draft_layer
    Li = args.verify_layer or model.verify_layer
    Ks = [int(k) for k in args.vocab_sizes.split(",") if k]
    gammas = [int(g) for g in args.gammas.split(",")]
    print(f"measuring unit costs ({args.dtype}, {torch.get_num_threads()} threads, context {args.context})...",
          file=sys.stderr)
    c = measure(model, rows=sorted({1, 2, 4, 5, 8} | {g + 1 for g in gammas} | {args.window + 1}),
                context=args.context, vocab_sizes=Ks, repeats=args.repeats)
    ms = lambda s: f"{s * 1e3:7.3f}"  # noqa: E731
    print(f"\nunit costs, ms (median of {args.repeats}); model {L} layers, hidden {model.adapter.hidden_size}, "
          f"vocabulary {model.adapter.vocab_size}")
    cols = sorted(c["layer"])
    print(f"{'rows':>22} " + " ".join(f"{t:>7d}" for t in cols))
    print(f"{'decoder layer':>22} " + " ".join(ms(c['layer'][t]) for t in cols))
    print(f"{'lm_head full':>22} " + " ".join(ms(c['proj_full'][t]) for t in cols))
    for K in Ks:
        print(f"{f'lm_head {K} rows':>22} " + " ".join(ms(c['proj'][K][t]) for t in cols))
    print(f"{'head body':>22} " + " ".join(ms(c['head_body'][t]) for t in cols))
    print(f"full lm_head = {c['proj_full'][1] / c['layer'][1]:.1f} layers; "
          + "; ".join(f"{K} rows = {c['proj'][K][1] / c['layer'][1]:.1f} layers" for K in Ks)
          + f"; plain step = {plain_time(c, L) * 1e3:.2f} ms")
    print(f"\nself-spec at L_d={Ld}: break-even draft agreement (speedup 1.0)")
    print(f"{'gamma':>6} {'full vocab':>11} " + " ".join(f"{f'{K} vocab':>11}" for K in Ks))
    be = {}
    for gmm in gammas:
        row = [break_even(c, L, Ld, gmm, None)] + [break_even(c, L, Ld, gmm, K) for K in Ks]
        be[gmm] = row
        print(f"{gmm:>6} " + " ".join(f"{'never' if v is None else f'{v:.2f}':>11}" for v in row))
    result = {"model": str(args.model), "dtype": args.dtype, "threads": torch.get_num_threads(), "layers": L,
              "draft_layer": Ld, "verify_layer": Li,
              "unit_costs_ms": {k: ({str(t): v * 1e3 for t, v in c[k].items()} if k != "proj" else
                                    {str(K): {str(t): v * 1e3 for t, v in d.items()} for K, d in c[k].items()})
                                for k in c},
              "break_even_self_spec": {str(gmm): dict(zip(["full"] + [str(K) for K in Ks], be[gmm])) for gmm in gammas}}
    if args.agreement:
        a_d, a_v = (float(x) for x in args.agreement.split(","))
        print(f"\npredicted at a_d={a_d} (draft exit), a_v={a_v} (verifier exit), window {args.window}:")
        print(f"{'gamma':>6} {'vocab':>7} {'self-spec tok/pass':>19} {'x plain':>8} {'hispec tok/pass':>16} {'x plain':>8}")
        pred = []
        for gmm in gammas:
            for K in [None] + Ks:
                s = self_spec(c, L, Ld, a_d, gmm, K)
                # in hispec the draft is checked by L_i: use the draft's agreement with L_i ~ a_d as a proxy
                h = hierarchy(c, L, Ld, Li, a_d, a_v, gmm, args.window, K, K)
                pred.append({"gamma": gmm, "vocab": K, "self_spec": s, "hispec": h})
                print(f"{gmm:>6} {K or 'full':>7} {s['tokens_per_pass']:>19.2f} {s['speedup']:>8.2f} "
                      f"{h['tokens_per_pass']:>16.2f} {h['speedup']:>8.2f}")
        result["predicted"] = {"a_d": a_d, "a_v": a_v, "window": args.window, "rows": pred}
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        xs = [i / 100 for i in range(0, 96)]
        fig, ax = plt.subplots(figsize=(6, 4))
        for K in [None] + Ks:
            ax.plot(xs, [self_spec(c, L, Ld, a, 3, K)["speedup"] for a in xs], label=f"vocab {K or 'full'}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("draft agreement (per token)")
        ax.set_ylabel("predicted speedup vs plain")
        ax.set_title(f"self-spec, L_d={Ld}, gamma=3 ({args.dtype})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    from hispec.io import emit_result

    return emit_result(result, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
