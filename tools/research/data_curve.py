"""EAGLE-3 drafter agreement against training data: the data curve of drafters trained on growing data.

    python tools/drafter_eval.py --run runs/curve/140k --num-prompts 40 --max-new-tokens 128 --dtype bf16 \
        --threads 1 --json-out runs/curve/140k.eval.json        # (the same command for every drafter)
    python tools/research/data_curve.py --point runs/curve/140k.eval.json runs/curve/140k \
        --point runs/curve/570k.eval.json runs/smollm2-135m-eagle3 --plot data_curve.png --json-out curve.json

Each `--point EVAL_JSON RUN_DIR` is one drafter: `tools/drafter_eval.py`'s result on held-out prompts and the
drafter's training run (its `hispec_drafter.json` says how many tokens it trained on, for how many steps). Every
point must be scored on the same held-out answers (same prompts file, number of prompts, new tokens and dtype:
checked). Prints a table ordered by training tokens (tokens, steps, epochs over the data, top-1 per draft step,
chained agreement, expected accepted drafts per round, and top-1 at step 0 per category), renders the curve with
`--plot` (top-1 at step 0 and accepted drafts per round against training tokens, log scale; per category as
thin lines) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SAME = ("prompts", "num_prompts", "max_new_tokens", "dtype")


class CurveError(ValueError):
    """Bad input; the message names the file."""


def _read(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CurveError(f"{path}: {e}") from e


def load_point(eval_json, run_dir) -> dict:
    """One drafter's scores and training facts."""
    ev = _read(eval_json)
    meta = _read(Path(run_dir) / "hispec_drafter.json")
    if "overall" not in ev or "by_category" not in ev:
        raise CurveError(f"{eval_json} is not a tools/drafter_eval.py result (no 'overall' / 'by_category')")
    data = meta.get("data") or {}
    tokens = (data.get("feature_cache") or {}).get("train_tokens")
    if not tokens:
        raise CurveError(f"{run_dir}/hispec_drafter.json records no training tokens (data.feature_cache.train_tokens)")
    steps = int(meta.get("steps") or 0)
    seqs = (meta.get("args") or {}).get("per_device_train_batch_size", 0) * int(data.get("world_size") or 1)
    examples = int(data.get("train_examples") or 0)
    return {"run": str(run_dir), "eval": str(eval_json), "train_tokens": int(tokens), "steps": steps,
            "epochs": round(steps * seqs / examples, 2) if examples and seqs else None,
            "train_seconds": meta.get("train_seconds"), "overall": ev["overall"],
            "by_category": {c: v["top1"][0] for c, v in ev["by_category"].items()},
            "same": {k: ev.get(k) for k in SAME}}


def build(points: list[dict]) -> list[dict]:
    if not points:
        raise CurveError("give at least one --point EVAL_JSON RUN_DIR")
    first = points[0]["same"]
    for p in points[1:]:
        diff = {k: (first[k], p["same"][k]) for k in SAME if first[k] != p["same"][k]}
        if diff:
            raise CurveError(f"{p['eval']} was scored on other held-out answers than {points[0]['eval']}: {diff}")
    return sorted(points, key=lambda p: p["train_tokens"])


def format_table(points: list[dict]) -> str:
    steps = len(points[0]["overall"]["top1"])
    head = (f"{'train tokens':>12} {'steps':>6} {'epochs':>6} " + " ".join(f"{f'top1@{s}':>7}" for s in range(steps))
            + " " + " ".join(f"{f'chain@{s}':>8}" for s in range(steps)) + f" {'acc/round':>9}")
    lines = [head]
    for p in points:
        o = p["overall"]
        lines.append(f"{p['train_tokens']:>12,} {p['steps']:>6} {p['epochs'] if p['epochs'] is not None else '-':>6} "
                     + " ".join(f"{x:>7.3f}" for x in o["top1"]) + " " + " ".join(f"{x:>8.3f}" for x in o["chain"])
                     + f" {o['accepted_per_round']:>9.3f}")
    cats = sorted(points[0]["by_category"])
    lines += ["", "top-1 at step 0 by category", f"{'category':<16}" + "".join(f"{p['train_tokens']:>12,}" for p in points)]
    for c in cats:
        lines.append(f"{c:<16}" + "".join(f"{p['by_category'].get(c, float('nan')):>12.3f}" for p in points))
    return "\n".join(lines)


def plot(points: list[dict], out) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax, bx = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    x = [p["train_tokens"] for p in points]
    for c in sorted(points[0]["by_category"]):
        ax.plot(x, [p["by_category"].get(c) for p in points], lw=0.8, alpha=0.5, marker=".", label=c)
    ax.plot(x, [p["overall"]["top1"][0] for p in points], lw=2.5, color="black", marker="o", label="all")
    ax.set(xscale="log", xlabel="training tokens", ylabel="top-1 agreement, draft step 0",
           title="drafter agreement vs data (held-out prompts)")
    ax.legend(fontsize=6, ncol=2)
    bx.plot(x, [p["overall"]["accepted_per_round"] for p in points], lw=2, marker="o")
    bx.set(xscale="log", xlabel="training tokens", ylabel="expected accepted drafts per round",
           title="chained agreement summed over draft steps")
    fig.tight_layout()
    fig.savefig(str(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--point", nargs=2, action="append", metavar=("EVAL_JSON", "RUN_DIR"), default=[],
                    help="a drafter: its tools/drafter_eval.py result and its training run folder")
    ap.add_argument("--plot", default=None, help="render the curve to this image")
    ap.add_argument("--json-out", default=None, help="also write the JSON line here")
    args = ap.parse_args(argv)
    try:
        points = build([load_point(e, r) for e, r in args.point])
    except CurveError as e:
        print(f"data_curve: {e}", file=sys.stderr)
        return 2
    print(format_table(points))
    if args.plot:
        plot(points, args.plot)
        print(f"plot: {args.plot}")
    line = json.dumps({"points": [{k: v for k, v in p.items() if k != "same"} for p in points],
                       "held_out": points[0]["same"]})
    if args.json_out:
        Path(args.json_out).write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
