"""The plans the latency model recommends, and the tables of predictions the tools print.

Contract: `auto_plan(cal)` is the latency-optimal speculative plan `strategy="auto"` decodes with (the best chain
of `best_hierarchy`, or a static tree of `best_tree` where one is predicted faster); the decoder, the bench's
prediction and `calibrate`'s n-gram choice all plan through it. `named_hierarchies` maps the decoder's strategy
names to level lists, `predictions` prices each at its best gammas (then fixed ones, the best tree and the best
hierarchy), and `format_predictions` renders those rows as a table headed by the machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from .calibration import Calibration
from .levels import EAGLE, FULL, LOOKUP, NGRAM, gate_key, level_name, pair_key
from .model import DEFAULT_MAX_GAMMA, _best_chain, best_hierarchy, plain_seconds_per_token, time_per_token
from .trees import best_tree


@dataclass(frozen=True)
class AutoPlan:
    """`strategy="auto"`'s plan in calibration level names: a chain (`levels` bottom-up, `gammas`) or, with
    `widths`, a static tree drafted by `levels[0]` (an exit or the drafter, or lookup-first) under the full model."""

    levels: tuple[str, ...]
    gammas: tuple[int, ...]
    widths: tuple[int, ...] | None
    seconds_per_token: float


def auto_plan(cal: Calibration, *, trees: bool = True, max_depth: int = 5) -> AutoPlan:
    """The latency-optimal speculative plan `auto` decodes with (rows may still decode plainly): the best chain
    hierarchy over the n-gram, the lookup-first exits and drafter (where the n-gram was measured), the exits and
    the EAGLE-3 drafter (where the calibration measured one: `Calibration.has_drafter`)
    (`best_hierarchy(speculative_only=True)`), unless `trees` and a static tree with some width > 1 (`best_tree`,
    drafted by an exit, lookup-first where the n-gram was measured; never deeper than `max_depth`) is predicted
    faster (trees drafted by the drafter too, `hispec.decoding.eagle_tree`). Needs the calibration's top-k rates
    for trees (made since tree drafts were modelled). The decoder
    (`hispec.decoding._auto_plan`), the bench's prediction and `calibrate`'s n-gram choice all plan through here."""
    exits = [level_name(e) for e in sorted(int(name[1:]) for name in cal.costs.get("head", {}))]
    drafter = [EAGLE] if cal.has_drafter else []  # an EAGLE-3 drafter, where the calibration measured it
    measured = cal.acceptance.get(pair_key(NGRAM, FULL)) is not None and cal.costs.get("ngram") is not None
    lookups = [NGRAM] + [LOOKUP + e for e in drafter + exits] if measured else []
    choice = best_hierarchy(cal, candidates=lookups + drafter + exits, speculative_only=True)
    best = AutoPlan(tuple(choice.levels), tuple(choice.gammas), None,
                    time_per_token(list(choice.levels), list(choice.gammas), cal))
    if not trees or not cal.topk or max_depth < 1:
        return best
    for level in exits + drafter:  # static trees drafted by an exit or by the drafter
        if not cal.topk.get(pair_key(level, FULL)):
            continue
        for lookup in (False, True) if measured else (False,):
            widths, t = best_tree(cal, level, max_depth=max_depth, lookup=lookup)
            if widths and max(widths) > 1 and t < best.seconds_per_token:
                best = AutoPlan((LOOKUP + level if lookup else level, FULL), (), tuple(widths), t)
    return best


def named_hierarchies(cal: Calibration) -> dict[str, list[str]]:
    """The hierarchies the tools report, by the decoder's strategy names (where the calibration has the levels)."""
    exits = cal.model.get("exits", {})
    d, v = (level_name(exits[k]) if k in exits else None for k in ("draft", "verify"))
    out = {"ar": [FULL]}
    if d:
        out["self-spec"] = [d, FULL]
    if d and v:
        out["hispec"] = [d, v, FULL]
    if NGRAM in cal.levels:
        out["ngram"] = [NGRAM, FULL]
        if d:
            out["ngram>L_d"] = [NGRAM, d, FULL]
            out["self-spec-lookup"] = [LOOKUP + d, FULL]
        if d and v:
            out["hispec-lookup"] = [LOOKUP + d, v, FULL]
    if cal.has_drafter:
        out["eagle"] = [EAGLE, FULL]
        if NGRAM in cal.levels:
            out["eagle-lookup"] = [LOOKUP + EAGLE, FULL]
    return out


