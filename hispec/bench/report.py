"""The benchmark's output: `format_table(summary)` (fixed-width text) and `plot(summary, path)` (a PNG of speedup by
category and strategy; matplotlib, imported when called: an optional dependency)."""

from __future__ import annotations

import os
from pathlib import Path

from .. import packed
from .runner import STAGES
from .summary import Summary


# ---------------------------------------------------------------------------------------------------- output
def _f(v, fmt: str = "{:.2f}", none: str = "-") -> str:
    return none if v is None else fmt.format(v)


def format_table(summary: Summary) -> str:
    """Fixed-width text: one row per strategy, then speedup vs hf and identity per category."""
    m, hw = summary.model_info, summary.hardware
    cfg = summary.config
    sw = max(17, *(len(n) + 2 for n in [*summary.strategies, *summary.failed, *summary.skipped]))  # strategy column
    lines = [
        f"model {m['name_or_path']} ({m['num_layers']} layers, exits {m['draft_layer']}/{m['verify_layer']}, "
        f"{m['head_type']} heads, {m['dtype']}); {len(summary.per_prompt)} prompts x {cfg.max_new_tokens} new tokens, "
        f"{'greedy' if cfg.greedy else f'temperature {cfg.temperature}'}, repeats {cfg.repeats}",
        f"linear kernels: {m.get('linear', '?')}" + ("" if not m.get("packed_time_ratio") else
                                                     f" (forward time over stock kernels here: "
                                                     f"{packed.describe_ratios(m['packed_time_ratio'])})"),
        f"{hw['cpu']}, {hw['threads']} threads, torch {hw['torch']}, transformers {hw['transformers']}",
        "",
        f"{'strategy':<{sw}}{'tok/s':>8}{'vs hf':>8}{'vs s-s':>8}{'tok/pass':>9}{'acc L_i':>8}{'acc L':>7}"
        f"{'layers/tok':>11}  {'time % pre/draft/verify/target/other':<37}{'identical':>10}{'~ties':>7}",
    ]
    for s in summary.strategies.values():
        share = "-" if s.engine else "/".join(f"{100 * s.time_share[k]:.0f}" for k in STAGES)
        lines.append(
            f"{s.strategy:<{sw}}{_f(s.tokens_per_s, '{:.1f}'):>8}{_f(s.speedup_vs_hf, '{:.2f}x'):>8}"
            f"{_f(s.speedup_vs_self_spec, '{:.2f}x'):>8}{_f(s.tokens_per_target_pass):>9}"
            f"{_f(s.verify_acceptance):>8}{_f(s.target_acceptance):>7}{_f(s.layer_evals_per_token, '{:.1f}'):>11}"
            f"  {share:<37}{_f(s.identical):>10}{_f(s.identical_up_to_ties):>7}"
        )
    for name, why in summary.failed.items():
        lines.append(f"{name:<{sw}}FAILED (not timed): {why[:300]}")
    for name, why in summary.skipped.items():
        lines.append(f"{name:<{sw}}skipped (not installed): {why[:300]}")
    lines += _engines(summary, sw)
    names = list(summary.strategies)
    preds = [s for s in summary.strategies.values() if s.predicted_speedup_vs_ar is not None]
    if preds:
        hw = max(26, *(len(s.hierarchy or "-") + 2 for s in preds))  # e.g. "auto:ngram|L4>full[tree 5]" in full
        lines += ["", "latency model vs measured, speedup over ar: predicted from the checkpoint's calibration, and "
                  "from this run's own acceptance rates (the cost model alone)",
                  f"{'strategy':<{sw}}{'hierarchy':<{hw}}{'measured':>9}{'pred cal':>9}{'error':>8}{'pred obs':>9}"
                  f"{'error':>8}{'plain %':>8}  observed acceptance"]
        for s in preds:
            obs = ", ".join(f"{k} {v:.2f}" for k, v in (s.observed_acceptance or {}).items() if v is not None)
            lines.append(f"{s.strategy:<{sw}}{s.hierarchy or '-':<{hw}}{_f(s.speedup_vs_ar, '{:.2f}x'):>9}"
                         f"{_f(s.predicted_speedup_vs_ar, '{:.2f}x'):>9}{_f(s.prediction_error, '{:+.0%}'):>8}"
                         f"{_f(s.predicted_speedup_observed, '{:.2f}x'):>9}{_f(s.prediction_error_observed, '{:+.0%}'):>8}"
                         f"{_f(None if s.plain_share is None else 100 * s.plain_share, '{:.0f}'):>8}  {obs}")
    pairs = [s for s in summary.strategies.values() if s.speedup_vs_token is not None]
    if pairs:
        lines += ["", "sequence-level (hsd) vs token-wise verification of the same strategy",
                  f"{'strategy':<{sw}}{'tok/pass':>9}{'vs token':>9}{'tok/s':>8}{'vs token':>9}"]
        for s in pairs:
            lines.append(f"{s.strategy:<{sw}}{_f(s.tokens_per_target_pass):>9}"
                         f"{_f(s.tokens_per_target_pass_vs_token, '{:.3f}x'):>9}{_f(s.tokens_per_s, '{:.1f}'):>8}"
                         f"{_f(s.speedup_vs_token, '{:.3f}x'):>9}")
    width = max(12, *(len(n) + 2 for n in names))
    lines += ["", "speedup vs hf (identical share) by category", f"{'category':<16}{'n':>3}  "
              + "".join(f"{n:>{width}}" for n in names)]
    for c, d in sorted(summary.categories.items()):
        cells = []
        for n in names:
            x = d["strategies"][n]
            ident = "" if x["identical"] is None else f" ({x['identical']:.1f})"
            cells.append(f"{_f(x['speedup_vs_hf'], '{:.2f}x') + ident:>{width}}")
        lines.append(f"{c[:15]:<16}{d['prompts']:>3}  " + "".join(cells))
    lines.append("")
    if summary.lossless is None:
        lines.append("lossless: n/a (sampling: outputs are compared in distribution by the tests, not here)")
    else:
        lines.append(f"lossless (every strategy's new tokens identical to {summary.reference}'s): "
                     + ("yes" if summary.lossless else "NO"))
        lines.append(f"lossless up to rounding ties (first divergence at an fp32 logit margin <= "
                     f"{summary.tie_tolerance:g}, or within 2 units in the last place of the model's own dtype): "
                     + ("yes" if summary.lossless_up_to_ties else "NO"))
        lossy = {n for n, s in summary.strategies.items() if s.lossy}
        diverged = [(p["index"], n, f["first_mismatch"], f["mismatch_margin"], f.get("mismatch_own_margin"))
                    for p in summary.per_prompt for n, f in p["strategies"].items()
                    if not f.get("identical", True) and n not in lossy]
        for i, n, k, margin, own in diverged[:12]:
            lines.append(f"  prompt {i}: {n} left {summary.reference} at new token {k}, fp32 margin "
                         f"{_f(margin, '{:+.3f}')}, own-dtype margin {_f(own, '{:+.3f}')}")
        if len(diverged) > 12:
            lines.append(f"  ... and {len(diverged) - 12} more (see --json-out)")
    return "\n".join(lines)


