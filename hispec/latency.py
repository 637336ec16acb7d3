"""The latency model of hierarchical speculative decoding and the latency-optimal hierarchy (design.md §3.3).

Contract:
- A *hierarchy* is a list of level names ordered by depth, bottom-up, ending with "full": "ngram" (prompt-lookup
  drafting, `hispec.ngram`; only as the bottom level), "L<k>" (the exit after decoder layer k with its trained
  head) and "full" (the model). Level i < top has a gamma `g_i`: how many tokens it gathers before level i+1
  verifies them in one pass (for "ngram": its longest proposal). `gammas[i] == 0` means level i is *skipped*:
  level i+1 produces its tokens itself (it becomes the bottom; the levels below i are idle). So
  `(["L4", "L8", "full"], [0, 3])` is self-speculation at L8 and `[0, 0]` is plain decoding.
- `time_per_token(levels, gammas, cal)` predicts seconds per generated token; `best_hierarchy(cal)` the fastest
  hierarchy (plain decoding is always a candidate, so the choice is never predicted slower than plain);
  `best_gammas(levels, cal, acceptance)` the best gammas for a fixed level list given (e.g. per-row, observed)
  acceptance rates, allowing 0 = skip; memoised, cheap enough to call every few decoding rounds.
- `calibrate(model, prompts)` measures a `Calibration` on this machine: unit costs (timed) and acceptance rates
  (counted on the model's own greedy answers), and keeps the n-gram config (of NGRAM_CANDIDATES) that `auto_plan`,
  `auto`'s plan, is predicted fastest with; the decoder then runs that config. It lives in the checkpoint as
  `config.json["hispec"]["calibration"]` (`write_calibration` / `read_calibration`); `Calibration.check(model)`
  refuses one made for another model or on another kind of machine (`CalibrationError`).

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
step): every round first tries the lookup (cost c per draft step). With probability m it proposes (up to n =
the calibration's `ngram.max_len` tokens), which level k verifies in one pass V_0k(n+1), yielding E(a_ng, n)
tokens; otherwise the exit drafts g tokens (tried by the lookup before each) and level k verifies them, V_ik(g+1),
yielding E(a_ik, g), with a_ik the exit's own rate (pair "Lk>U") and a_ng the n-gram's ("ngram>U"):

            T_k = ((m + (1-m) g) c + m (o + V_0k(n+1)) + (1-m) (g T_i + V_ik(g+1) + o)) / (m E(a_ng, n) + (1-m) E(a_ik, g))

again increasing affine in T_i. m is the n-gram's match rate per round measured under plain verification (a
round the lookup misses advances one token there, E(a_ik, g) here, so the real rate per round differs a little;
`auto` feeds the model each row's observed rate).

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

Static tree drafts (`hispec.tree`, widths k_1..k_D per depth, n_d = k_1...k_d nodes at depth d, N = sum n_d) under
the full model, drafted by exit level b (depth e): a round drafts depth 1 from the pending position, depth d+1 from
the n_d nodes of depth d, runs the draft layers over the leaves and then the rest of the model over the pending
position and all N nodes at once:

    R(tree) = e layer(1) + head_b(1) + o  +  sum_{d<D} (e layer(n_d) + head_b(n_d) + o)
              + e layer(n_D) + (L - e) layer(N + 1) + final(N + 1) + o
    E(tree) = 1 + sum_{d=1..D} prod_{j<=d} r_b(k_j),         T_tree = R(tree) / E(tree)

with r_b(k) the share of answer positions where the model's argmax is among level b's top-k (`topk`, measured
like the top-1 agreement; r_b(1) = a(b>full)). A tree of widths [1]*g is the chain of gamma g: R and E reduce to
the chain's terms exactly. The i.i.d. assumption carries over (a node's children are judged by the same rate
whatever its depth); tree bookkeeping (masks, compaction) is counted as one pass overhead `o` per pass, and dynamic
trees are not modelled. The lookup-first exit with trees (`tree_time_per_token(..., lookup=True)`) mixes the two
round kinds as the lookup-first formula does, the exit's chain round replaced by R(tree) and E(tree).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import packed
from .heads import ContextInputs
from .io import write_json
from .ngram import NgramConfig, propose
from .prompts import Prompt, render

NGRAM, FULL = "ngram", "full"
LOOKUP = "ngram|"  # "ngram|L4": the lookup-first exit level (the n-gram lookup, the exit where it finds nothing)
CALIBRATION_VERSION = 1
DEFAULT_MAX_GAMMA = 8
# the n-gram configs `calibrate` chooses from when none is given (the default first: it wins ties). Measured on
# Qwen2.5-Coder-1.5B (16 Spec-Bench answers x 96 tokens, bf16, 2-core EPYC): min_ngram 1 matches 49% of rounds at
# an acceptance of 0.39, min_ngram 2 15% at 0.61, and auto's predicted speedup goes 1.38x -> 1.45x (a one-token
# match is mostly noise, and under a lookup-first exit it takes the round from the exit's better draft)
NGRAM_CANDIDATES = tuple(NgramConfig(3, n, k) for k in (8, 4) for n in (1, 2, 3))


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


def level_pairs(lower: str, upper: str) -> list[str]:
    """The acceptance rates a verification of `lower`'s tokens by `upper` depends on: one pair, or for a lookup-first
    level its exit's and the n-gram's ("ngram|L4", "full" -> ["L4>full", "ngram>full"])."""
    exit_level = lookup_exit(lower)
    return [pair_key(lower, upper)] if exit_level is None else [pair_key(exit_level, upper), pair_key(NGRAM, upper)]


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


# ---------------------------------------------------------------------------------------------- calibration
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_fingerprint(device=None, model=None) -> dict:
    """What makes timings transferable: CPU model and vector capability, device type (and GPU name), torch, and
    with `model` (an `EarlyExitModel`) its linear kernels (`hispec.packed.kind`: prepacked or stock)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    fp = {"cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "device": dev.type,
          "cuda_name": None, "torch": torch.__version__, "platform": platform.machine()}
    if model is not None:
        fp["linear"] = packed.kind(model.base)
    if dev.type == "cuda" and torch.cuda.is_available():
        fp["cuda_name"] = torch.cuda.get_device_name(dev)
    return fp


