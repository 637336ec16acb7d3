"""The latency model of static tree drafts (`hispec.decoding.tree`): their predicted time per token and the best tree.

Contract: `tree_time_per_token(widths, cal, level)` is R(tree) / E(tree) below, also for the lookup-first exit
(`lookup=True`), the one pricing of trees; `best_tree(cal)` the fastest shape of `tree_shapes` (memoised);
`scaled_topk` moves calibrated top-k rates to an observed top-1 rate. Trees need the calibration's top-k rates
(`Calibration.topk`, k = 1..MAX_TREE_WIDTH; `CalibrationError` without them); `TREE_ROWS` are the pass sizes
`calibrate` times for tree verifications. The chain terms (unit costs, V_0k, E(a, g)) are `hispec.latency.model`'s.

Static tree drafts (`hispec.decoding.tree`, widths k_1..k_D per depth, n_d = k_1...k_d nodes at depth d, N = sum n_d) under
the full model, drafted by exit level b (depth e): a round drafts depth 1 from the pending position, depth d+1 from
the n_d nodes of depth d, runs the draft layers over the leaves and then the rest of the model over the pending
position and all N nodes at once:

    R(tree) = e layer(1) + head_b(1) + o  +  sum_{d<D} (e layer(n_d) + head_b(n_d) + o)
              + e layer(n_D) + (L - e) layer(N + 1) + final(N + 1) + o  +  o_pos N  +  o_tree
    E(tree) = 1 + sum_{d=1..D} prod_{j<=d} r_b(k_j),         T_tree = R(tree) / E(tree)

with r_b(k) the share of answer positions where the model's argmax is among level b's top-k (`topk`, measured
like the top-1 agreement; r_b(1) = a(b>full)). A tree of widths [1]*g is the chain of gamma g: R and E reduce to
the chain's terms exactly. The i.i.d. assumption carries over (a node's children are judged by the same rate
whatever its depth); tree bookkeeping (masks, compaction) is counted as one pass overhead `o` per pass plus
`tree_overhead` per round (fitted by `calibrate` on real rounds of a probe tree; 0 in older calibrations; o_pos
is `position_overhead`, `hispec.latency.model`), and
dynamic trees are not modelled. Trees drafted by the EAGLE-3 drafter (level "eagle3", `hispec.decoding.eagle_tree`)
replace the exit's passes by the drafter's and add what a drafter hierarchy pays (`hispec.latency.model`):

    R(tree) = sum_{d<D} (drafter(n_d) + o + o_d) [n_0 = 1] + V_0full(N + 1) + o + o_v + o_tree,
    T_tree  = (R(tree) + c(E(tree) - 1)) / E(tree),

c(x) the drafter's context (the tokens verified since it last ran), r(k) its step-0 top-k agreement moved to its
chain rate (`_topk_rates`), and o_tree the drafter trees' own `drafter_tree_overhead` (fitted by `calibrate` on real
rounds of a drafter tree of shape TREE_PROBE, its context intake taken out; the exit trees' fit in older
calibrations that did not time drafter trees: a drafter tree's round is not an exit tree's, so it is measured on its
own). The lookup-first exit with trees (`tree_time_per_token(..., lookup=True)`) mixes the two
round kinds as the lookup-first formula (`hispec.latency.model`) does, the exit's chain round replaced by R(tree)
and E(tree).
"""

from __future__ import annotations

import math

from .calibration import Calibration
from .levels import EAGLE, FULL, NGRAM, CalibrationError, expected_tokens, level_name, pair_key
from .model import _alpha, _drafter_context, _pass_cost

MAX_TREE_WIDTH = 8  # top-k rates measured by `calibrate` (k = 1..MAX_TREE_WIDTH)
TREE_ROWS = (16, 24, 32)  # pass sizes timed beyond the chains' for tree verifications (interpolated between)


