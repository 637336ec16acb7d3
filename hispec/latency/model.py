"""The latency model: the predicted time per token of a hierarchy from measured unit costs and acceptance rates,
and the latency-optimal hierarchy (design.md §3.3).

Contract: `time_per_token(levels, gammas, cal)` prices a hierarchy (levels bottom-up ending with "full", gammas
with 0 = skip; the level names are `hispec.latency`'s), `best_hierarchy(cal)` finds the fastest one (plain
decoding always a candidate) and `best_gammas(levels, cal, acceptance)` the best gammas for fixed levels
(memoised on the calibration); `plain_seconds_per_token(cal)` is plain decoding's price. The level names and
closed forms it builds on are `hispec.latency.levels`'. Arithmetic on a `Calibration`
(`hispec.latency.calibration`) only: nothing is measured here, and the formulas are below.

The model (greedy decoding, i.i.d. acceptance). Unit costs, measured per number T of new positions in one pass:
`layer(T)` one decoder layer (the median time of a pass over all L layers with a KV cache of `context` slots,
divided by L; every cost table is then fitted non-decreasing in T, so timing noise cannot make more rows cheaper), `head_k(T)` level k's head (norm + adapter + its, possibly reduced, projection, as the decoder calls
it), `final(T)` the model's final norm + lm_head, `ngram` one lookup, `o` = `step_overhead` the decoder's Python
bookkeeping per pass. Between measured T the costs are interpolated linearly: a verification of T tokens is NOT T
one-token steps (on CPUs and GPUs a pass over 8 rows costs little more than over 1). With `e_k` the exit layer of
level k (e = 0 for "ngram", L for "full") and `E(a, g) = (1 - a^(g+1)) / (1 - a)` the expected tokens a
verification of g tokens yields (the accepted prefix plus the verifier's own token):

    draft step at the bottom level b:  D_b      = e_b layer(1) + head_b(1) + o                  (1 token)
    plain decoding ("full" alone):     D_full   = L layer(1) + final(1) + o
    verification by level k of T-1 tokens gathered by level i (KV + hidden-state reuse: the gathered tokens
    already ran through layers [0, e_i) when they were drafted, except the newest one):
                                       V_ik(T)  = e_i layer(1) + (e_k - e_i) layer(T) + head_k(T)
    per-token time of the sub-hierarchy topped by level k over level i with gamma g, acceptance a = a(i>k):
                                       T_k      = (g T_i + V_ik(g+1) + o) / E(a, g)

"ngram" as the bottom level i (T_i = the lookup cost c): a lookup proposes g tokens with probability m
(`ngram_match`) and nothing otherwise. A matched round: level k verifies them in one pass over g+1 positions
(V_0k(g+1) = e_k layer(g+1) + head_k(g+1): no layer ran on them yet) and yields E(a, g) tokens; a round without a
match: level k produces 1 token itself from a one-position pass V_0k(1). Per token (a renewal-reward ratio):

                                       T_k      = (c + o + m V_0k(g+1) + (1-m) V_0k(1)) / (1 + m (E(a, g) - 1))

The lookup-first level "ngram|Lk" as the bottom level i (`ngram|EXIT` in the decoder; T_i = D_k, its exit's draft
step): the lookup is tried before each of the exit's draft steps (cost c each) and matches with probability m,
i.i.d. Where it matches after j drafts (j = 0..g-1, probability (1-m)^j m), its proposal (up to n = the
calibration's `ngram.max_len` tokens) follows them and the round ends: level k verifies the j + n tokens in one
pass, W_j = e_i layer(n+1) + (e_k - e_i) layer(j+n+1) + head_k(j+n+1) (the exit's layers over the looked-up tokens
and its newest draft's input, the rest over everything), yielding E(a_ik, j) + a_ik^j (E(a_ng, n) - 1) tokens (the
drafts' accepted prefix and, where all j held, the lookup's); where it never matches ((1-m)^g) level k verifies the
exit's g drafts, V_ik(g+1), yielding E(a_ik, g). a_ik is the exit's own rate (pair "Lk>U"), a_ng the n-gram's
("ngram>U"). Per token, the expected cost of a round over its expected tokens (`lookup_first_rounds`):

            T_k = sum_rounds p (lookups c + passes T_i + W or V + o) / sum_rounds p tokens

again increasing affine in T_i. Counting j = 0 only (a lookup before the first draft)
priced the SmolLM2 drafter's lookup-first chain at 1.54x `ar` where it ran 1.86x (Spec-Bench 40 x 128, bf16, one
Zen 4 core), the rounds whose later lookup matched being counted as the drafter's alone. m is the n-gram's match
rate per lookup measured under plain verification (matches come in bursts, so a lookup right after a miss matches
a little less often than m; `auto` feeds the model each row's observed rate).

Every pass over T > 1 positions also pays `position_overhead` x (T - 1): what the decoder's verification of one
more position costs beyond the timed units (fitted by `calibrate` on real `ngram` runs; 0 in older calibrations).

The EAGLE-3 drafter "eagle3" (`hispec.decoding.eagle`; depth 0: its drafts ran no layer of the model, so the full
model verifies them like the n-gram's, V_0k) drafts only for "full". Its unit cost `drafter(T)` is one pass of
its own layer (+ fc, norms, draft lm_head) over T entries; a round drafts g tokens in g passes, the first of which
also takes in the tokens the model verified since the drafter last ran (its context, recomputed from the model's
states): on average E - 1 more entries, priced at the curve's slope, c(x) = drafter(1 + x) - drafter(1). So

                                       T_full   = (g D_e + c(E - 1) + V_0k(g+1) + o_v) / E,   D_e = drafter(1) + o + o_d

and the lookup-first "ngram|eagle3" is the lookup-first formula above with T_i = D_e and V_ik = V_0k, plus the
context its drafter takes in: c(x) per round with x = the tokens verified since its last pass (every token the
model verifies passes through the drafter's context once): a round's tokens where the lookup matched before any
draft, one fewer where the drafter ran (its pass already took the newest one), in expectation over the rounds.
o_d (`drafter_overhead`) and o_v = o + `drafter_verify_overhead` are what the decoder's drafter pass and its
verifications (which capture the aux layers) cost beyond the timed units, fitted on real `eagle` runs by
`calibrate` (0 in calibrations that did not measure them); every verification of a drafter hierarchy pays o_v.

A confidence gate g on the drafter's chains (`Calibration.drafter_gate`; the decoder's `draft_gate`): each draft
step passes it with probability q (`Calibration.drafter_pass`, measured along the model's answers), else the chain
ends there (that drafter pass is spent, nothing proposed), and a proposed draft is accepted with rate a_g, the
gated chains' own (higher than the full chains': the drafts below the gate are the likely rejections). A round of
at most g' drafts then proposes j < g' drafts with probability q^j (1 - q) in j + 1 passes, or all g' with q^g' in
g' passes (`gated_rounds`); every term above that depends on the round (drafter passes, lookups tried, V_0k(j+1),
E(a_g, j)) is replaced by its expectation over j, the cost and the yield separately (a renewal-reward ratio again).
q = 1 (no gate) is the full chain, so the formulas above are the special case.

How this follows Globerson et al. ("Fast Inference via Hierarchical Speculative Decoding", arXiv 2510.19705), and
where it differs: as there, each level's expected output per verification is E(a, g) under i.i.d. acceptance, the
per-token latency of a hierarchy is a recursion over its levels, and T_k is an increasing affine function of T_i
(slope g / E > 0), so the best sub-hierarchy topped by level k contains the best sub-hierarchy topped by the level
below it: the optimum is a shortest path over the candidate levels ordered by depth (the paper's generalized
shortest path; here a dynamic program over levels x gammas, O(levels^2 x gammas)). Differences: (1) the paper's
drafters are separate models whose verification pass costs one forward of the verifier; here levels are exits of
one model sharing a KV cache, so a verification runs only the verifier's own layer range over the gathered
tokens (plus the lower ranges over the newest token) and its cost depends on T, measured, not assumed flat;
(2) an n-gram level with a match probability, whose verifier falls back to producing a token itself; (3) a
measured per-pass overhead; (4) level i gathers exactly g_i tokens here (the decoder verifies when it has at
least g_i, and a lower level's burst can overshoot; the paper's thresholds have the same effect, the model
ignores it); (5) acceptance rates are measured top-1 agreements along the full model's own greedy answers
(teacher-forced), one per pair of levels: greedy decoding only. An n-gram level's acceptance is bursty (copied
spans are accepted whole, the rest hardly at all); its i.i.d. rate is fitted on the rounds the decoder would run
(with proposals of up to `NgramConfig.max_len`), which keeps E(a, g) per matched round close to the real mean.
Costs of sampling (probability rows, rejection sampling) are not modelled. Under sampling the decoder's own
policy (`strategy="auto"`) feeds the model the acceptance it observes per row, so a sequence-level rule (HSD), which
accepts more per verification, enters as a higher observed rate; the calibration itself is greedy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .calibration import Calibration
from .levels import (EAGLE, FULL, LOOKUP, NGRAM, CalibrationError, expected_tokens, is_bottom_only, is_drafter,
                     level_pairs, lookup_exit, pair_key)

DEFAULT_MAX_GAMMA = 8


def _alpha(cal: Calibration, acceptance: dict | None, key: str) -> float:
    """The acceptance rate of the pair `key` ("L4>full"): `acceptance`'s, else the calibration's (the drafter's at
    the calibration's gate, `Calibration.rate`)."""
    if acceptance and acceptance.get(key) is not None:
        return float(acceptance[key])
    rate = cal.rate(key)
    if rate is None:
        raise CalibrationError(f"no acceptance rate for {key} in the calibration (it has {sorted(cal.acceptance)})")
    return float(rate)


def gated_rounds(alpha: float, gamma: int, q: float) -> list[tuple[float, int, int, float]]:
    """The rounds of a gated chain of at most `gamma` drafts: each draft step passes the gate with probability `q`
    (else the chain ends there, its pass spent), a proposed draft is accepted with probability `alpha` (i.i.d.).
    -> [(probability, drafts proposed j, drafter passes, expected tokens E(alpha, j))] for j = 0..gamma; q = 1:
    the full chain [(1, gamma, gamma, E(alpha, gamma))]."""
    q = min(max(float(q), 0.0), 1.0)
    if q >= 1.0:
        return [(1.0, gamma, gamma, expected_tokens(alpha, gamma))]
    out = [(q ** j * (1 - q), j, j + 1, expected_tokens(alpha, j)) for j in range(gamma)]
    return out + [(q ** gamma, gamma, gamma, expected_tokens(alpha, gamma))]


def _pass_cost(cal: Calibration, lower: str | None, upper: str, T: int, fresh: int = 1) -> float:
    """V_ik(T): level `upper` verifies T-1 tokens gathered by `lower` (None / "ngram": no layer ran on them); the
    layers below `lower`'s exit run over the `fresh` newest positions only (its newest draft's input; more where a
    lookup's tokens followed its drafts)."""
    e_lo = 0 if lower is None else cal.depth(lower)
    e_hi = cal.depth(upper)
    return (e_lo * cal.layer_cost(fresh) + (e_hi - e_lo) * cal.layer_cost(T) + cal.head_cost(upper, T)
            + cal.position_overhead * (T - 1))


def batch_pass_seconds(cal: Calibration, rows: int, width: int, lower: str | None = None) -> float:
    """One verification pass of a batch by the full model, on the calibration's one-row curves: `rows` rows, each
    `width` positions wide (rows x width positions through every layer), except that the layers below exit
    `lower` (they ran while it drafted; None: nothing ran, an n-gram's proposal) see only each row's newest token.
    Position bookkeeping is per row's width (`position_overhead` x (width - 1)), as `Calibration.at_batch` shares
    it. `auto` prices a batch's round with it (`_AutoPolicy._batch_pays`)."""
    e = 0 if lower is None else cal.depth(lower)
    T = int(rows) * int(width)
    return (e * cal.layer_cost(rows) + (cal.depth(FULL) - e) * cal.layer_cost(T) + cal.head_cost(FULL, T)
            + cal.position_overhead * (int(width) - 1))


def _drafter_context(cal: Calibration, x: float) -> float:
    """c(x): what x more entries add to a drafter pass (its context: tokens the model verified since it last ran)."""
    return max(0.0, cal.head_cost(EAGLE, 1 + x) - cal.head_cost(EAGLE, 1)) if x > 0 else 0.0


def _draft_cost(cal: Calibration, level: str) -> float:
    """D_b: one token from the bottom level's own one-position pass (a lookup-first level: its exit's)."""
    extra = cal.drafter_overhead if is_drafter(level) else 0.0
    return _pass_cost(cal, None, level, 1) + cal.step_overhead + extra


def _bottom_cost(cal: Calibration, level: str) -> float:
    """T of a bottom level: an n-gram lookup, else one draft step."""
    return cal.ngram_cost if level == NGRAM else _draft_cost(cal, level)


def _step(cal: Calibration, lower: str, upper: str, g: int, t_lower: float, acceptance: dict | None,
          match: float) -> float:
    """T_upper from T_lower (increasing affine in t_lower; see the module docstring)."""
    o = cal.step_overhead + (cal.drafter_verify_overhead if is_drafter(lower) else 0.0)  # (per verification)
    alpha = _alpha(cal, acceptance, level_pairs(lower, upper)[0])
    if lookup_exit(lower) is not None:
        return _lookup_first_step(cal, lower, upper, g, t_lower, alpha, acceptance, match, o)
    if is_drafter(lower):  # its chains, gated at the calibration's gate: expectations over where they stop
        rounds = gated_rounds(alpha, g, cal.drafter_pass)
        E = sum(p * e for p, _, _, e in rounds)
        passes = sum(p * k for p, _, k, _ in rounds)
        verify = sum(p * _pass_cost(cal, lower, upper, j + 1) for p, j, _, _ in rounds)
    else:
        E, passes = expected_tokens(alpha, g), g
        verify = _pass_cost(cal, lower, upper, g + 1)
    if lower == EAGLE:
        return (passes * t_lower + _drafter_context(cal, E - 1) + verify + o) / E
    if lower == NGRAM:
        m = min(max(match, 0.0), 1.0)
        return ((t_lower + o + m * _pass_cost(cal, None, upper, g + 1) + (1 - m) * _pass_cost(cal, None, upper, 1))
                / (1 + m * (E - 1)))
    return (g * t_lower + _pass_cost(cal, lower, upper, g + 1) + o) / E


def lookup_first_rounds(gamma: int, q: float, m: float) -> list[tuple[float, int, int, bool]]:
    """The rounds of a lookup-first level 0 (`ngram|EXIT`) with a chain of at most `gamma` drafts: before each
    draft step the lookup is tried (matching with probability `m`, i.i.d.), and where it matches, its proposal
    follows the drafts made so far and the round ends; each draft step passes the chain's gate with probability
    `q` (else the chain ends there, its pass spent; q = 1: no gate). -> [(probability, drafts j, drafter passes,
    lookup proposed)]; lookups tried = passes + 1 where the lookup proposed, else passes."""
    q, m = min(max(float(q), 0.0), 1.0), min(max(float(m), 0.0), 1.0)
    out, reach = [], 1.0  # reach: the chance the round is still drafting with j drafts proposed
    for j in range(gamma):
        out.append((reach * m, j, j, True))  # the lookup matched after j drafts
        missed = reach * (1 - m)
        if q < 1.0:
            out.append((missed * (1 - q), j, j + 1, False))  # draft j+1 failed the gate
        reach = missed * q
    return out + [(reach, gamma, gamma, False)]


def _lookup_first_step(cal: Calibration, lower: str, upper: str, g: int, t_lower: float, alpha: float,
                       acceptance: dict | None, match: float, o: float) -> float:
    """T_upper for a lookup-first level 0 (module docstring): the expectation, over `lookup_first_rounds`, of each
    round's cost and of its tokens (a renewal-reward ratio)."""
    c, n = cal.ngram_cost, cal.ngram_max_len
    E_n = expected_tokens(_alpha(cal, acceptance, pair_key(NGRAM, upper)), n)
    q = cal.drafter_pass if is_drafter(lower) else 1.0
    cost = tokens = intake = 0.0
    for p, j, passes, served in lookup_first_rounds(g, q, match):
        if p <= 0.0:
            continue
        if served:  # j drafts, then the lookup's n tokens: all verified in one pass over j + n + 1 positions
            verify = _pass_cost(cal, lower, upper, j + n + 1, fresh=n + 1)
            E = expected_tokens(alpha, j) + alpha ** j * (E_n - 1)
        else:
            verify, E = _pass_cost(cal, lower, upper, j + 1), expected_tokens(alpha, j)
        cost += p * ((passes + served) * c + passes * t_lower + verify + o)
        tokens += p * E
        intake += p * (E if passes == 0 else E - 1)  # a round the drafter ran in already took its first entry
    context = _drafter_context(cal, intake) if is_drafter(lower) else 0.0
    return (cost + context) / tokens


def _check_levels(cal: Calibration, levels) -> list[str]:
    levels = list(levels)
    if not levels or levels[-1] != FULL:
        raise ValueError(f"a hierarchy ends with 'full' (the model), got {levels}")
    if any(lookup_exit(lv) is not None for lv in levels[1:]):
        raise ValueError(f"a lookup-first level ({LOOKUP}EXIT) can only be the bottom level, got {levels}")
    if any(is_drafter(lv) for lv in levels) and (len(levels) != 2 or not is_drafter(levels[0])):
        raise ValueError(f"the {EAGLE} drafter drafts directly for the full model ({EAGLE}>full or "
                         f"{LOOKUP}{EAGLE}>full), got {levels}")
    depths = [cal.depth(lv) for lv in levels]  # raises for unknown levels
    if any(a >= b for a, b in zip(depths, depths[1:])):
        raise ValueError(f"levels must be ordered by strictly increasing depth, got {levels}")
    return levels


def _active(levels: list[str], gammas) -> tuple[list[str], list[int]]:
    """The levels that run under `gammas` (0 at level i: level i+1 is the bottom) and their gammas."""
    gammas = list(gammas)
    if len(gammas) != len(levels) - 1:
        raise ValueError(f"{len(levels)} levels need {len(levels) - 1} gammas, got {gammas}")
    if any(not isinstance(g, int) or isinstance(g, bool) or g < 0 for g in gammas):
        raise ValueError(f"gammas must be integers >= 0 (0 = skip the level), got {gammas}")
    start = max((i + 1 for i, g in enumerate(gammas) if g == 0), default=0)
    return levels[start:], gammas[start:]


def time_per_token(levels, gammas, cal: Calibration, acceptance: dict | None = None,
                   ngram_match: float | None = None) -> float:
    """Predicted seconds per generated token of the hierarchy `levels` with `gammas` (0 = skip, see the module
    docstring). `acceptance` overrides the calibration's rates per pair ("L4>L8": 0.4, ...), `ngram_match` its
    n-gram match rate."""
    levels, gammas = _active(_check_levels(cal, levels), gammas)
    match = cal.ngram_match if ngram_match is None else ngram_match
    t = _bottom_cost(cal, levels[0])
    for i in range(1, len(levels)):
        t = _step(cal, levels[i - 1], levels[i], gammas[i - 1], t, acceptance, match)
    return t


@dataclass(frozen=True)
class Choice:
    """A hierarchy with its gammas and its predicted latency."""

    levels: tuple[str, ...]
    gammas: tuple[int, ...]
    seconds_per_token: float
    speedup_vs_plain: float

    @property
    def name(self) -> str:
        return ">".join(self.levels)

    @property
    def tokens_per_second(self) -> float:
        return 1.0 / self.seconds_per_token if self.seconds_per_token > 0 else math.inf

    def as_dict(self) -> dict:
        return {"levels": list(self.levels), "gammas": list(self.gammas), "seconds_per_token": self.seconds_per_token,
                "tokens_per_second": self.tokens_per_second, "speedup_vs_plain": self.speedup_vs_plain}


def plain_seconds_per_token(cal: Calibration) -> float:
    """Plain decoding's predicted seconds per token: one full pass per token."""
    return time_per_token([FULL], [], cal)


def _choice(cal: Calibration, levels, gammas, t: float) -> Choice:
    return Choice(tuple(levels), tuple(gammas), t, plain_seconds_per_token(cal) / t)


def best_hierarchy(cal: Calibration, candidates=None, max_gamma: int = DEFAULT_MAX_GAMMA,
                   acceptance: dict | None = None, *, speculative_only: bool = False) -> Choice:
    """The latency-optimal hierarchy over `candidates` (default: every level of the calibration) with gammas in
    1..max_gamma. Dynamic program over levels by depth: best[k] = min(k drafting alone, min over lower i and g of
    T_k(best[i])), exact because T_k is increasing in T_i. Plain decoding (["full"]) is always a candidate, unless
    `speculative_only` (the best hierarchy with at least one level below the model, even if slower than plain)."""
    if max_gamma < 1:
        raise ValueError(f"max_gamma must be >= 1, got {max_gamma}")
    cands = sorted(set(candidates or cal.levels) | {FULL}, key=cal.depth)
    if speculative_only and cands == [FULL]:
        raise ValueError("speculative_only needs a candidate level below 'full'")
    match = cal.ngram_match
    best: dict[str, tuple[float, list[str], list[int]]] = {}
    for k in cands:
        if is_bottom_only(k):  # bottom levels only
            best[k] = (_bottom_cost(cal, k), [k], [])
            continue
        top = (math.inf if speculative_only and k == FULL else _draft_cost(cal, k), [k], [])
        for i in cands:
            if cal.depth(i) >= cal.depth(k) or (is_drafter(i) and k != FULL):  # (the drafter: under full only)
                continue
            t_i, lv, gm = best[i]
            for g in range(1, max_gamma + 1):
                t = _step(cal, i, k, g, t_i, acceptance, match)
                if t < top[0]:
                    top = (t, lv + [k], gm + [g])
        best[k] = top
    t, lv, gm = best[FULL]
    return _choice(cal, lv, gm, t)


def _best_chain(cal: Calibration, levels: list[str], acceptance: dict | None, match: float, max_gamma: int
                ) -> tuple[float, list[int]]:
    """The best gammas (all >= 1) for a fixed chain: per level bottom-up (T_k is increasing in T_{k-1})."""
    t = _bottom_cost(cal, levels[0])
    gammas = []
    for i in range(1, len(levels)):
        lo, hi = levels[i - 1], levels[i]
        t, g = min((_step(cal, lo, hi, g, t, acceptance, match), g) for g in range(1, max_gamma + 1))
        gammas.append(g)
    return t, gammas


def lookup_alone_seconds(cal: Calibration, rate: float, match: float) -> float:
    """Predicted seconds per token of the n-gram lookup alone under the full model (`ngram>full`, proposals of up to
    the calibration's `ngram_max_len` tokens, as a lookup-first level's lookup is priced) at n-gram acceptance
    `rate` and match rate `match`: what a lookup-first row pays with its exit switched off (`auto`). Rounded to
    0.01 and memoised on the calibration, like `best_gammas`."""
    rate, match = round(float(rate), 2), round(float(match), 2)
    memo = cal._memo.setdefault("lookup_alone", {})
    if (rate, match) not in memo:
        if len(memo) > 4096:
            memo.clear()
        memo[rate, match] = time_per_token([NGRAM, FULL], [cal.ngram_max_len], cal, {pair_key(NGRAM, FULL): rate},
                                           match)
    return memo[rate, match]


def best_gammas(levels, cal: Calibration, acceptance: dict | None = None, max_gamma: int = DEFAULT_MAX_GAMMA,
                ngram_match: float | None = None, margin: float = 0.0) -> list[int]:
    """The best gammas for the fixed hierarchy `levels`, each in 0..max_gamma (0 = skip: the level above drafts
    itself; all zeros = plain decoding), given acceptance rates per pair (missing pairs: the calibration's).
    Speculation is chosen only when its predicted time per token is below (1 - `margin`) of plain decoding's: a
    margin of a few % keeps a caller off speculation whose predicted gain is within the model's error.
    Rates are rounded to 0.01 and the answer memoised on the calibration, so calling it every few rounds per row
    costs a dict lookup."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    levels = _check_levels(cal, levels)
    match = cal.ngram_match if ngram_match is None else ngram_match
    pairs = {p for i, a in enumerate(levels) for b in levels[i + 1:] for p in level_pairs(a, b)}
    acc = {p: round(float(acceptance[p]), 2) for p in pairs if acceptance and acceptance.get(p) is not None}
    key = ("best_gammas", tuple(levels), tuple(sorted(acc.items())), round(match, 2), max_gamma, margin)
    memo = cal._memo.setdefault("best_gammas", {})
    if key in memo:
        return list(memo[key])
    K = len(levels) - 1
    best_t, best = _draft_cost(cal, FULL) * (1 - margin), [0] * K  # plain decoding, less the margin
    for start in range(K - 1, -1, -1):  # the bottom level: shallower bottoms only when strictly better
        chain = levels[start:]
        t, gm = _best_chain(cal, chain, acc, round(match, 2), max_gamma)
        if t < best_t * (1 - 1e-9):
            best_t, best = t, [0] * start + gm
    if len(memo) > 4096:
        memo.clear()
    memo[key] = tuple(best)
    return best
