"""The parameter sweep: `sweep_settings` (draft / verify layers, gamma, window), `run_sweep` (every setting against `hf`
on the same prompts, interleaved), `SweepResult.best` and `format_sweep_table`. The best setting is written into a
checkpoint by `hispec.export.write_decoding_defaults`."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from ..model import EarlyExitModel, HispecConfig
from ..prompts import Prompt
from .env import hardware_info, model_info
from .runner import (
    SWEEPABLE, BenchConfig, Runner, Sample, TieChecker, _progress, _rotated, check_fits, encode, tie_tolerance,
)
from .summary import _median


# ---------------------------------------------------------------------------------------------------- sweep
@dataclass(frozen=True)
class Setting:
    strategy: str
    draft_layer: int
    verify_layer: int | None  # None for self-spec
    gamma: int
    window: int | None  # None for self-spec

    @property
    def label(self) -> str:
        if self.strategy == "self-spec":
            return f"self-spec d{self.draft_layer} g{self.gamma}"
        return f"hispec d{self.draft_layer} v{self.verify_layer} g{self.gamma} w{self.window}"


def sweep_settings(strategies, draft_layers, verify_layers, gammas, windows, num_layers: int) -> list[Setting]:
    """The grid, without invalid (1 <= L_d < L_i < L) or duplicate settings."""
    out: list[Setting] = []
    for s in strategies:
        if s not in SWEEPABLE:
            raise ValueError(f"sweeps tune {' and '.join(SWEEPABLE)}, not '{s}'")
        for d, v, g, w in itertools.product(draft_layers, verify_layers, gammas, windows):
            if not 1 <= d < num_layers or g < 1 or w < 1:
                raise ValueError(f"invalid sweep values: draft layer {d} (1..{num_layers - 1}), gamma {g}, window {w}")
            if s == "self-spec":
                st = Setting(s, d, None, g, None)
            elif d < v < num_layers:
                st = Setting(s, d, v, g, w)
            else:
                continue
            if st not in out:
                out.append(st)
    if not out:
        raise ValueError(f"no valid setting in the sweep grid: need draft layer < verify layer < {num_layers}")
    return out


def model_for_exits(model, draft_layer: int, verify_layer: int, layers_free: bool):
    """`model` itself if its exits match, else (when `layers_free`) a sibling sharing the base with fresh heads."""
    if (draft_layer, verify_layer) == (model.draft_layer, model.verify_layer):
        return model
    if not layers_free:
        raise ValueError(
            f"the heads were trained for exits {model.draft_layer}/{model.verify_layer} and cannot move to "
            f"{draft_layer}/{verify_layer}; sweep only gamma and window on a trained checkpoint, or sweep layers on "
            "a base model with --head-type shared (or norm)"
        )
    h = model.hispec_config
    cfg = HispecConfig(draft_layer=draft_layer, verify_layer=verify_layer, head_type=h.head_type,
                       head_rank=h.head_rank, gamma=h.gamma, window=h.window, base=dict(h.base))
    sibling = EarlyExitModel(model.base, cfg, tokenizer=model.tokenizer)
    for name in ("draft", "verify"):  # the same output vocabularies as the model's heads
        sibling.set_exit_vocab(name, model.heads[name].vocab)
    return sibling


@dataclass
class SettingResult:
    setting: Setting
    tokens_per_s: float
    speedup_vs_hf: float
    tokens_per_target_pass: float
    identical: float
    identical_up_to_ties: float


@dataclass
class SweepResult:
    results: list[SettingResult]
    hf_tokens_per_s: float
    model_info: dict
    hardware: dict
    config: BenchConfig
    tie_tolerance: float = 0.0

    @property
    def best(self) -> SettingResult | None:
        """The fastest setting that reproduced hf on every prompt (up to rounding ties)."""
        ok = [r for r in self.results if r.identical_up_to_ties == 1.0]
        return max(ok, key=lambda r: r.speedup_vs_hf) if ok else None

    def best_of(self, strategy: str) -> SettingResult | None:
        ok = [r for r in self.results if r.identical_up_to_ties == 1.0 and r.setting.strategy == strategy]
        return max(ok, key=lambda r: r.speedup_vs_hf) if ok else None

    def as_dict(self) -> dict:
        row = lambda r: None if r is None else {**asdict(r.setting), "label": r.setting.label,  # noqa: E731
                                                **{k: v for k, v in asdict(r).items() if k != "setting"}}
        best = self.best
        best_ss = self.best_of("self-spec")
        return {
            "best": row(best),
            "best_per_strategy": {s: row(self.best_of(s)) for s in SWEEPABLE
                                  if any(r.setting.strategy == s for r in self.results)},
            "speedup_best_vs_best_self_spec": (best.speedup_vs_hf / best_ss.speedup_vs_hf
                                               if best and best_ss and best.setting.strategy == "hispec" else None),
            "hf_tokens_per_s": self.hf_tokens_per_s,
            "tie_tolerance": self.tie_tolerance,
            "results": [row(r) for r in self.results],
            "config": {**asdict(self.config), "strategies": list(self.config.strategies)},
            "model": self.model_info,
            "hardware": self.hardware,
        }


def run_sweep(model, prompts: list[Prompt], settings: list[Setting], config: BenchConfig, *,
              layers_free: bool, progress: bool = False) -> SweepResult:
    """Time `hf` and every setting on each prompt, interleaved with a rotating order; greedy only."""
    if not config.greedy:
        raise ValueError("a sweep checks identical outputs and runs greedy only (temperature 0)")
    models: dict = {}
    for s in settings:
        if s.strategy == "self-spec" and s.draft_layer == model.draft_layer:
            models[s] = model  # the verify exit is unused by self-spec
            continue
        v = s.verify_layer if s.verify_layer is not None else max(model.verify_layer, s.draft_layer + 1)
        key = (s.draft_layer, v)
        if key not in models:
            models[key] = model_for_exits(model, s.draft_layer, v, layers_free)
        models[s] = models[key]
    encoded = encode(model, prompts, config.chat)
    check_fits(model, encoded, config.max_new_tokens)
    runner = Runner(model, config)
    jobs = ["hf"] + list(settings)
    times: dict[object, list[float]] = {j: [] for j in jobs}
    ident: dict[object, list[bool]] = {j: [] for j in jobs}
    diverged: dict[object, list[tuple[int, list[int], list[int]]]] = {j: [] for j in jobs}
    passes: dict[object, list[tuple[int, int]]] = {j: [] for j in jobs}

    def run(job, ids, mask, n=None) -> Sample:
        if job == "hf":
            return runner.run("hf", ids, mask, config.seed, max_new_tokens=n)
        return runner.run(job.strategy, ids, mask, config.seed, max_new_tokens=n, gamma=job.gamma,
                          window=job.window or 1, model=models[job])

    try:
        with _progress(config.warmup * len(jobs), progress and config.warmup > 0, "warm-up") as bar:
            for _ in range(config.warmup):
                for j in jobs:
                    run(j, *encoded[0], n=min(32, config.max_new_tokens))
                    bar.update()
        with _progress(len(encoded) * config.repeats * len(jobs), progress, "sweep") as bar:
            for i, (ids, mask) in enumerate(encoded):
                samples: dict[object, list[Sample]] = {j: [] for j in jobs}
                for r in range(config.repeats):
                    for j in _rotated(jobs, i * config.repeats + r):
                        bar.set_postfix_str(f"prompt {i + 1}/{len(encoded)} {j if j == 'hf' else j.label}")
                        samples[j].append(run(j, ids, mask))
                        bar.update()
                ref = samples["hf"][0].tokens
                for j in jobs:
                    times[j].append(_median([x.tokens_per_s for x in samples[j]]))
                    ident[j].append(all(x.tokens == ref for x in samples[j]))
                    if not ident[j][-1]:
                        other = next(x.tokens for x in samples[j] if x.tokens != ref)
                        diverged[j].append((i, ref, other))
                    c = samples[j][0].counters
                    passes[j].append((c.new_tokens, c.target_passes))
    finally:
        runner.close()
    tol = tie_tolerance(config, model.dtype)
    checker = TieChecker(model)
    ties = dict.fromkeys(jobs, 0)  # divergences at an fp32 near-tie, per job
    for j in jobs:
        for i, ref, other in diverged[j] if config.tie_check else []:
            margin = checker.margin(*encoded[i], ref, other)
            ties[j] += margin is not None and abs(margin) <= tol
    checker.close()
    results = []
    for s in settings:
        results.append(SettingResult(
            setting=s,
            tokens_per_s=_median(times[s]),
            speedup_vs_hf=_median([a / b for a, b in zip(times[s], times["hf"])]),
            tokens_per_target_pass=sum(n for n, _ in passes[s]) / max(sum(p for _, p in passes[s]), 1),
            identical=sum(ident[s]) / len(ident[s]),
            identical_up_to_ties=(sum(ident[s]) + ties[s]) / len(ident[s]),
        ))
    return SweepResult(results, _median(times["hf"]), model_info(model), hardware_info(), config, tol)


def format_sweep_table(sweep: SweepResult) -> str:
    lines = [f"hf: {sweep.hf_tokens_per_s:.1f} tok/s; {sweep.hardware['cpu']}, {sweep.hardware['threads']} threads",
             "", f"{'setting':<30}{'tok/s':>8}{'vs hf':>8}{'tok/pass':>9}{'identical':>10}{'~ties':>7}"]
    best = sweep.best
    for r in sorted(sweep.results, key=lambda r: -r.speedup_vs_hf):
        mark = "  <- best" if best is not None and r is best else ""
        lines.append(f"{r.setting.label:<30}{r.tokens_per_s:>8.1f}{r.speedup_vs_hf:>7.2f}x"
                     f"{r.tokens_per_target_pass:>9.2f}{r.identical:>10.2f}{r.identical_up_to_ties:>7.2f}{mark}")
    lines.append("")
    lines.append(f"fastest lossless setting (identical up to rounding ties, fp32 margin <= {sweep.tie_tolerance:g}): "
                 f"{best.setting.label}" if best else "no setting reproduced hf on every prompt")
    return "\n".join(lines)