def _topk_rates(cal: Calibration, level: str, topk: dict | None) -> list[float]:
    """r(k) of `level`: `topk`'s (a row's own, under `auto`), else the calibration's. The drafter's calibrated rates
    are its step-0 top-k, and its later drafts agree less, so they are moved to its chain rate a (`scaled_topk`:
    r(k) a / r(1)): every depth is then priced at a like the chain's drafts, the top-k in step 0's proportion, and
    a chain-shaped drafter tree gets exactly the drafter chain's figure."""
    key = pair_key(level, FULL)
    if (topk or {}).get(key):
        return [float(r) for r in topk[key]]
    rates = (cal.topk or {}).get(key)
    if not rates:
        raise CalibrationError(f"no top-k agreement for {key} in the calibration (made before tree drafts were "
                               f"modelled); recalibrate (hispec-export ... --calibrate)")
    if level == EAGLE and cal.acceptance.get(key) is not None:
        return scaled_topk(rates, cal.acceptance[key])
    return [float(r) for r in rates]


def tree_expected_tokens(widths, rates) -> float:
    """Expected tokens of one static tree round (greedy, i.i.d.): `1 + sum_d prod_{j<=d} r(k_j)`, with `rates[k-1]`
    = r(k) the chance that the model's argmax is among the draft's top-k (widths beyond the measured k use the
    largest measured k: a lower bound)."""
    if not rates:
        raise ValueError("rates must hold r(1) at least")
    e, p = 1.0, 1.0
    for k in widths:
        p *= min(max(float(rates[min(int(k), len(rates)) - 1]), 0.0), 1.0)
        e += p
    return e


def tree_round_seconds(widths, cal: Calibration, level: str) -> float:
    """R(tree): the predicted seconds of one static tree round drafted by `level` (see the module docstring);
    memoised per calibration (`auto` prices its tree for every row before every round)."""
    def compute():
        o, counts, n = cal.step_overhead, [], 1
        for k in widths:
            n *= int(k)
            counts.append(n)
        if level == EAGLE:  # one drafter pass per inner depth, then the whole model over N + 1 (module docstring)
            t = sum(cal.head_cost(EAGLE, nd) + o + cal.drafter_overhead for nd in [1] + counts[:-1])
            return (t + _pass_cost(cal, None, FULL, sum(counts) + 1) + o + cal.drafter_verify_overhead
                    + cal.drafter_tree_overhead)
        e, L = cal.depth(level), cal.num_layers
        t = e * cal.layer_cost(1) + cal.head_cost(level, 1) + o
        for nd in counts[:-1]:
            t += e * cal.layer_cost(nd) + cal.head_cost(level, nd) + o
        N = sum(counts)
        return (t + e * cal.layer_cost(counts[-1]) + (L - e) * cal.layer_cost(N + 1) + cal.head_cost(FULL, N + 1) + o
                + cal.position_overhead * N + cal.tree_overhead)

    return cal._cached(("tree_round", tuple(int(k) for k in widths), level), compute)


