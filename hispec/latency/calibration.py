"""The `Calibration` record: the measured inputs of the latency model for one model on one kind of machine.

Contract: a `Calibration` holds the unit costs and acceptance rates the formulas of `hispec.latency.model` take
(costs interpolated and memoised per instance; `at_batch(rows)` the same as one row of a batch sees them),
round-trips through JSON (`to_dict` / `from_dict`, format `CALIBRATION_VERSION`), and `check(model)` raises
`CalibrationError` when it was made for another model or on another kind of machine (`model_identity`,
`machine_fingerprint`). `write_calibration` / `read_calibration` store it in a checkpoint as
`config.json["hispec"]["calibration"]` and read it back. Measuring one is `calibrate`'s (`hispec.latency.measure`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .. import matvec, packed
from ..io import cpu_model, write_json  # noqa: F401  (cpu_model: re-exported)
from ..drafters.ngram import NgramConfig
from .levels import EAGLE, FULL, LOOKUP, NGRAM, CalibrationError, gate_key, interp, level_name, lookup_exit

CALIBRATION_VERSION = 1


# ---------------------------------------------------------------------------------------------- calibration
def machine_fingerprint(device=None, model=None) -> dict:
    """What makes timings transferable: CPU model and vector capability, device type (and GPU name), torch, and
    with `model` (an `EarlyExitModel`) its linear kernels (`hispec.packed.kind`: prepacked or stock) and, where
    they include `hispec.matvec`'s, that library's build (its source digest: a changed kernel changes the costs)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    fp = {"cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "device": dev.type,
          "cuda_name": None, "torch": torch.__version__, "platform": platform.machine()}
    if model is not None:
        fp["linear"] = packed.kind(model.base)
        if packed.STREAMED in fp["linear"]:
            fp["streamed"] = matvec.library_path().stem
    if dev.type == "cuda" and torch.cuda.is_available():
        fp["cuda_name"] = torch.cuda.get_device_name(dev)
    return fp


def model_identity(model) -> dict:
    """The facts about an `EarlyExitModel` that its costs and acceptances depend on."""
    ad, cfg = model.adapter, model.hispec_config
    exits = {"draft": model.draft_layer, "verify": model.verify_layer}
    heads = {level_name(layer): {"exit": name, "type": cfg.head_type, "vocab_size": model.vocab_size_of(name)}
             for name, layer in exits.items()}
    out = {"num_layers": ad.num_layers, "hidden_size": ad.hidden_size, "vocab_size": ad.vocab_size,
           "model_type": getattr(ad.config, "model_type", None), "exits": exits, "heads": heads}
    drafter = getattr(model, "drafter", None)
    if drafter is not None:
        out["drafter"] = drafter_identity(drafter)
    return out