def model_identity(model) -> dict:
    """The facts about an `EarlyExitModel` that its costs and acceptances depend on."""
    ad, cfg = model.adapter, model.hispec_config
    exits = {"draft": model.draft_layer, "verify": model.verify_layer}
    heads = {level_name(layer): {"exit": name, "type": cfg.head_type, "vocab_size": model.vocab_size_of(name)}
             for name, layer in exits.items()}
    return {"num_layers": ad.num_layers, "hidden_size": ad.hidden_size, "vocab_size": ad.vocab_size,
            "model_type": getattr(ad.config, "model_type", None), "exits": exits, "heads": heads}


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _str_keys(d):
    if isinstance(d, dict):
        return {str(k): _str_keys(v) for k, v in d.items()}
    return d


def _int_keys(table: dict) -> dict:
    return {int(k): float(v) for k, v in table.items()}


@dataclass
class Calibration:
    """Measured inputs of the latency model for one model on one kind of machine (see the module docstring).

    `costs`: {"layer": {T: s}, "head": {"L4": {T: s}, ...}, "final": {T: s}, "ngram": s, "step_overhead": s,
    "layer_scale": x} (x: the factor by which a layer runs slower inside the decoder than timed alone, fitted by
    `calibrate`; absent = 1);
    `acceptance`: {"ngram>L4": a, "L4>L8": a, "L4>full": a, ...} for every pair lower < upper; `ngram_match`: the
    share of the n-gram level's rounds whose lookup proposes anything; `measured`: tokens/s per strategy where a run
    measured them (optional). Treat an instance as immutable: `best_gammas` memoises on it."""

    machine: dict
    dtype: str
    threads: int
    model: dict
    costs: dict
    acceptance: dict
    ngram_match: float = 0.0
    measured: dict | None = None
    context: int = 0  # KV slots behind the timed passes
    positions: int = 0  # answer positions the acceptances were counted on
    ngram: dict | None = None  # the NgramConfig the n-gram figures were measured with
    topk: dict | None = None  # {"L4>full": [r(1), ..., r(K)]}: share of positions with the model's argmax in L4's top-k
    # the n-gram configs `calibrate` measured and chose `ngram` from: [{"config": {...}, "match": m, "acceptance":
    # {"ngram>L4": a, ..., "ngram>full": a}, "seconds_per_token": auto's predicted time}, ...] (None: one measured)
    ngram_options: list | None = None
    version: int = CALIBRATION_VERSION
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ levels
    @property
    def num_layers(self) -> int:
        return int(self.model["num_layers"])

    @property
    def levels(self) -> list[str]:
        """Every level this calibration can price: "ngram" and, per exit, "ngram|Lk" (if the n-gram was measured),
        the exits, "full"."""
        exits = [level_name(e) for e in sorted(int(name[1:]) for name in self.costs.get("head", {}))]
        if self.costs.get("ngram") is None:
            return exits + [FULL]
        return [NGRAM] + exits + [LOOKUP + e for e in exits] + [FULL]

    @property
    def ngram_max_len(self) -> int:
        """The longest n-gram proposal the n-gram figures were measured with (a lookup-first level proposes that)."""
        return int((self.ngram or {}).get("max_len", NgramConfig().max_len))

    def depth(self, level: str) -> int:
        exit_level = lookup_exit(level)
        if exit_level is not None and self.costs.get("ngram") is not None and exit_level in self.costs.get("head", {}):
            return int(exit_level[1:])  # (a lookup-first level needs a measured n-gram and a measured exit)
        if level == NGRAM:
            return 0
        if level == FULL:
            return self.num_layers
        if level.startswith("L") and level[1:].isdigit() and level in self.costs.get("head", {}):
            return int(level[1:])
        raise ValueError(f"unknown level {level!r}; this calibration knows {', '.join(self.levels)}")

    def layer_cost(self, T: int) -> float:
        return self._cached(("layer", T), lambda: self.layer_scale * interp(self.costs["layer"], T))

    @property
    def layer_scale(self) -> float:
        return float(self.costs.get("layer_scale") or 1.0)

    def head_cost(self, level: str, T: int) -> float:
        if level == FULL:
            return self._cached(("final", T), lambda: interp(self.costs["final"], T))
        level = lookup_exit(level) or level
        return self._cached(("head", level, T), lambda: interp(self.costs["head"][level], T))

    @property
    def step_overhead(self) -> float:
        return float(self.costs.get("step_overhead", 0.0))

    @property
    def ngram_cost(self) -> float:
        return float(self.costs.get("ngram") or 0.0)

    def _cached(self, key, fn):
        units = self._memo.setdefault("units", {})
        if key not in units:
            units[key] = fn()
        return units[key]

    def plain_seconds_per_token(self) -> float:
        return time_per_token([FULL], [], self)

    def at_batch(self, rows: int) -> Calibration:
        """This calibration as one row of a batch of `rows` rows decoding together sees it: every pass cost measured
        at T positions becomes the cost of the batch's pass over rows x T positions, shared by its rows
        (`interp(table, rows * T) / rows`), and the per-pass overhead is shared too; the lookup's cost stays per row
        (each row looks up its own tokens). The timed passes are one row's, so this reads the batch's pass off the
        same curve: while rows x T stays in the flat part (the weights' load dominates) a verification of several
        positions is still nearly free, beyond it (compute-bound) every extra position costs its share, which is why
        speculation that pays alone can lose in a full batch (attention over each row's own cache scales the same
        way: rows x T queries over `context` keys). Every formula then prices a row at the batch's marginal costs,
        and plain decoding at its own (`plain_seconds_per_token()` = the batch's plain step / rows). rows <= 1:
        this calibration. Memoised per calibration."""
        rows = int(rows)
        if rows <= 1:
            return self
        memo = self._memo.setdefault("at_batch", {})
        if rows not in memo:
            def share(table: dict) -> dict:
                return {T: interp(table, rows * T) / rows for T in table}

            costs = dict(self.costs)
            costs["layer"] = share(self.costs["layer"])
            costs["final"] = share(self.costs["final"])
            costs["head"] = {k: share(v) for k, v in self.costs.get("head", {}).items()}
            costs["step_overhead"] = self.step_overhead / rows
            memo[rows] = replace(self, costs=costs)
        return memo[rows]

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict:
        """JSON-safe (int keys become strings)."""
        return _str_keys({
            "version": self.version, "machine": dict(self.machine), "dtype": self.dtype, "threads": self.threads,
            "model": self.model, "costs": self.costs, "acceptance": dict(self.acceptance),
            "ngram_match": self.ngram_match, "measured": self.measured, "context": self.context,
            "positions": self.positions, "ngram": self.ngram, "topk": self.topk, "ngram_options": self.ngram_options,
        })

    @classmethod
    def from_dict(cls, d: dict) -> Calibration:
        try:
            version = int(d.get("version", 0))
            if version > CALIBRATION_VERSION:
                raise CalibrationError(f"calibration format version {version} is newer than this hispec "
                                       f"({CALIBRATION_VERSION}); upgrade hispec or recalibrate")
            c = d["costs"]
            costs = {"layer": _int_keys(c["layer"]), "final": _int_keys(c["final"]),
                     "head": {name: _int_keys(t) for name, t in c.get("head", {}).items()},
                     "ngram": None if c.get("ngram") is None else float(c["ngram"]),
                     "step_overhead": float(c.get("step_overhead", 0.0)),
                     "layer_scale": float(c.get("layer_scale") or 1.0)}
            model = dict(d["model"])
            model["exits"] = {k: int(v) for k, v in model.get("exits", {}).items()}
            return cls(machine=dict(d["machine"]), dtype=str(d["dtype"]), threads=int(d["threads"]), model=model,
                       costs=costs, acceptance={k: float(v) for k, v in d["acceptance"].items()},
                       ngram_match=float(d.get("ngram_match", 0.0)), measured=d.get("measured"),
                       context=int(d.get("context", 0)), positions=int(d.get("positions", 0)), ngram=d.get("ngram"),
                       topk=None if d.get("topk") is None else {k: [float(x) for x in v]
                                                                for k, v in d["topk"].items()},
                       ngram_options=None if d.get("ngram_options") is None else [
                           {"config": dict(o["config"]), "match": float(o["match"]),
                            "acceptance": {k: float(v) for k, v in o["acceptance"].items()},
                            "seconds_per_token": float(o["seconds_per_token"])} for o in d["ngram_options"]],
                       version=version)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, CalibrationError):
                raise
            raise CalibrationError(f"malformed calibration entry ({e!r}); recalibrate (hispec-export ... --calibrate)"
                                   ) from e

    # ------------------------------------------------------------------ validity
    def describe_machine(self) -> str:
        m = self.machine
        dev = m.get("cuda_name") or m.get("device", "?")
        return (f"{m.get('cpu', '?')} ({m.get('cpu_capability', '?')}), device {dev}, {self.dtype}, "
                f"{self.threads} threads, torch {m.get('torch', '?')}, {m.get('linear', packed.STOCK)} linears")

    def check(self, model, *, machine: bool = True) -> None:
        """Raise `CalibrationError` when this calibration was made for another model (depth, hidden size,
        vocabulary, type, exits, heads) or, with `machine`, on another kind of machine (CPU model, CPU capability,
        device / GPU) or in another dtype: its predictions would not hold."""
        have, want = model_identity(model), self.model
        diffs = [f"{k}: calibrated {want[k]!r}, model has {have[k]!r}"
                 for k in ("num_layers", "hidden_size", "vocab_size", "model_type", "exits")
                 if want.get(k) is not None and want[k] != have[k]]
        if not diffs and want.get("heads") and want["heads"] != have["heads"]:
            diffs.append(f"heads: calibrated {want['heads']}, model has {have['heads']}")
        if diffs:
            raise CalibrationError("the latency calibration belongs to another model (" + "; ".join(diffs)
                                   + "); recalibrate on this one (hispec-export ... --calibrate, or "
                                   "hispec.latency.calibrate)")
        if not machine:
            return
        here = machine_fingerprint(model.device, model)
        diffs = [f"{k}: calibrated {self.machine.get(k)!r}, here {here[k]!r}"
                 for k in ("cpu", "cpu_capability", "device", "cuda_name") if self.machine.get(k) != here[k]]
        if self.machine.get("linear", packed.STOCK) != here["linear"]:  # calibrations before hispec.packed: stock
            diffs.append(f"linear kernels: calibrated {self.machine.get('linear', packed.STOCK)}, the model runs "
                         f"{here['linear']} (hispec.load(pack=...), --no-pack)")
        if _dtype_name(model.dtype) != self.dtype:
            diffs.append(f"dtype: calibrated {self.dtype}, model runs in {_dtype_name(model.dtype)}")
        if diffs:
            raise CalibrationError(f"the latency calibration was measured on another machine or setup "
                                   f"({self.describe_machine()}): " + "; ".join(diffs)
                                   + "; its timings do not hold here. Recalibrate on this machine "
                                   "(hispec.latency.calibrate(model, prompts)) or choose a strategy explicitly")