def tree_time_per_token(widths, cal: Calibration, level: str | None = None, topk: dict | None = None, *,
                        lookup: bool = False, acceptance: dict | None = None, match: float | None = None) -> float:
    """Predicted seconds per token of static tree drafts with `widths` (e.g. [4, 2, 1]) by exit `level` (default:
    the draft exit) under the full model, R(tree) / E(tree); `topk` overrides the calibration's top-k rates
    ({"L4>full": [...]}).

    `lookup`: the lookup-first exit with trees (`ngram|EXIT` drafting `widths` where the lookup finds nothing;
    `hispec.decoding.tree._lookup_first`): the lookup-first formula of `hispec.latency.model` with the exit's chain round
    replaced by a tree round,

        T = (c + m (o + V_0full(n+1)) + (1-m) R(tree)) / (m E(a_ng, n) + (1-m) E(tree)),

    m the match rate (`match`, else the calibration's), a_ng the n-gram's rate ("ngram>full": `acceptance`'s, else
    the calibration's); without `lookup`, `acceptance` and `match` are unused. The one pricing of trees:
    `best_tree`, `auto`'s per-row choice and the bench use it."""
    widths = list(widths)
    if not widths or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in widths):
        raise ValueError(f"tree widths must be a non-empty list of integers >= 1, got {widths}")
    level = level or level_name(cal.model["exits"]["draft"])
    if level in (NGRAM, FULL):
        raise ValueError(f"tree drafts come from an exit level or the drafter, got {level!r}")
    e_tree = tree_expected_tokens(widths, _topk_rates(cal, level, topk))
    round_s = tree_round_seconds(widths, cal, level)
    drafter = level == EAGLE  # its context: every token the model verifies passes through it once (c(x))
    if not lookup:
        return (round_s + (_drafter_context(cal, e_tree - 1) if drafter else 0.0)) / e_tree
    m = min(max(cal.ngram_match if match is None else float(match), 0.0), 1.0)
    n, o = cal.ngram_max_len, cal.step_overhead + (cal.drafter_verify_overhead if drafter else 0.0)
    a_n = _alpha(cal, acceptance, pair_key(NGRAM, FULL))
    e_n = expected_tokens(a_n, n)
    served = o + _pass_cost(cal, None, FULL, n + 1)
    context = _drafter_context(cal, m * e_n + (1 - m) * (e_tree - 1)) if drafter else 0.0
    return (cal.ngram_cost + m * served + (1 - m) * round_s + context) / (m * e_n + (1 - m) * e_tree)


def tree_shapes(max_depth: int, max_nodes: int, max_width: int) -> list[list[int]]:
    """Every static tree with non-increasing widths <= `max_width`, depth <= `max_depth`, <= `max_nodes` nodes."""
    out = []

    def grow(widths, nodes, last):
        if widths:
            out.append(list(widths))
        if len(widths) == max_depth:
            return
        n_last = math.prod(widths) if widths else 1
        for k in range(1, last + 1):
            if nodes + n_last * k <= max_nodes:
                grow(widths + [k], nodes + n_last * k, k)

    grow([], 0, max_width)
    return out


def scaled_topk(rates, top1: float) -> list[float]:
    """A level's calibrated top-k rates moved to an observed top-1 rate `top1` (a row's estimate under `auto`):
    r'(k) = r(k) * top1 / r(1), clipped to [0, 1]. A head that stops finding the model's argmax at its top-1 is
    taken to lose its top-k hits in proportion. `auto` uses it for sampled trees, where only the top-1
    acceptance is observed exactly; greedy rows count their own top-k hits instead. Without a calibrated
    r(1) > 0 the rates are returned unchanged."""
    rates = [float(r) for r in rates]
    if not rates or rates[0] <= 0:
        return rates
    f = float(top1) / rates[0]
    return [min(max(r * f, 0.0), 1.0) for r in rates]


def best_tree(cal: Calibration, level: str | None = None, max_depth: int = 5, max_nodes: int = 64,
              topk: dict | None = None, *, lookup: bool = False) -> tuple[list[int], float]:
    """The static tree (widths non-increasing with depth, each <= MAX_TREE_WIDTH, at most `max_nodes` nodes) with
    the lowest predicted seconds per token, and that time; `lookup`: drafted by the lookup-first exit
    (`tree_time_per_token(..., lookup=True)`). Exhaustive over the (few hundred) shapes; memoised."""
    level = level or level_name(cal.model["exits"]["draft"])
    rates = _topk_rates(cal, level, topk)
    key = ("best_tree", level, tuple(round(r, 3) for r in rates), max_depth, max_nodes, lookup)
    memo = cal._memo.setdefault("best_tree", {})
    if key in memo:
        return list(memo[key][0]), memo[key][1]
    topk = {pair_key(level, FULL): rates}
    best = (None, math.inf)
    for widths in tree_shapes(max_depth, max_nodes, min(MAX_TREE_WIDTH, len(rates))):
        t = tree_time_per_token(widths, cal, level, topk, lookup=lookup)
        if t < best[1]:
            best = (widths, t)
    memo[key] = (tuple(best[0]), best[1])
    return best