def drafter_identity(drafter) -> dict:
    """What a drafter's costs and acceptance depend on: its aux layers, draft vocabulary and weights (a digest of
    the first 4096 values of every tensor, so a retrained drafter of the same shape is told apart). Computed once
    per drafter object (decoding checks it every call; a drafter's weights do not change while it decodes)."""
    known = getattr(drafter, "_hispec_identity", None)
    if known is not None:
        return dict(known)
    h = hashlib.sha256()
    for name, t in sorted(drafter.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    c = drafter.config
    out = {"type": EAGLE, "aux_layers": list(c.aux_layers), "draft_vocab_size": int(c.draft_vocab_size),
           "weights": h.hexdigest()[:16]}
    drafter._hispec_identity = out
    return dict(out)


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
    """Measured inputs of the latency model for one model on one kind of machine (the formulas are
    `hispec.latency.model`'s).

    `costs`: {"layer": {T: s}, "head": {"L4": {T: s}, ...}, "final": {T: s}, "ngram": s, "step_overhead": s,
    "layer_scale": x} (x: the factor by which a layer runs slower inside the decoder than timed alone, fitted by
    `calibrate`; absent = 1) and, calibrated with an EAGLE-3 drafter attached, "drafter": {T: s} (one drafter pass
    over T entries; `model["drafter"]` then names that drafter, `drafter_identity`), "drafter_overhead" and
    "drafter_verify_overhead" (s per pass, fitted on real `eagle` runs; absent = 0), "tree_overhead" (s per static
    tree round, fitted on real tree runs; absent = 0), "position_overhead" (s per verified position past the first,
    fitted on real `ngram` runs; absent = 0), all shared by a batch's rows like `step_overhead`; with a drafter,
    "drafter_gates" (per confidence gate measured: its chains' acceptance and pass rate) and "drafter_gate" (the one
    chains are priced and `auto` runs with; absent = 0, full chains);
    `acceptance`: {"ngram>L4": a, "L4>L8": a, "L4>full": a, "eagle3>full": a, ...} for every pair lower < upper; `ngram_match`: the
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
    # what `calibrate`'s time budget left out: {"max_seconds": s, "seconds": spent, "skipped": {...}} (None: before
    # budgets; an empty "skipped": nothing)
    budget: dict | None = None
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
        drafter = [EAGLE] if self.has_drafter else []
        if self.costs.get("ngram") is None:
            return drafter + exits + [FULL]
        return [NGRAM] + drafter + exits + [LOOKUP + e for e in drafter + exits] + [FULL]

    # ------------------------------------------------------------------ the drafter's confidence gate
    @property
    def drafter_gate(self) -> float:
        """The confidence gate the drafter's chains are priced (and `auto` runs them) with: a chain stops at the
        first draft whose probability under the drafter is below it (`generate(draft_gate=)`); 0 = full chains.
        `calibrate` keeps the gate of `drafter_gates` (or 0) that `auto_plan` is predicted fastest with."""
        return float(self.costs.get("drafter_gate") or 0.0)

    @property
    def drafter_gates(self) -> dict:
        """{"0.3": {"acceptance": a, "pass": q, ...}, ...}: per gate measured, the acceptance of the drafts a gated
        chain proposes and the share of draft steps that pass the gate (a step below it ends the chain)."""
        return self.costs.get("drafter_gates") or {}

    @property
    def drafter_pass(self) -> float:
        """The share of the drafter's steps that pass `drafter_gate` (1.0 ungated)."""
        g = self.drafter_gate
        return float(self.drafter_gates[gate_key(g)]["pass"]) if g > 0 else 1.0

    def with_gate(self, gate: float) -> Calibration:
        """This calibration pricing the drafter's chains at `gate` (0: full chains; else one of `drafter_gates`)."""
        gate = float(gate)
        if gate == self.drafter_gate:
            return self
        if gate > 0 and gate_key(gate) not in self.drafter_gates:
            raise CalibrationError(f"no drafter gate {gate:g} in this calibration (it measured "
                                   f"{', '.join(self.drafter_gates) or 'none'})")
        return replace(self, costs={**self.costs, "drafter_gate": gate})

    def rate(self, key: str) -> float | None:
        """The acceptance rate of a pair ("L4>full"): the drafter's at its gate where one is set, else as
        measured; None when not measured."""
        if key == f"{EAGLE}>{FULL}" and self.drafter_gate > 0:
            return float(self.drafter_gates[gate_key(self.drafter_gate)]["acceptance"])
        return self.acceptance.get(key)

    @property
    def has_drafter(self) -> bool:
        """Whether this calibration prices an EAGLE-3 drafter (its cost curve and its acceptance under "full")."""
        return bool(self.costs.get("drafter")) and f"{EAGLE}>{FULL}" in self.acceptance

    def without_drafter(self) -> Calibration:
        """This calibration with the drafter's figures removed (for a model whose drafter it did not measure)."""
        if not self.has_drafter and "drafter" not in self.costs:
            return self
        costs = {k: v for k, v in self.costs.items() if k not in ("drafter", "drafter_gate", "drafter_gates")}
        acceptance = {k: v for k, v in self.acceptance.items() if EAGLE not in k}
        model = {k: v for k, v in self.model.items() if k != "drafter"}
        return replace(self, costs=costs, acceptance=acceptance, model=model)

    def for_model(self, model) -> Calibration:
        """This calibration, without the drafter's figures unless `model` carries the very drafter they were
        measured with (a retrained or missing drafter: its levels are not priced, so `auto` does not pick them)."""
        if "drafter" not in self.costs:
            return self
        have = model_identity(model).get("drafter")
        return self if have is not None and have == self.model.get("drafter") else self.without_drafter()

    @property
    def ngram_max_len(self) -> int:
        """The longest n-gram proposal the n-gram figures were measured with (a lookup-first level proposes that)."""
        return int((self.ngram or {}).get("max_len", NgramConfig().max_len))

    def depth(self, level: str) -> int:
        exit_level = lookup_exit(level)
        if exit_level == EAGLE and self.costs.get("ngram") is not None and self.has_drafter:
            return 0
        if exit_level is not None and self.costs.get("ngram") is not None and exit_level in self.costs.get("head", {}):
            return int(exit_level[1:])  # (a lookup-first level needs a measured n-gram and a measured exit)
        if level == NGRAM or (level == EAGLE and self.has_drafter):
            return 0  # (the drafter's tokens, like the lookup's, ran through no layer of the model)
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
        if level == EAGLE:
            return self._cached(("drafter", T), lambda: interp(self.costs["drafter"], T))
        return self._cached(("head", level, T), lambda: interp(self.costs["head"][level], T))

    # the decoder's own costs beyond the timed units, fitted by `calibrate` on real runs (seconds; 0 when absent)
    step_overhead = property(lambda self: self._fitted("step_overhead"), doc="per pass (Python bookkeeping)")
    drafter_overhead = property(lambda self: self._fitted("drafter_overhead"), doc="per drafter pass")
    drafter_verify_overhead = property(lambda self: self._fitted("drafter_verify_overhead"),
                                       doc="per verification under the drafter (the aux layers' capture)")
    position_overhead = property(lambda self: self._fitted("position_overhead"),
                                 doc="per position a pass covers past the first")
    tree_overhead = property(lambda self: self._fitted("tree_overhead"), doc="per static tree round")
    FITTED = ("drafter_overhead", "drafter_verify_overhead", "tree_overhead", "drafter_tree_overhead",
              "position_overhead")

    @property
    def drafter_tree_overhead(self) -> float:
        """Per round of a drafter's static tree (its tree masks over the draft entries, the nodes' gathers); the exit
        trees' `tree_overhead` in older calibrations that did not time drafter trees."""
        return float(self.costs.get("drafter_tree_overhead", self.tree_overhead))

    def _fitted(self, name: str) -> float:
        return float(self.costs.get(name, 0.0))

    @property
    def ngram_cost(self) -> float:
        return float(self.costs.get("ngram") or 0.0)

    def _cached(self, key, fn):
        units = self._memo.setdefault("units", {})
        if key not in units:
            units[key] = fn()
        return units[key]

    def at_batch(self, rows: int) -> Calibration:
        """This calibration as one row of a batch of `rows` rows decoding together sees it: every pass cost measured
        at T positions becomes the cost of the batch's pass over rows x T positions, shared by its rows
        (`interp(table, rows * T) / rows`), and the per-pass overhead is shared too; the lookup's cost stays per row
        (each row looks up its own tokens). The timed passes are one row's, so this reads the batch's pass off the
        same curve: while rows x T stays in the flat part (the weights' load dominates) a verification of several
        positions is still nearly free, beyond it (compute-bound) every extra position costs its share, which is why
        speculation that pays alone can lose in a full batch (attention over each row's own cache scales the same
        way: rows x T queries over `context` keys). Every formula then prices a row at the batch's marginal costs,
        and plain decoding at its own (`plain_seconds_per_token` = the batch's plain step / rows). rows <= 1:
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
            if self.costs.get("drafter"):
                costs["drafter"] = share(self.costs["drafter"])
            costs["step_overhead"] = self.step_overhead / rows
            for name in self.FITTED:  # (per pass or round: shared by the rows, like `step_overhead`)
                if name in self.costs:
                    costs[name] = float(self.costs[name]) / rows
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
            "budget": self.budget,
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
            for name in cls.FITTED:  # (older calibrations have none: 0)
                if c.get(name) is not None:
                    costs[name] = float(c[name])
            if c.get("drafter"):
                costs["drafter"] = _int_keys(c["drafter"])
            if c.get("drafter_gates"):  # (absent from older calibrations)
                costs["drafter_gates"] = {gate_key(float(g)): {k: float(v) for k, v in o.items()}
                                          for g, o in c["drafter_gates"].items()}
                costs["drafter_gate"] = float(c.get("drafter_gate") or 0.0)
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
                       budget=d.get("budget"), version=version)
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
        elif self.machine.get("streamed") != here.get("streamed"):
            diffs.append(f"the streamed kernel: calibrated with build {self.machine.get('streamed')}, this hispec "
                         f"runs {here['streamed']} (hispec.matvec changed)")
        if _dtype_name(model.dtype) != self.dtype:
            diffs.append(f"dtype: calibrated {self.dtype}, model runs in {_dtype_name(model.dtype)}")
        if diffs:
            raise CalibrationError(f"the latency calibration was measured on another machine or setup "
                                   f"({self.describe_machine()}): " + "; ".join(diffs)
                                   + "; its timings do not hold here. Recalibrate on this machine "
                                   "(hispec.latency.calibrate(model, prompts)) or choose a strategy explicitly")



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