"""Level names and the closed forms the latency model shares with the decoder and the calibration (design.md §3.3).

Level names, bottom-up: "ngram" (prompt lookup), "ngram|L4" (lookup first, the exit where it finds nothing),
"eagle3" (the EAGLE-3 drafter), "L<k>" (the exit after decoder layer k), "full" (the model); an acceptance rate is
keyed by its pair, "L4>full". Pure functions of numbers and strings: the lowest module of `hispec.latency`.
"""

from __future__ import annotations

NGRAM, FULL = "ngram", "full"
LOOKUP = "ngram|"  # "ngram|L4": the lookup-first exit level (the n-gram lookup, the exit where it finds nothing)
EAGLE = "eagle3"  # the EAGLE-3 drafter (hispec.drafters.eagle3): a bottom level, verified by "full" only


class CalibrationError(ValueError):
    """A calibration is missing, malformed, or belongs to another model or machine; the message says which."""


# ---------------------------------------------------------------------------------------------- closed forms
def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens from one verification of `gamma` drafts with i.i.d. acceptance `alpha`: the accepted prefix
    plus the verifier's own token, `(1 - alpha^(gamma+1)) / (1 - alpha)`; gamma 0 -> 1, alpha 1 -> gamma + 1."""
    if gamma <= 0:
        return 1.0
    alpha = min(max(float(alpha), 0.0), 1.0)
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def acceptance_from_counts(accepted: int, proposed: int, rejections: int) -> float | None:
    """The i.i.d. maximum-likelihood acceptance rate from verification rounds: `accepted / (accepted + rejections)`.

    A round that checked m proposals and accepted a of them contributes a acceptances and one rejection when
    a < m (a round that accepted all, or whose walk was cut short, is censored: no rejection). `proposed` (the
    tokens put up for verification, >= accepted + rejections) only guards the counts. None when nothing was
    observed (accepted + rejections == 0): no evidence, use a prior such as the calibration's rate."""
    if min(accepted, proposed, rejections) < 0 or accepted + rejections > proposed:
        raise ValueError(f"inconsistent counts: accepted {accepted} + rejections {rejections} > proposed {proposed}")
    n = accepted + rejections
    return accepted / n if n else None


def lookup_exit(level: str) -> str | None:
    """The exit level of a lookup-first level ("ngram|L4" -> "L4"), else None."""
    return level[len(LOOKUP):] if level.startswith(LOOKUP) else None


def is_drafter(level: str) -> bool:
    """Whether `level` drafts with the EAGLE-3 drafter ("eagle3", or lookup-first "ngram|eagle3")."""
    return (lookup_exit(level) or level) == EAGLE


def is_bottom_only(level: str) -> bool:
    """Levels that only draft, never verify: the n-gram, the lookup-first levels and the drafter."""
    return level == NGRAM or lookup_exit(level) is not None or level == EAGLE


def level_pairs(lower: str, upper: str) -> list[str]:
    """The acceptance rates a verification of `lower`'s tokens by `upper` depends on: one pair, or for a lookup-first
    level its exit's and the n-gram's ("ngram|L4", "full" -> ["L4>full", "ngram>full"])."""
    exit_level = lookup_exit(lower)
    return [pair_key(lower, upper)] if exit_level is None else [pair_key(exit_level, upper), pair_key(NGRAM, upper)]


def gate_key(gate: float) -> str:
    """A confidence gate as a calibration's key: 0.3 -> "0.3"."""
    return f"{float(gate):g}"


def level_name(layer: int) -> str:
    return f"L{int(layer)}"


def pair_key(lower: str, upper: str) -> str:
    return f"{lower}>{upper}"


def interp(table: dict, T: int) -> float:
    """A cost measured at some T (`{T: seconds}`) at any T: linear between measured points, the last segment's
    slope (>= 0) beyond them, the first value below them."""
    if T in table:
        return table[T]
    keys = sorted(table)
    if T < keys[0]:
        return table[keys[0]]
    if T > keys[-1]:
        if len(keys) == 1:
            return table[keys[0]] * T / keys[0]
        a, b = keys[-2], keys[-1]
        return table[b] + max(0.0, (table[b] - table[a]) / (b - a)) * (T - b)
    lo = max(k for k in keys if k <= T)
    hi = min(k for k in keys if k >= T)
    return table[lo] + (table[hi] - table[lo]) * (T - lo) / (hi - lo)



# ---------------------------------------------------------------------------------------------- the model