# ---------------------------------------------------------------------------------------------- the model
def _alpha(cal: Calibration, acceptance: dict | None, key: str) -> float:
    """The acceptance rate of the pair `key` ("L4>full"): `acceptance`'s, else the calibration's."""
    if acceptance and acceptance.get(key) is not None:
        return float(acceptance[key])
    if key not in cal.acceptance:
        raise CalibrationError(f"no acceptance rate for {key} in the calibration (it has {sorted(cal.acceptance)})")
    return float(cal.acceptance[key])


def _pass_cost(cal: Calibration, lower: str | None, upper: str, T: int) -> float:
    """V_ik(T): level `upper` verifies T-1 tokens gathered by `lower` (None / "ngram": no layer ran on them)."""
    e_lo = 0 if lower is None else cal.depth(lower)
    e_hi = cal.depth(upper)
    return e_lo * cal.layer_cost(1) + (e_hi - e_lo) * cal.layer_cost(T) + cal.head_cost(upper, T)


def _draft_cost(cal: Calibration, level: str) -> float:
    """D_b: one token from the bottom level's own one-position pass (a lookup-first level: its exit's)."""
    return _pass_cost(cal, None, level, 1) + cal.step_overhead


def _bottom_cost(cal: Calibration, level: str) -> float:
    """T of a bottom level: an n-gram lookup, else one draft step."""
    return cal.ngram_cost if level == NGRAM else _draft_cost(cal, level)


