"""Head quality across training runs: one table, per-category agreement, curves, from `hispec-probe --eval-heads`.

    python tools/research/head_report.py \
        --run "30k linear"  runs/eval/s1.json      runs/s1-heads \
        --run "328k linear" runs/eval/shipped.json recipes/artifacts/smollm2-135m \
        --run "655k layer"  runs/eval/layer.json   runs/full-layer \
        --plot head_quality.png --json-out head_quality.json

Each `--run LABEL EVAL_JSON [TRAIN_DIR]` names one `hispec-probe --model CKPT --eval-heads ... --json-out EVAL_JSON`
result (all runs should be measured on the same held-out answers: same --eval-data / --max-eval-prompts /
--max-new-tokens, which this tool checks through the scored-token count) and, optionally, the `train/heads.py`
output folder the checkpoint was exported from (its `hispec_train.json` gives the head type, training tokens,
steps and training time). EVAL_JSON may also be a training run's own `metrics.json` (or the run folder holding
it; its `hispec_train.json` is then read too): its final held-out evaluation, which is how `context` heads are
measured (they read the final layer's states of verified positions, so agreement depends on the distance d to the
verified frontier: `train/heads.py` evaluates d = 1..4). Runs of one report must come from the same held-out tokens
(the same data settings), so compare metrics.json runs with each other and probe results with each other.

Prints one table (draft / verifier top-1 and top-5 agreement with the final layer's argmax, expected tokens per
full pass, the hierarchy figure "verifier agrees with the draft"; where a run has per-distance numbers, each
agreement cell reads `d=1 / d=2 / d=3 / d=4` and distance-independent heads show one number), a per-category table
of draft / verifier top-1 (probe results), and ends with one JSON line. `--plot` renders agreement vs training
tokens (log scale, one marker per head type), agreement vs frontier distance when a run has it (flat lines for
heads that do not read the context), and per-category agreement of every run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


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


def _metrics_run(label: str, path: Path, m: dict, train_dir) -> dict:
    """A train/heads.py metrics.json (its final evaluation) as a run of this report."""
    final = m.get("final")
    if not isinstance(final, dict) or not all(isinstance(final.get(k), dict) for k in ("draft", "verify")):
        raise ReportError(f"{path} has no final evaluation (the run had no held-out data, or did not finish)")
    if train_dir is None and (path.parent / "hispec_train.json").is_file():
        train_dir = path.parent
    train = train_info(train_dir) if train_dir is not None else None
    exits = [final[k] for k in ("draft", "verify")]
    hispec_exits = {}
    if train_dir is not None:
        h = _load_json(Path(train_dir) / "hispec_train.json", "training record").get("hispec", {})
        if isinstance(h.get("exits"), list):
            hispec_exits = {e.get("name"): e for e in h["exits"]}
    ht = [e.get("head_type") or (train or {}).get("head_type") or "?" for e in exits]
    dv = final.get("draft_verify")
    run = {"label": label, "eval": str(path), "source": "metrics.json",
           "layers": [e.get("layer") for e in exits], "head_types": ht,
           "vocab_sizes": [e.get("vocab_size", hispec_exits.get(k, {}).get("vocab_size"))
                           for k, e in zip(("draft", "verify"), exits)],
           "top1": [e["top1_agreement"] for e in exits], "top5": [e.get("top5_agreement") for e in exits],
           "tokens_per_pass": [e.get("expected_tokens_per_round") for e in exits], "gamma": final.get("gamma"),
           "verify_agrees_draft": dv.get("top1_agreement") if isinstance(dv, dict) else None,
           "eval_tokens": final.get("eval_tokens"), "categories": {}, "train": train}
    for kind, key in (("by_distance", "by_distance"), ("by_distance_mid1", "by_distance_mid1")):
        if any(kind in e for e in exits):
            run[key] = {name: {d: [v["top1_agreement"], v.get("top5_agreement")] for d, v in e[kind].items()}
                        for name, e in zip(("draft", "verify"), exits) if kind in e}
    return run


def load_run(label: str, eval_json: str | Path, train_dir: str | Path | None = None) -> dict:
    path = Path(eval_json)
    if path.is_dir():
        path = path / "metrics.json"
    r = _load_json(path, "eval result")
    if "final" in r and "history" in r:
        return _metrics_run(label, path, r, train_dir)
    if r.get("mode") != "eval-heads":
        raise ReportError(f"{eval_json} is neither an `hispec-probe --eval-heads --json-out` result nor a "
                          "train/heads.py metrics.json")
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


def _vocab(v) -> str:
    return "full" if v is None else f"{v:,}"


def distances(runs: list[dict]) -> list[str]:
    """The frontier distances any run was evaluated at (as strings, sorted numerically)."""
    ds = {d for r in runs for by in (r.get("by_distance") or {}).values() for d in by}
    return sorted(ds, key=int)


def _cell(r: dict, j: int, which: int, ds: list[str], kind: str = "by_distance") -> str:
    """One agreement cell: `d=1 / d=2 / ...` for a run evaluated per distance, else its one number."""
    name = ("draft", "verify")[j]
    by = (r.get(kind) or {}).get(name)
    if by and ds:
        return " / ".join(_f(by[d][which]) if d in by else "-" for d in ds)
    if kind != "by_distance":
        return "-"
    return _f((r["top1"], r["top5"])[which][j])


def format_tables(runs: list[dict]) -> str:
    ds = distances(runs)
    per_d = f" (d={'/'.join(ds)})" if ds else ""
    mid = any(r.get("by_distance_mid1") for r in runs)
    head = (f"| run | head type | training tokens | steps | train min | vocab (draft / verify) | draft top-1{per_d} | "
            f"verify top-1{per_d} | draft top-5{per_d} | verify top-5{per_d} | "
            + (f"draft top-1, mid 1{per_d} | " if mid else "") + "tok / pass (draft, γ) | verify = draft |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        t = r["train"] or {}
        ht = r["head_types"][0] + (f" + LoRA r{t['lora_rank']}" if t.get("lora_rank") else "")
        lines.append(
            f"| {r['label']} | {ht} | {_f(t.get('train_tokens'), '{:,}')} | {_f(t.get('steps'), '{}')} | "
            f"{_f(t.get('train_minutes'), '{}')} | {_vocab(r['vocab_sizes'][0])} / {_vocab(r['vocab_sizes'][1])} | "
            f"{_cell(r, 0, 0, ds)} | {_cell(r, 1, 0, ds)} | {_cell(r, 0, 1, ds)} | {_cell(r, 1, 1, ds)} | "
            + (f"{_cell(r, 0, 0, ds, 'by_distance_mid1')} | " if mid else "")
            + f"{_f(r['tokens_per_pass'][0], '{:.2f}')} (γ{r['gamma']}) | {_f(r['verify_agrees_draft'])} |")
    if ds:
        lines += ["", f"d: distance to the verified frontier (final-layer states of positions <= t - d are read); a "
                      f"single number: a head that reads no context. Context heads' tok / pass uses their agreement "
                      f"at distances drawn as in training."]
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

    ds = distances(runs)
    cats = sorted({c for r in runs for c in r["categories"]})
    panels = 1 + bool(ds) + bool(cats or not ds)
    fig = Figure(figsize=(6.5 * panels, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, panels, 1)
    markers = {"linear": "o", "layer": "s", "lowrank": "^", "norm": "v", "shared": "x", "context": "D"}
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
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    if ds:  # agreement vs distance to the verified frontier: context heads rise towards d=1, others stay flat
        axd = fig.add_subplot(1, panels, 2)
        xs = [int(d) for d in ds]
        for k, r in enumerate(runs):
            for j, exit_name in enumerate(("draft", "verify")):
                by = (r.get("by_distance") or {}).get(exit_name)
                ys = [by[d][0] if d in by else math.nan for d in ds] if by else [r["top1"][j]] * len(xs)
                axd.plot(xs, ys, marker=markers.get(r["head_types"][j], "o"), color=f"C{k}",
                         fillstyle="full" if j == 0 else "none", linestyle="-" if j == 0 else "--",
                         label=f"{r['label']} {exit_name} L{r['layers'][j]}")
            mid = (r.get("by_distance_mid1") or {}).get("draft")
            if mid:
                axd.plot(xs, [mid[d][0] if d in mid else math.nan for d in ds], marker="*", color=f"C{k}",
                         linestyle=":", label=f"{r['label']} draft, verifier states at distance 1")
        axd.set_xticks(xs)
        axd.set_xlabel("distance d to the verified frontier (final-layer states read up to t - d)")
        axd.set_ylabel("held-out top-1 agreement with the final layer")
        axd.set_ylim(0, 1)
        axd.grid(alpha=0.3)
        axd.set_title("agreement vs frontier distance (solid: draft, dashed: verifier)", fontsize=9)
        axd.legend(fontsize=6)
    if not (cats or not ds):
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(str(out))
        return out
    ax2 = fig.add_subplot(1, panels, panels)
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
    def line(r):
        out = {"label": r["label"], "head_type": r["head_types"][0],
               "train_tokens": (r["train"] or {}).get("train_tokens"),
               "draft_top1": round(r["top1"][0], 4), "verify_top1": round(r["top1"][1], 4),
               "tokens_per_pass": round(r["tokens_per_pass"][0], 3)}
        for name, by in (r.get("by_distance") or {}).items():
            out[f"{name}_top1_by_distance"] = {d: round(v[0], 4) for d, v in by.items()}
        return out

    summary = {"runs": [line(r) for r in runs], "eval_tokens": runs[0]["eval_tokens"]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
