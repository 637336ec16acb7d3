"""Head quality across training runs: one table, per-category agreement, curves, from `hispec-probe --eval-heads`.

    python tools/head_report.py \
        --run "30k linear"  runs/eval/s1.json      runs/s1-heads \
        --run "328k linear" runs/eval/shipped.json recipes/artifacts/smollm2-135m \
        --run "655k layer"  runs/eval/layer.json   runs/full-layer \
        --plot head_quality.png --json-out head_quality.json

Each `--run LABEL EVAL_JSON [TRAIN_DIR]` names one `hispec-probe --model CKPT --eval-heads ... --json-out EVAL_JSON`
result (all runs should be measured on the same held-out answers: same --eval-data / --max-eval-prompts /
--max-new-tokens, which this tool checks through the scored-token count) and, optionally, the `train/heads.py`
output folder the checkpoint was exported from (its `hispec_train.json` gives the head type, training tokens,
steps and training time). Prints a table per run (draft / verifier top-1 and top-5 agreement with the final layer's
argmax, expected tokens per full pass, the hierarchy figure "verifier agrees with the draft"), a per-category table
of draft / verifier top-1, and ends with one JSON line. `--plot` renders agreement vs training tokens (log scale,
one marker per head type) and per-category agreement of every run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class ReportError(ValueError):
    """Bad input for the report; the message says which file and what is wrong."""


def _load_json(path: str | Path, what: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ReportError(f"{what} {p} does not exist")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ReportError(f"{what} {p} is not JSON ({e})") from e


def train_info(train_dir: str | Path) -> dict:
    """What a train/heads.py output folder says about its run: head type, tokens, steps, minutes, LoRA rank."""
    d = _load_json(Path(train_dir) / "hispec_train.json", "training record")
    data = d.get("data", {})
    cache = data.get("feature_cache") or {}
    tokens = cache.get("train_loss_tokens") or data.get("train_tokens")
    args = d.get("args", {})
    secs = d.get("train_seconds")
    return {"head_type": data.get("head_type") or d.get("hispec", {}).get("head", {}).get("type"),
            "train_tokens": tokens, "steps": d.get("steps"),
            "train_minutes": None if secs is None else round(secs / 60, 1),
            "lora_rank": args.get("head_lora_rank") or None, "sources": data.get("sources")}


def load_run(label: str, eval_json: str | Path, train_dir: str | Path | None = None) -> dict:
    r = _load_json(eval_json, "eval result")
    if r.get("mode") != "eval-heads":
        raise ReportError(f"{eval_json} is not an `hispec-probe --eval-heads --json-out` result")
    run = {"label": label, "eval": str(eval_json), "layers": r["layers"], "head_types": r["head_types"],
           "vocab_sizes": r["vocab_sizes"], "top1": r["top1"], "top5": r["top5"],
           "tokens_per_pass": r["tokens_per_pass"], "gamma": r["gamma"],
           "verify_agrees_draft": r.get("verify_agrees_draft"), "eval_tokens": r["sizes"]["eval_tokens"],
           "categories": {c: {"tokens": v["tokens"], "top1": v["top1"]} for c, v in r.get("categories", {}).items()},
           "train": None}
    if train_dir is not None:
        run["train"] = train_info(train_dir)
    return run


def check_comparable(runs: list[dict]) -> None:
    counts = {r["eval_tokens"] for r in runs}
    if len(counts) > 1:
        detail = ", ".join(f"{r['label']}: {r['eval_tokens']}" for r in runs)
        raise ReportError(f"the runs were measured on different held-out answers ({detail} scored tokens); "
                          "evaluate every checkpoint with the same --eval-data / --max-eval-prompts / --max-new-tokens")


def _f(v, fmt="{:.3f}"):
    return "-" if v is None else fmt.format(v)


def format_tables(runs: list[dict]) -> str:
    head = ("| run | head type | training tokens | steps | train min | vocab (draft / verify) | draft top-1 | "
            "verify top-1 | draft top-5 | verify top-5 | tok / pass (draft, γ) | verify = draft |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        t = r["train"] or {}
        ht = r["head_types"][0] + (f" + LoRA r{t['lora_rank']}" if t.get("lora_rank") else "")
        lines.append(
            f"| {r['label']} | {ht} | {_f(t.get('train_tokens'), '{:,}')} | {_f(t.get('steps'), '{}')} | "
            f"{_f(t.get('train_minutes'), '{}')} | {r['vocab_sizes'][0]:,} / {r['vocab_sizes'][1]:,} | "
            f"{r['top1'][0]:.3f} | {r['top1'][1]:.3f} | {r['top5'][0]:.3f} | {r['top5'][1]:.3f} | "
            f"{r['tokens_per_pass'][0]:.2f} (γ{r['gamma']}) | {_f(r['verify_agrees_draft'])} |")
    cats = sorted({c for r in runs for c in r["categories"]})
    if cats:
        lines += ["", "top-1 agreement by Spec-Bench category (draft / verify)", "",
                  "| category | tokens | " + " | ".join(r["label"] for r in runs) + " |",
                  "|---|---|" + "---|" * len(runs)]
        for c in cats:
            n = next(r["categories"][c]["tokens"] for r in runs if c in r["categories"])
            cells = [(f"{r['categories'][c]['top1'][0]:.3f} / {r['categories'][c]['top1'][1]:.3f}"
                      if c in r["categories"] else "-") for r in runs]
            lines.append(f"| {c} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], path: str | Path) -> Path:
    """Left: draft (solid markers) and verifier (hollow) top-1 vs training tokens, one marker shape per head
    type. Right: draft top-1 per category for every run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    markers = {"linear": "o", "layer": "s", "lowrank": "^", "norm": "v", "shared": "x"}
    for j, exit_name in enumerate(("draft", "verify")):
        pts = [(r["train"]["train_tokens"], r["top1"][j], r["head_types"][j], r["label"]) for r in runs
               if r["train"] and r["train"].get("train_tokens")]
        for ht in sorted({p[2] for p in pts}):
            sel = sorted((p for p in pts if p[2] == ht), key=lambda p: p[0])
            ax.plot([p[0] for p in sel], [p[1] for p in sel], marker=markers.get(ht, "o"), color=f"C{j}",
                    fillstyle="full" if j == 0 else "none", linestyle="-" if ht == "linear" else "--",
                    label=f"{exit_name} L{runs[0]['layers'][j]} {ht}")
        for r in runs:  # untrained runs (no training record) as horizontal references
            if not r["train"]:
                ax.axhline(r["top1"][j], color=f"C{j}", linestyle=":", alpha=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out top-1 agreement with the final layer")
    ax.set_ylim(0, max(0.5, max(max(r["top1"]) for r in runs) + 0.1))
    ax.grid(alpha=0.3)
    ax.set_title("agreement vs training data (dotted: untrained)", fontsize=9)
    ax.legend(fontsize=7)
    ax2 = fig.add_subplot(1, 2, 2)
    cats = sorted({c for r in runs for c in r["categories"]})
    width = 0.8 / max(1, len(runs))
    for k, r in enumerate(runs):
        xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(cats))]
        ax2.bar(xs, [r["categories"].get(c, {"top1": [math.nan]})["top1"][0] for c in cats], width=width,
                color=f"C{k + 2}", label=r["label"])
    ax2.set_xticks(range(len(cats)))
    ax2.set_xticklabels(cats, rotation=45, ha="right", fontsize=7)
    ax2.set_ylabel("draft top-1 agreement")
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3, axis="y")
    ax2.set_title("draft exit by category", fontsize=9)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(str(out))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="head_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", nargs="+", action="append", required=True, metavar="LABEL EVAL_JSON [TRAIN_DIR]",
                   help="a label, an `hispec-probe --eval-heads --json-out` file and optionally the training folder")
    p.add_argument("--train-tokens", nargs=2, action="append", default=[], metavar=("LABEL", "N"),
                   help="training tokens of a run whose record predates token counting (reported as given)")
    p.add_argument("--plot", default=None, help="write a PNG with the curves")
    p.add_argument("--json-out", default=None, help="also write the full report to this JSON file")
    args = p.parse_args(argv)
    try:
        for spec in args.run:
            if len(spec) not in (2, 3):
                raise ReportError(f"--run takes LABEL EVAL_JSON [TRAIN_DIR], got {spec}")
        runs = [load_run(*spec) for spec in args.run]
        check_comparable(runs)
        by_label = {r["label"]: r for r in runs}
        for label, n in args.train_tokens:
            if label not in by_label or by_label[label]["train"] is None:
                raise ReportError(f"--train-tokens {label}: no --run with that label and a TRAIN_DIR")
            by_label[label]["train"]["train_tokens"] = int(n)
    except ReportError as e:
        p.error(str(e))
    print(format_tables(runs))
    report = {"runs": runs}
    if args.plot:
        report["plot"] = str(plot(runs, args.plot))
        print(f"plot: {report['plot']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    summary = {"runs": [{"label": r["label"], "head_type": r["head_types"][0],
                         "train_tokens": (r["train"] or {}).get("train_tokens"),
                         "draft_top1": round(r["top1"][0], 4), "verify_top1": round(r["top1"][1], 4),
                         "tokens_per_pass": round(r["tokens_per_pass"][0], 3)} for r in runs],
               "eval_tokens": runs[0]["eval_tokens"]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