def _step(cal: Calibration, lower: str, upper: str, g: int, t_lower: float, acceptance: dict | None,
          match: float) -> float:
    """T_upper from T_lower (increasing affine in t_lower; see the module docstring)."""
    o = cal.step_overhead
    alpha = _alpha(cal, acceptance, level_pairs(lower, upper)[0])
    E = expected_tokens(alpha, g)
    if lookup_exit(lower) is not None:
        m, c, n = min(max(match, 0.0), 1.0), cal.ngram_cost, cal.ngram_max_len
        a_n = _alpha(cal, acceptance, pair_key(NGRAM, upper))
        served = o + _pass_cost(cal, None, upper, n + 1)  # the lookup's n tokens verified in one pass
        drafted = g * t_lower + _pass_cost(cal, lower, upper, g + 1) + o  # the exit's g tokens, then verified
        return ((m + (1 - m) * g) * c + m * served + (1 - m) * drafted) / (m * expected_tokens(a_n, n) + (1 - m) * E)
    if lower == NGRAM:
        m = min(max(match, 0.0), 1.0)
        return ((t_lower + o + m * _pass_cost(cal, None, upper, g + 1) + (1 - m) * _pass_cost(cal, None, upper, 1))
                / (1 + m * (E - 1)))
    return (g * t_lower + _pass_cost(cal, lower, upper, g + 1) + o) / E


def _check_levels(cal: Calibration, levels) -> list[str]:
    levels = list(levels)
    if not levels or levels[-1] != FULL:
        raise ValueError(f"a hierarchy ends with 'full' (the model), got {levels}")
    if any(lookup_exit(lv) is not None for lv in levels[1:]):
        raise ValueError(f"a lookup-first level ({LOOKUP}EXIT) can only be the bottom level, got {levels}")
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


def _choice(cal: Calibration, levels, gammas, t: float) -> Choice:
    return Choice(tuple(levels), tuple(gammas), t, cal.plain_seconds_per_token() / t)


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
        if k == NGRAM or lookup_exit(k) is not None:  # bottom levels only
            best[k] = (_bottom_cost(cal, k), [k], [])
            continue
        top = (math.inf if speculative_only and k == FULL else _draft_cost(cal, k), [k], [])
        for i in cands:
            if cal.depth(i) >= cal.depth(k):
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


# ---------------------------------------------------------------------------------------------- tree drafts
MAX_TREE_WIDTH = 8  # top-k rates measured by `calibrate` (k = 1..MAX_TREE_WIDTH)
TREE_ROWS = (16, 24, 32)  # pass sizes timed beyond the chains' for tree verifications (interpolated between)


def _topk_rates(cal: Calibration, level: str, topk: dict | None) -> list[float]:
    key = pair_key(level, FULL)
    rates = (topk or {}).get(key) or (cal.topk or {}).get(key)
    if not rates:
        raise CalibrationError(f"no top-k agreement for {key} in the calibration (made before tree drafts were "
                               f"modelled); recalibrate (hispec-export ... --calibrate)")
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
        e, L, o = cal.depth(level), cal.num_layers, cal.step_overhead
        counts, n = [], 1
        for k in widths:
            n *= int(k)
            counts.append(n)
        t = e * cal.layer_cost(1) + cal.head_cost(level, 1) + o
        for nd in counts[:-1]:
            t += e * cal.layer_cost(nd) + cal.head_cost(level, nd) + o
        N = sum(counts)
        return t + e * cal.layer_cost(counts[-1]) + (L - e) * cal.layer_cost(N + 1) + cal.head_cost(FULL, N + 1) + o

    return cal._cached(("tree_round", tuple(int(k) for k in widths), level), compute)