def predictions(cal: Calibration, max_gamma: int = DEFAULT_MAX_GAMMA, fixed: dict | None = None) -> list[dict]:
    """One row per named hierarchy at its best gammas, then each of `fixed` ({label: (levels, gammas)}, e.g. the
    checkpoint's defaults), then "best" (`best_hierarchy`): name, levels, gammas, seconds/token, tok/s, speedup."""
    rows = []
    plain = plain_seconds_per_token(cal)

    def row(name, levels, gammas, t):
        return {"name": name, "levels": list(levels), "gammas": list(gammas), "seconds_per_token": t,
                "tokens_per_second": 1 / t, "speedup_vs_plain": plain / t}

    full_chains = cal.with_gate(0)  # (the named strategies run the drafter's full chains)
    named = [(name, levels, full_chains) for name, levels in named_hierarchies(cal).items()]
    if cal.drafter_gate > 0:  # and with the gate the calibration chose, as `auto` runs them
        named += [(f"{name}-gate:{gate_key(cal.drafter_gate)}", levels, cal) for name, levels, _ in named
                  if name in ("eagle", "eagle-lookup")]
    for name, levels, c in named:
        t, gm = (plain, []) if levels == [FULL] else _best_chain(c, levels, None, cal.ngram_match, max_gamma)
        rows.append(row(name, levels, gm, t))
    for name, (levels, gammas) in (fixed or {}).items():
        rows.append(row(name, levels, gammas, time_per_token(levels, gammas, cal)))
    d = cal.model.get("exits", {}).get("draft")
    if d is not None and cal.topk and pair_key(level_name(d), FULL) in cal.topk:  # static trees (hispec.decoding.tree)
        widths, t = best_tree(cal)
        rows.append({**row("tree " + "x".join(map(str, widths)), [level_name(d), FULL], [], t), "tree": widths})
    b = best_hierarchy(cal, max_gamma=max_gamma)
    rows.append(row("best", b.levels, b.gammas, b.seconds_per_token))
    return rows


def format_predictions(cal: Calibration, rows: list[dict]) -> str:
    """Fixed-width table of `predictions(...)` rows, headed by the machine."""
    w = max([len(r["name"]) for r in rows] + [9]) + 2
    lines = [f"latency model, calibrated on {cal.describe_machine()}; context {cal.context} slots", "",
             f"{'hierarchy':<{w}}{'levels':<22}{'gammas':<9}{'ms/token':>9}{'tok/s':>8}{'vs plain':>9}"]
    for r in rows:
        lines.append(f"{r['name']:<{w}}{'>'.join(r['levels']):<22}{','.join(map(str, r['gammas'])) or '-':<9}"
                     f"{r['seconds_per_token'] * 1e3:>9.2f}{r['tokens_per_second']:>8.1f}"
                     f"{r['speedup_vs_plain']:>8.2f}x")
    acc = ", ".join(f"{k} {v:.2f}" for k, v in cal.acceptance.items())
    lines += ["", f"acceptance (per token, greedy): {acc}; n-gram match {cal.ngram_match:.2f}"]
    if cal.ngram_options:
        plain = plain_seconds_per_token(cal)
        opts = ", ".join(f"{_ngram_label(o['config'])} {plain / o['seconds_per_token']:.2f}x"
                         for o in cal.ngram_options)
        lines.append(f"n-gram config {_ngram_label(cal.ngram)} chosen by auto's predicted speedup ({opts})")
    if cal.drafter_gates:
        plain = plain_seconds_per_token(cal)
        full = auto_plan(cal.with_gate(0)).seconds_per_token
        opts = ", ".join([f"0 {plain / full:.2f}x"] + [f"{k} {plain / o['seconds_per_token']:.2f}x (pass "
                                                        f"{o['pass']:.2f}, acceptance {o['acceptance']:.2f})"
                                                        for k, o in cal.drafter_gates.items()
                                                        if "seconds_per_token" in o])
        lines.append(f"drafter confidence gate {gate_key(cal.drafter_gate)} chosen by auto's predicted speedup "
                     f"({opts})")
    return "\n".join(lines)


def _ngram_label(cfg: dict) -> str:
    return f"n={cfg['min_ngram']}..{cfg['max_ngram']}, <= {cfg['max_len']} tokens"