def _engines(summary: Summary, sw: int) -> list[str]:
    """What each other engine's row ran (hispec.bench.peers): version, CPU features, file, start-up, acceptance."""
    rows = [s for s in summary.strategies.values() if s.engine]
    if not rows:
        return []
    lines = ["", "other engines (same prompt token ids, greedy, same EOS; tok/s of a batch row is its throughput)"]
    for s in rows:
        e = s.engine
        parts = [e.get("version", "?"), e.get("mode")]
        if e.get("cpu_features"):
            parts.append(f"CPU {e['cpu_features']}")
        if e.get("gguf_type"):
            parts.append(f"GGUF {e['gguf_type']}" + (" (quantised: identity not claimed)" if s.lossy else ""))
        if e.get("speculative"):
            sp = e["speculative"]
            parts.append(f"{sp['method']} k={sp['num_speculative_tokens']} ({sp['model']})")
        if e.get("acceptance_by_position"):
            parts.append("acceptance by position " + " / ".join(f"{a:.2f}" for a in e["acceptance_by_position"])
                         + f", mean acceptance length {e['mean_acceptance_length']:.2f}")
        if e.get("start_seconds") is not None:
            parts.append(f"start-up {e['start_seconds']:g} s")
        lines.append(f"{s.strategy:<{sw}}" + "; ".join(p for p in parts if p))
    return lines


def plot(summary: Summary, path: str | os.PathLike) -> Path:
    """Grouped bars: speedup vs hf per category (and overall) for every strategy but hf."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [s for s in summary.strategies if s != "hf"]
    if "hf" not in summary.strategies or not names:
        raise ValueError("--plot needs 'hf' and at least one other strategy (it plots speedup vs hf)")
    cats = sorted(summary.categories) + ["all"]
    fig = Figure(figsize=(max(6.0, 0.6 * len(cats) + 0.08 * len(cats) * len(names) + 2), 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        vals = [summary.categories[c]["strategies"][n]["speedup_vs_hf"] for c in cats[:-1]]
        vals.append(summary.strategies[n].speedup_vs_hf)
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(cats))]
        ax.bar(xs, [v or 0.0 for v in vals], width=width, label=n)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(cats)))
    ax.set_xticklabels(cats, rotation=30, ha="right")
    ax.set_ylabel("speedup vs hf (median of per-prompt ratios)")
    m = summary.model_info
    ax.set_title(f"{Path(str(m['name_or_path'])).name}, {m['dtype']}, {summary.config.max_new_tokens} tokens, "
                 f"{summary.hardware['threads']} threads", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