def tree_time_per_token(widths, cal: Calibration, level: str | None = None, topk: dict | None = None, *,
                        lookup: bool = False, acceptance: dict | None = None, match: float | None = None) -> float:
    """Predicted seconds per token of static tree drafts with `widths` (e.g. [4, 2, 1]) by exit `level` (default:
    the draft exit) under the full model, R(tree) / E(tree); `topk` overrides the calibration's top-k rates
    ({"L4>full": [...]}).

    `lookup`: the lookup-first exit with trees (`ngram|EXIT` drafting `widths` where the lookup finds nothing;
    `hispec.tree._lookup_first`): the lookup-first formula of the module docstring with the exit's chain round
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
        raise ValueError(f"tree drafts come from an exit level, got {level!r}")
    e_tree = tree_expected_tokens(widths, _topk_rates(cal, level, topk))
    round_s = tree_round_seconds(widths, cal, level)
    if not lookup:
        return round_s / e_tree
    m = min(max(cal.ngram_match if match is None else float(match), 0.0), 1.0)
    n, o = cal.ngram_max_len, cal.step_overhead
    a_n = _alpha(cal, acceptance, pair_key(NGRAM, FULL))
    served = o + _pass_cost(cal, None, FULL, n + 1)
    return (cal.ngram_cost + m * served + (1 - m) * round_s) / (m * expected_tokens(a_n, n) + (1 - m) * e_tree)


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


@dataclass(frozen=True)
class AutoPlan:
    """`strategy="auto"`'s plan in calibration level names: a chain (`levels` bottom-up, `gammas`) or, with
    `widths`, a static tree drafted by `levels[0]` (an exit, or a lookup-first exit) under the full model."""

    levels: tuple[str, ...]
    gammas: tuple[int, ...]
    widths: tuple[int, ...] | None
    seconds_per_token: float


def auto_plan(cal: Calibration, *, trees: bool = True, max_depth: int = 5) -> AutoPlan:
    """The latency-optimal speculative plan `auto` decodes with (rows may still decode plainly): the best chain
    hierarchy over the n-gram, the lookup-first exits (where the n-gram was measured) and the exits
    (`best_hierarchy(speculative_only=True)`), unless `trees` and a static tree with some width > 1 (`best_tree`,
    drafted by an exit, lookup-first where the n-gram was measured; never deeper than `max_depth`) is predicted
    faster. Needs the calibration's top-k rates for trees (made since tree drafts were modelled). The decoder
    (`hispec.decoding._auto_plan`), the bench's prediction and `calibrate`'s n-gram choice all plan through here."""
    exits = [level_name(e) for e in sorted(int(name[1:]) for name in cal.costs.get("head", {}))]
    measured = cal.acceptance.get(pair_key(NGRAM, FULL)) is not None and cal.costs.get("ngram") is not None
    lookups = [NGRAM] + [LOOKUP + e for e in exits] if measured else []
    choice = best_hierarchy(cal, candidates=lookups + exits, speculative_only=True)
    best = AutoPlan(tuple(choice.levels), tuple(choice.gammas), None,
                    time_per_token(list(choice.levels), list(choice.gammas), cal))
    if not trees or not cal.topk or max_depth < 1:
        return best
    for level in exits:
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
    return out


def predictions(cal: Calibration, max_gamma: int = DEFAULT_MAX_GAMMA, fixed: dict | None = None) -> list[dict]:
    """One row per named hierarchy at its best gammas, then each of `fixed` ({label: (levels, gammas)}, e.g. the
    checkpoint's defaults), then "best" (`best_hierarchy`): name, levels, gammas, seconds/token, tok/s, speedup."""
    rows = []
    plain = cal.plain_seconds_per_token()

    def row(name, levels, gammas, t):
        return {"name": name, "levels": list(levels), "gammas": list(gammas), "seconds_per_token": t,
                "tokens_per_second": 1 / t, "speedup_vs_plain": plain / t}

    for name, levels in named_hierarchies(cal).items():
        t, gm = (plain, []) if levels == [FULL] else _best_chain(cal, levels, None, cal.ngram_match, max_gamma)
        rows.append(row(name, levels, gm, t))
    for name, (levels, gammas) in (fixed or {}).items():
        rows.append(row(name, levels, gammas, time_per_token(levels, gammas, cal)))
    d = cal.model.get("exits", {}).get("draft")
    if d is not None and cal.topk and pair_key(level_name(d), FULL) in cal.topk:  # static trees (hispec.tree)
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
        plain = cal.plain_seconds_per_token()
        opts = ", ".join(f"{_ngram_label(o['config'])} {plain / o['seconds_per_token']:.2f}x"
                         for o in cal.ngram_options)
        lines.append(f"n-gram config {_ngram_label(cal.ngram)} chosen by auto's predicted speedup ({opts})")
    return "\n".join(lines)


def _ngram_label(cfg: dict) -> str:
    return f"n={cfg['min_ngram']}..{cfg['max_ngram']}, <= {cfg['max_len']} tokens"


# ---------------------------------------------------------------------------------------------- measurement
def median_times(fns: dict, repeats: int) -> dict:
    """Median wall time of each callable, interleaved round by round (drift hits all alike), after a warm-up."""
    for fn in fns.values():
        fn()
    samples = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


class KVBench:
    """A KV cache of `context` random positions through every layer (and the exit heads' own layers), to time
    passes over T new positions after it; every timed call rolls its positions back."""

    def __init__(self, model, context: int = 256, seed: int = 0):
        self.model = model
        ad = self.adapter = model.adapter
        self.context = context
        self.gen = torch.Generator().manual_seed(seed)
        stateful = getattr(model, "stateful_heads", False)
        heads = getattr(model, "heads", {})
        self.cache = ad.new_cache(1, extra=2 if stateful else 0)
        ids = torch.randint(0, ad.vocab_size, (1, context), generator=self.gen).to(ad.device)
        pos = torch.arange(context, device=ad.device)[None]
        valid = torch.ones_like(pos, dtype=torch.bool)
        with torch.no_grad():
            h = ad.run_layers(ad.embed(ids, pos), 0, ad.num_layers, position_ids=pos, cache=self.cache, valid=valid)
            for head in (heads.values() if stateful else ()):
                ad.run_module(head.layer, head.layer_type, h, cache_index=head.cache_index, position_ids=pos,
                              cache=self.cache, valid=valid)
        self.keep = torch.tensor([context], device=ad.device)

    def hidden(self, T: int) -> torch.Tensor:
        ad = self.adapter
        return torch.randn(1, T, ad.hidden_size, generator=self.gen).to(ad.device, ad.dtype)

    def _pos(self, T):
        ad = self.adapter
        return (self.context + torch.arange(T, device=ad.device)[None],
                torch.ones(1, T, dtype=torch.bool, device=ad.device))

    def layers(self, T: int, start: int = 0, end: int | None = None):
        """A callable: layers [start, end) over T new positions, then rolled back."""
        ad, end = self.adapter, self.adapter.num_layers if end is None else end
        x, (pos, valid) = self.hidden(T), self._pos(T)

        def run():
            with torch.no_grad():
                ad.run_layers(x, start, end, position_ids=pos, cache=self.cache, valid=valid)
            self.cache.truncate(start, end, self.keep)

        return run

    def head(self, exit_name: str, T: int):
        """A callable: exit head `exit_name` over T positions, as the decoder calls it (logits included)."""
        model, ad = self.model, self.adapter
        x, (pos, valid) = self.hidden(T), self._pos(T)
        head = model.heads[exit_name]

        def run_layer(module, hidden):
            return ad.run_module(module, head.layer_type, hidden, cache_index=head.cache_index, position_ids=pos,
                                 cache=self.cache, valid=valid)

        ctx = None
        if head.needs_context:  # its window of states: the cost depends on the window, not on the context length
            S = self.context + T
            states = [torch.randn(1, S, ad.hidden_size, generator=self.gen).to(ad.device, ad.dtype)
                      for _ in head.context_layers]
            avail = [pos[:, -1] + 1 if L == head.context_layers[0] else pos[:, 0] for L in head.context_layers]
            ctx = ContextInputs(states=states, avail=avail, query_pos=pos, layers=list(head.context_layers))

        def run():
            with torch.no_grad():
                model.exit_logits(exit_name, x, run_layer=run_layer if head.stateful else None, context=ctx)
            if head.stateful:
                self.cache.truncate(head.cache_index, head.cache_index + 1, self.keep)

        return run

    def final(self, T: int):
        ad, x = self.adapter, self.hidden(T)

        def run():
            with torch.no_grad():
                ad.final_logits(x)

        return run


def nondecreasing(table: dict) -> dict:
    """The least-squares non-decreasing fit of `{T: seconds}` (pool adjacent violators): a pass over more positions
    is not cheaper than over fewer, so a dip between measured T is timing noise (shared or busy cores)."""
    keys = sorted(table)
    blocks: list[list[float]] = []  # [sum, count]
    for k in keys:
        blocks.append([table[k], 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    values = [b[0] / b[1] for b in blocks for _ in range(b[1])]
    return dict(zip(keys, values))


def measure_layer_costs(model, rows=(1, 2, 4, 8), context: int = 256, repeats: int = 10,
                        bench: KVBench | None = None) -> dict:
    """{T: seconds of one decoder layer over T new positions}: a pass over all layers / depth (not one layer
    timed alone, whose weights would stay in cache between repeats). Raw medians, not smoothed."""
    bench = bench or KVBench(model, context)
    L = model.adapter.num_layers
    return {T: t / L for T, t in median_times({T: bench.layers(T) for T in rows}, repeats).items()}


def measure_costs(model, rows=tuple(range(1, DEFAULT_MAX_GAMMA + 2)), context: int = 256, repeats: int = 10) -> dict:
    """Unit costs of an `EarlyExitModel`: {"layer": {T: s}, "head": {"L<k>": {T: s}}, "final": {T: s}}, medians
    of `repeats` interleaved timings, each made non-decreasing in T (`nondecreasing`)."""
    bench = KVBench(model, context)
    exits = {"draft": model.draft_layer, "verify": model.verify_layer}
    fns = {("final", T): bench.final(T) for T in rows}
    fns.update({(name, T): bench.head(name, T) for name in exits for T in rows})
    t = median_times(fns, repeats)
    return {"layer": nondecreasing(measure_layer_costs(model, rows, context, repeats, bench)),
            "head": {level_name(layer): nondecreasing({T: t[(name, T)] for T in rows})
                     for name, layer in exits.items()},
            "final": nondecreasing({T: t[("final", T)] for T in rows})}


def _calibration_contexts(model, name: str, states: dict, T: int, gen: torch.Generator) -> dict:
    """Teacher-forced inputs of exit `name`'s context head, one per level that verifies it ({upper level: ctx}).

    The latency model takes one acceptance rate per pair of levels, while a context head's agreement falls with
    the distance d to the last position the full model verified. Each pair is measured under the distances its
    hierarchy produces at the checkpoint's gamma g and window N, drawn uniformly per position: the draft under
    the full model (self-spec) d in 1..g; under the verifier exit d in 1..N*g (reading the verifier's states of
    the last d' in 1..min(d, g) positions, if the head reads that exit); the verifier exit under the full model
    d in 1..N*g. The rate is then the mean over those distances, an approximation (per-position rates would need
    the latency model to take a rate per draft position)."""
    cfg = model.hispec_config
    g, N = max(1, int(cfg.gamma)), max(1, int(cfg.window))
    head = model.heads[name]
    v_layer = model.verify_layer

    def uniform(hi):
        return torch.randint(1, hi + 1, (1, T), generator=gen).to(model.device)

    if name == "verify":
        return {FULL: head.sequence_context(states, uniform(N * g))}
    out = {FULL: head.sequence_context(states, uniform(g))}
    d = uniform(N * g)
    mid = torch.minimum(uniform(g), d) if v_layer in head.context_layers else None
    out[level_name(v_layer)] = head.sequence_context(states, d, mid)
    return out


def _prompt_ids(model, prompt) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        return [int(x) for x in prompt.flatten().tolist()]
    if isinstance(prompt, (list, tuple)):
        return [int(x) for x in prompt]
    text = prompt.text if isinstance(prompt, Prompt) else str(prompt)
    if model.tokenizer is None:
        raise ValueError("text prompts need the model's tokenizer, and this model has none; pass token id lists")
    return render(model.tokenizer, text, chat=True)


def ngram_rounds(tokens: torch.Tensor, P: int, answer: list[int], upper_argmax: list[int], ngram: NgramConfig,
                 lookup_times: list | None = None) -> tuple[int, int, int, int, int]:
    """The rounds an n-gram level runs under a verifier U along a known greedy answer, as the decoder would:
    lookup over the known prefix, the proposal walked against U's argmax until the first mismatch (one rejection),
    then U's own token; a round without a proposal is U's own token. `tokens` [P + N] = prompt + answer,
    `upper_argmax[q - 1]` = U's argmax for answer token q (teacher-forced); answer token 0 comes from prefill.
    Returns (accepted, proposed, rejections, rounds, rounds with a proposal); a walk that leaves the answer (U
    accepts a token the answer does not continue with) or runs past it is censored (no rejection)."""
    N = len(answer)
    acc = proposed = rej = rounds = matched = 0
    j = 1  # answer token j is next; known: prompt + answer[:j]
    while j < N:
        t0 = time.perf_counter()
        prop = propose(tokens[: P + j], ngram).tolist()
        if lookup_times is not None:
            lookup_times.append(time.perf_counter() - t0)
        rounds += 1
        a = 0
        if prop:
            matched += 1
            proposed += len(prop)
            for i, t in enumerate(prop):
                q = j + i
                if q >= N:
                    break
                if t != upper_argmax[q - 1]:
                    rej += 1
                    break
                a += 1
                if t != answer[q]:
                    break
            acc += a
        j += a + 1  # the accepted proposals, then U's own token
    return acc, proposed, rej, rounds, matched


def fit_decoder_costs(step: float | None, draft: float | None, *, L: int, e: int, layer: float, final: float,
                      head: float) -> tuple[float, float]:
    """(layer_scale, step_overhead) from a measured plain decode step and draft step (see `calibrate`, step 4);
    without a draft step all the unexplained time is per-pass overhead, as before."""
    if not step:
        return 1.0, 0.0
    S = step - final
    top = max(1.0, S / (L * layer))
    scale = 1.0 if draft is None or L <= e else min(max((S - (draft - head)) / ((L - e) * layer), 1.0), top)
    return scale, max(0.0, S - scale * L * layer)


def _draft_step_seconds(model, ids_list: list[list[int]], max_new_tokens: int) -> float | None:
    """The decoder's median seconds per draft step of the draft exit (level 0 of `self-spec`), over short runs after
    one untimed warm-up run."""
    per = []
    max_pos = getattr(model.adapter.config, "max_position_embeddings", None)
    for i, ids in enumerate(ids_list[:1] + ids_list):  # the first run warms up (kernels for new shapes), untimed
        n = min(max_new_tokens, 32, max_pos - len(ids) if max_pos else 32)
        if n < 2:
            continue
        out = model.generate(torch.tensor([ids], device=model.adapter.device), strategy="self-spec", max_new_tokens=n)
        st = out.stats.levels[0]
        if st.passes and i:
            per.append(st.seconds / st.passes)
    return statistics.median(per) if per else None


def calibrate(model, prompts, *, max_new_tokens: int = 64, ngram: NgramConfig | None = None,
              progress: bool = False, repeats: int = 10, max_gamma: int = DEFAULT_MAX_GAMMA) -> Calibration:
    """Measure a `Calibration` of `model` (an `EarlyExitModel`) on this machine, in its dtype and thread count.

    `prompts`: texts (rendered with the chat template), `hispec.prompts.Prompt`s or token id lists. Steps:
    1. greedy answers (`strategy="ar"`, `max_new_tokens`), timed: the median decode step (prefill excluded);
    2. prompt + answer teacher-forced once: per answer position the argmax of every exit head and of the model;
       top-1 agreement per pair of levels over all answer positions (every position is a draft opportunity);
       for "ngram" under each level U the decoder's rounds along the answer: a lookup over the known prefix,
       the proposal walked against U's argmax until the first mismatch, then U's own token (so a copied span
       counts once, as in decoding, not once per position): per-token acceptance by `acceptance_from_counts`,
       `ngram_match` = the share of rounds (under "full") whose lookup proposes, the median lookup time; for
       every n-gram config measured (`ngram`; None: the checkpoint's `decoding.ngram` if it sets one, else each of
       NGRAM_CANDIDATES, and the one `auto_plan` predicts fastest is kept, the others listed in `ngram_options`);
    3. unit costs (`measure_costs`) behind a KV cache of the typical context (median prompt + half an answer),
       for T = 1..max(max_gamma, ngram.max_len) + 1 and the tree passes' TREE_ROWS; per exit, the share of answer
       positions where the model's argmax is among the exit's top-k (k = 1..MAX_TREE_WIDTH; tree drafts);
    4. the decoder's own costs beyond the timed units, fitted on two real decode steps: the plain step of 1. and a
       draft step of the draft exit (its level-0 seconds per pass in a short `self-spec` run on up to 3 of the
       prompts). With S = plain step - final(1) and D = draft step - head(1): a per-layer factor
       `layer_scale` = (S - D) / ((L - e) layer(1)) (clamped to [1, S / (L layer(1))]) and the per-pass
       `step_overhead` = S - layer_scale L layer(1) (>= 0). A layer can run slower inside the decoder than timed
       alone; charged per pass instead, that time priced every cheap draft step like a full step's extra (Qwen2.5-
       1.5B, bf16, 2-core EPYC: 71 ms of a 217 ms step; the fit gives x1.09 per layer and ~2 ms per pass). On a
       small model the extra time is Python per pass, and the fit says so (layer_scale ~1)."""
    ad = model.adapter
    L, dev = ad.num_layers, ad.device
    exits = {"draft": model.draft_layer, "verify": model.verify_layer}
    ids_list = [_prompt_ids(model, p) for p in prompts]
    if not ids_list or any(not ids for ids in ids_list):
        raise ValueError("calibration needs at least one non-empty prompt")
    max_pos = getattr(ad.config, "max_position_embeddings", None)
    if ngram is None and getattr(model.hispec_config, "ngram", None):
        ngram = NgramConfig(**model.hispec_config.ngram)
    configs = [ngram] if ngram is not None else list(NGRAM_CANDIDATES)

    # 1. the model's own greedy answers, timed
    answers, steps = [], []
    for ids in tqdm(ids_list, desc="calibration: greedy answers", disable=not progress, file=sys.stderr):
        n_new = max_new_tokens if not max_pos else max(0, min(max_new_tokens, max_pos - len(ids)))
        t0 = time.perf_counter()
        out = model.generate(torch.tensor([ids], device=dev), strategy="ar", max_new_tokens=n_new)
        wall = time.perf_counter() - t0
        new = list(out.new_tokens[0])
        answers.append(new)
        if len(new) >= 2:
            steps.append((wall - out.stats.seconds.get("prefill", 0.0)) / (len(new) - 1))

    # 2. acceptances, teacher-forced along those answers
    levels = [level_name(layer) for layer in sorted(exits.values())] + [FULL]
    agree = {pair_key(a, b): [0, 0] for i, a in enumerate(levels) for b in levels[i + 1:]}
    # per n-gram config and level: accepted, proposed, rejections, rounds, rounds with a proposal
    ng = [{lv: [0, 0, 0, 0, 0] for lv in levels} for _ in configs]
    positions = 0
    lookups = []
    topk_hits: dict[str, list[int]] = {}
    bounds = sorted({0, L, *exits.values()})
    draw = torch.Generator().manual_seed(0)  # frontier distances of context heads (reproducible)
    for ids, ans in tqdm(list(zip(ids_list, answers)), desc="calibration: acceptance", disable=not progress,
                         file=sys.stderr):
        P, N = len(ids), len(ans)
        if N < 2:
            continue
        seq = torch.tensor([ids + ans], device=dev)
        pos = torch.arange(P + N, device=dev)[None]
        cache = ad.new_cache(1)
        arg, states, top = {}, {}, {}
        with torch.no_grad():
            h = ad.embed(seq, pos)
            for a, b in zip(bounds[:-1], bounds[1:]):
                h = ad.run_layers(h, a, b, position_ids=pos, cache=cache)
                states[b] = h
            arg[FULL] = ad.final_logits(h[:, P: P + N - 1])[0].argmax(-1).tolist()
            for name, layer in exits.items():
                head = model.heads[name]
                lv = level_name(layer)
                if head.needs_context:  # its agreement under the frontier distances decoding gives it
                    for below, ctx in _calibration_contexts(model, name, states, P + N, draw).items():
                        logits = model.project_exit(name, head(states[layer], context=ctx)[:, P: P + N - 1])[0]
                        arg[(lv, below)] = logits.argmax(-1).tolist()
                        if below == FULL:
                            top[lv] = logits.topk(min(MAX_TREE_WIDTH, logits.shape[-1]), dim=-1).indices
                    arg[lv] = arg[(lv, FULL)]
                    continue
                run_layer = head.run_layer_fresh(ad) if head.stateful else None
                feats = head(states[layer], run_layer)[:, P: P + N - 1]  # positions predicting answer tokens 1..N-1
                logits = model.project_exit(name, feats)[0]
                arg[lv] = logits.argmax(-1).tolist()
                top[lv] = logits.topk(min(MAX_TREE_WIDTH, logits.shape[-1]), dim=-1).indices
        full_arg = torch.tensor(arg[FULL], device=dev)[:, None]
        for lv, idx in top.items():  # the model's argmax among the exit's top-k, k = 1..MAX_TREE_WIDTH
            hit = (idx == full_arg).cumsum(-1).clamp(max=1).sum(0).tolist()
            topk_hits[lv] = [a + b for a, b in zip(topk_hits.setdefault(lv, [0] * len(hit)), hit)]
        for key, c in agree.items():
            lo, hi = key.split(">")
            c[0] += sum(x == y for x, y in zip(arg.get((lo, hi), arg[lo]), arg[hi]))
            c[1] += N - 1
        positions += N - 1
        for c, cfg in enumerate(configs):
            for lv in levels:
                counts = ngram_rounds(seq[0].cpu(), P, ans, arg[lv], cfg, lookups if c == 0 else None)
                ng[c][lv] = [x + y for x, y in zip(ng[c][lv], counts)]
    if positions == 0:
        raise ValueError(f"calibration needs answers of >= 2 tokens; got none (max_new_tokens={max_new_tokens})")
    acceptance = {k: c[0] / c[1] for k, c in agree.items()}
    ngram_acc = [{pair_key(NGRAM, lv): acceptance_from_counts(*counts[:3]) or 0.0 for lv, counts in per.items()}
                 for per in ng]
    # exact for ngram > full: teacher forcing follows the model's own greedy path
    ngram_match = [per[FULL][4] / max(per[FULL][3], 1) for per in ng]

    # 3. unit costs, behind the typical context
    context = int(statistics.median(len(ids) + len(ans) // 2 for ids, ans in zip(ids_list, answers)))
    chain = max(max_gamma, *(cfg.max_len for cfg in configs)) + 1
    rows = tuple(range(1, chain + 1)) + tuple(T for T in TREE_ROWS if T > chain)  # chains; passes over trees
    if max_pos:
        context = max(1, min(context, max_pos - 2 * max(rows) - 2))
    if progress:
        print(f"calibration: timing layers and heads ({context} KV slots, T = 1..{chain}, "
              f"{', '.join(map(str, rows[chain:]))})", file=sys.stderr)
    costs = measure_costs(model, rows, context, repeats)
    costs["ngram"] = statistics.median(lookups)

    # 4. the decoder's own costs: a per-layer factor and a per-pass overhead, from a plain and a draft step
    step = statistics.median(steps) if steps else None
    draft = _draft_step_seconds(model, ids_list[:3], max_new_tokens) if step else None
    costs["layer_scale"], costs["step_overhead"] = fit_decoder_costs(
        step, draft, L=L, e=exits["draft"], layer=costs["layer"][1], final=costs["final"][1],
        head=costs["head"][level_name(exits["draft"])][1])
    measured = {"ar": 1.0 / step} if step else None

    # 5. the n-gram config: of those measured, the one auto's plan is predicted fastest with (the first on a tie)
    def with_config(c: int, options=None) -> Calibration:
        cfg = configs[c]
        return Calibration(machine=machine_fingerprint(dev, model), dtype=_dtype_name(ad.dtype),
                           threads=torch.get_num_threads(), model=model_identity(model), costs=costs,
                           acceptance={**acceptance, **ngram_acc[c]}, ngram_match=ngram_match[c], measured=measured,
                           context=context, positions=positions,
                           ngram={"max_ngram": cfg.max_ngram, "min_ngram": cfg.min_ngram, "max_len": cfg.max_len},
                           topk={pair_key(lv, FULL): [h / positions for h in hits] for lv, hits in topk_hits.items()},
                           ngram_options=options)

    if len(configs) == 1:
        return with_config(0)
    options = []
    for c in range(len(configs)):
        cal = with_config(c)
        options.append({"config": cal.ngram, "match": cal.ngram_match, "acceptance": ngram_acc[c],
                        "seconds_per_token": auto_plan(cal, max_depth=min(5, max_new_tokens)).seconds_per_token})
    best = min(range(len(configs)), key=lambda c: options[c]["seconds_per_token"])
    return with_config(best, options)


# ---------------------------------------------------------------------------------------------- storage
def write_calibration(folder: str | os.PathLike, cal: Calibration | None) -> Path:
    """Store `cal` as config.json["hispec"]["calibration"] of the checkpoint `folder` (temporary file +
    os.replace: a crash leaves the old config); None removes it."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: a calibration is stored in a local hispec checkpoint folder")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(cfg.get("hispec"), dict):
        raise CalibrationError(f"{path} has no 'hispec' entry: a calibration belongs in a hispec checkpoint")
    if cal is None:
        cfg["hispec"].pop("calibration", None)
    else:
        cfg["hispec"]["calibration"] = cal.to_dict()
    write_json(path, cfg)
    return path


def read_calibration(source) -> Calibration | None:
    """The calibration of a checkpoint, or None when it has none. `source`: an `EarlyExitModel` (its
    `hispec_config.calibration`), a config.json dict, its "hispec" entry, a calibration dict, or a checkpoint
    folder / config.json path."""
    if source is None:
        return None
    if isinstance(source, Calibration):
        return source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        return read_calibration(json.loads(path.read_text(encoding="utf-8")))
    if hasattr(source, "hispec_config"):
        return read_calibration(getattr(source.hispec_config, "calibration", None))
    if not isinstance(source, dict):
        raise CalibrationError(f"cannot read a calibration from {type(source).__name__}")
    if "costs" in source and "acceptance" in source:
        return Calibration.from_dict(source)
    if isinstance(source.get("hispec"), dict):
        source = source["hispec"]
    cal = source.get("calibration")
    return None if cal is None else read_calibration(cal)


__all__ = [
    "Calibration",
    "CalibrationError",
    "Choice",
    "LOOKUP",
    "KVBench",
    "acceptance_from_counts",
    "best_gammas",
    "best_hierarchy",
    "calibrate",
    "expected_tokens",
    "fit_decoder_costs",
    "format_predictions",
    "interp",
    "level_pairs",
    "lookup_exit",
    "machine_fingerprint",
    "measure_costs",
    "measure_layer_costs",
    "median_times",
    "model_identity",
    "ngram_rounds",
    "nondecreasing",
    "named_hierarchies",
    "predictions",
    "read_calibration",
    "time_per_token",
    "write_calibration",
]
