"""Samples -> figures: `summarize(result)` gives a `Summary` of per-strategy `StrategySummary`s (tokens/s, speedups
measured side by side, tokens per full pass, acceptance per stage, time shares, identical outputs up to ties).

Rows of other engines (hispec.bench.peers) carry what ran in `engine`; a figure an engine does not report (e.g. the
passes of a speculative batch row) is None. A lossy row (a quantised model) has no identity figures and does not
count for `lossless`: its outputs are not expected to equal the reference's."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from .env import model_info
from .runner import (REFERENCE, STAGES, BenchConfig, BenchResult, PromptRecord, _first_mismatch, split_verification,
                     tie_tolerance)


# ---------------------------------------------------------------------------------------------------- summary
def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _ratio(num, den):
    return None if num is None or not den else num / den


@dataclass
class StrategySummary:
    strategy: str
    prompts: int
    tokens_per_s: float
    speedup_vs_hf: float | None
    speedup_vs_self_spec: float | None
    tokens_per_target_pass: float | None
    verify_acceptance: float | None
    target_acceptance: float | None
    layer_evals_per_token: float | None
    time_share: dict
    identical: float | None  # share of prompts whose new tokens equal the reference's (greedy only)
    identical_up_to_ties: float | None  # the same, counting a divergence at an fp32 near-tie as identical
    new_tokens: int
    speedup_vs_ar: float | None = None  # vs hispec's own plain decoding (what the latency model predicts against)
    predicted_speedup_vs_ar: float | None = None  # the latency model's prediction from the checkpoint's calibration
    prediction_error: float | None = None  # predicted / measured - 1
    # the same model fed this run's own observed acceptance (and n-gram match) rates: the cost model's error alone
    predicted_speedup_observed: float | None = None
    prediction_error_observed: float | None = None
    observed_acceptance: dict | None = None
    plain_share: float | None = None  # auto: share of row rounds decoded plainly
    hierarchy: str | None = None
    verification: str | None = None  # hispec: the sampling acceptance rule it ran with
    # `s:hsd` next to `s`: median per-prompt tokens/s ratio and tokens-per-full-pass ratio, HSD over token-wise
    speedup_vs_token: float | None = None
    tokens_per_target_pass_vs_token: float | None = None
    engine: dict | None = None  # another engine's row (hispec.bench.peers): version, CPU features, files, acceptance
    lossy: bool = False  # a quantised peer: identity is not claimed and it does not count for `lossless`


@dataclass
class Summary:
    config: BenchConfig
    reference: str | None
    strategies: dict[str, StrategySummary]
    categories: dict[str, dict]  # category -> {"prompts": n, "strategies": {s: {tokens_per_s, speedup_vs_hf, ..}}}
    per_prompt: list[dict]
    model_info: dict
    hardware: dict
    tie_tolerance: float = 0.0
    failed: dict = field(default_factory=dict)  # peer strategy -> "ExceptionType: message" (it raised; not timed)
    skipped: dict = field(default_factory=dict)  # other engine -> why it did not run (not installed)

    def _all(self, attr: str) -> bool | None:
        if not self.config.greedy or self.reference is None:
            return None
        return all(getattr(s, attr) == 1.0 for name, s in self.strategies.items()
                   if name != self.reference and not s.lossy)

    @property
    def lossless(self) -> bool | None:
        """All strategies reproduced the reference on every prompt (None: sampling, or no reference)."""
        return self._all("identical")

    @property
    def lossless_up_to_ties(self) -> bool | None:
        """As `lossless`, but a run that first left the reference at an fp32 near-tie counts as identical."""
        return self._all("identical_up_to_ties")

    @property
    def headline_strategy(self) -> str | None:
        """What the headline figures describe: `auto` (the default decoding) when it ran, else `hispec`."""
        return next((s for s in ("auto", "hispec") if s in self.strategies), None)

    def headline(self, name: str) -> float | None:
        s = self.strategies.get(self.headline_strategy)
        return None if s is None else getattr(s, name)

    def as_dict(self, per_prompt: bool = False) -> dict:
        d = {
            "lossless": self.lossless,
            "lossless_up_to_ties": self.lossless_up_to_ties,
            "tie_tolerance": self.tie_tolerance,
            "headline": self.headline_strategy,
            "speedup_vs_hf": self.headline("speedup_vs_hf"),
            "speedup_vs_self_spec": self.headline("speedup_vs_self_spec"),
            "reference": self.reference,
            "strategies": {k: asdict(v) for k, v in self.strategies.items()},
            "categories": self.categories,
            "config": {**asdict(self.config), "strategies": list(self.config.strategies),
                       "prompts": len(self.per_prompt)},
            "model": self.model_info,
            "hardware": self.hardware,
            "failed": dict(self.failed),
            "skipped": dict(self.skipped),
        }
        if per_prompt:
            d["per_prompt"] = self.per_prompt
        return d


def _prompt_figures(rec: PromptRecord, ref: str | None, tol: float) -> dict[str, dict]:
    """Per strategy on one prompt: tokens/s (median over repeats), tokens, identity to the reference."""
    out = {}
    ref_tokens = rec.samples[ref][0].tokens if ref in rec.samples else None
    for s, samples in rec.samples.items():
        fig = {"tokens_per_s": _median([x.tokens_per_s for x in samples]),
               "seconds": _median([x.seconds for x in samples]), "new_tokens": len(samples[0].tokens)}
        if ref_tokens is not None:
            mism = [_first_mismatch(x.tokens, ref_tokens) for x in samples]
            fig["identical"] = all(m is None for m in mism)
            fig["first_mismatch"] = next((m for m in mism if m is not None), None)
            margin, own = rec.margins.get(s), rec.own_margins.get(s)
            fig["mismatch_margin"] = margin
            fig["mismatch_own_margin"] = None if own is None else own[0]
            fig["identical_up_to_ties"] = (fig["identical"] or (margin is not None and abs(margin) <= tol)
                                           or (own is not None and abs(own[0]) <= own[1]))
        out[s] = fig
    return out


def _mean_opt(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _observed_rates(cs) -> dict | None:
    """Per adjacent pair of levels the i.i.d. acceptance a run observed ("L4>full": acc / (acc + rejections)), and
    "ngram_match" (share of n-gram lookups that proposed anything); None for runs without per-level counters."""
    runs = [c.levels for c in cs if c.levels]
    if not runs or len(runs[0]) < 2:
        return None
    out = {}
    for k in range(1, len(runs[0])):
        acc = sum(r[k]["accepted"] for r in runs)
        n = acc + sum(r[k]["rejections"] for r in runs)
        out[f"{runs[0][k - 1]['name']}>{runs[0][k]['name']}"] = acc / n if n else None
    if runs[0][0]["name"] == "ngram":
        looks = sum(r[0]["row_passes"] for r in runs)
        out["ngram_match"] = sum(r[0]["proposals"] for r in runs) / looks if looks else None
    return out


def _pass_ratio(records, s, idx) -> float | None:
    cs = [x.counters for i in idx for x in records[i].samples[s]]
    if any(c.target_passes is None for c in cs):
        return None
    return sum(c.new_tokens for c in cs) / max(sum(c.target_passes for c in cs), 1)


def summarize(result: BenchResult) -> Summary:
    cfg = result.config
    strategies = result.strategies  # (peers that failed have no samples: `result.failed`)
    ref = next((r for r in (REFERENCE, "ar") if r in strategies), None) if cfg.greedy else None
    figs = [_prompt_figures(rec, ref, result.tie_tolerance) for rec in result.records]

    def ratios(s, base, idx):
        if base not in strategies:
            return None
        return _median([_ratio(figs[i][s]["tokens_per_s"], figs[i][base]["tokens_per_s"]) for i in idx])

    def identity(s, idx, key="identical"):
        if ref is None or s in result.lossy:
            return None
        return sum(figs[i][s][key] for i in idx) / max(len(idx), 1)

    every = list(range(len(result.records)))
    summaries = {}
    for s in strategies:
        cs = [x.counters for rec in result.records for x in rec.samples[s]]
        total = lambda k: sum(getattr(c, k) for c in cs)  # noqa: E731
        opt = lambda k: None if any(getattr(c, k) is None for c in cs) else total(k)  # noqa: E731
        secs = {k: sum(c.seconds.get(k, 0.0) for c in cs) for k in STAGES}
        all_secs = sum(secs.values())
        summaries[s] = StrategySummary(
            strategy=s,
            prompts=len(every),
            tokens_per_s=_median([figs[i][s]["tokens_per_s"] for i in every]),
            speedup_vs_hf=ratios(s, "hf", every),
            speedup_vs_self_spec=ratios(s, "self-spec", every),
            tokens_per_target_pass=_pass_ratio(result.records, s, every),
            verify_acceptance=_ratio(opt("accepted_at_verify"), opt("proposed_to_verify")),
            target_acceptance=_ratio(opt("accepted_at_target"), opt("proposed_to_target")),
            layer_evals_per_token=_ratio(opt("layer_evals"), max(total("new_tokens"), 1)),
            time_share={k: v / all_secs if all_secs else 0.0 for k, v in secs.items()},
            identical=identity(s, every),
            identical_up_to_ties=identity(s, every, "identical_up_to_ties"),
            new_tokens=total("new_tokens") // max(cfg.repeats, 1),
            speedup_vs_ar=ratios(s, "ar", every),
            plain_share=_mean_opt([c.plain_share for c in cs]),
            hierarchy=next((c.hierarchy for c in cs if c.hierarchy), None),
            verification=next((c.verification for c in cs if c.verification), None),
            engine=result.engines.get(s),
            lossy=s in result.lossy,
        )
        pred = result.predictions.get(s)
        measured = summaries[s].speedup_vs_ar
        if pred is not None:
            summaries[s].predicted_speedup_vs_ar = pred
            summaries[s].prediction_error = None if not measured else pred / measured - 1
        observed = _observed_rates(cs)
        summaries[s].observed_acceptance = observed
        fn = result.predictors.get(s)
        if fn is not None and observed is not None:
            pred = fn(observed)
            summaries[s].predicted_speedup_observed = pred
            summaries[s].prediction_error_observed = None if not measured else pred / measured - 1
    for s in strategies:  # HSD next to the same strategy token-wise
        name, _ = split_verification(s)
        if summaries[s].verification != "hsd":
            continue
        twin = next((t for t in (f"{name}:token", name) if t in summaries and summaries[t].verification == "token"),
                    None)
        if twin is not None:
            summaries[s].speedup_vs_token = ratios(s, twin, every)
            summaries[s].tokens_per_target_pass_vs_token = _ratio(summaries[s].tokens_per_target_pass,
                                                                  summaries[twin].tokens_per_target_pass)
    cats: dict[str, list[int]] = {}
    for i, rec in enumerate(result.records):
        cats.setdefault(rec.category, []).append(i)
    categories = {
        c: {"prompts": len(idx),
            "strategies": {s: {"tokens_per_s": _median([figs[i][s]["tokens_per_s"] for i in idx]),
                               "speedup_vs_hf": ratios(s, "hf", idx),
                               "tokens_per_target_pass": _pass_ratio(result.records, s, idx),
                               "identical": identity(s, idx),
                               "identical_up_to_ties": identity(s, idx, "identical_up_to_ties")}
                           for s in strategies}}
        for c, idx in cats.items()
    }
    per_prompt = [{"index": rec.index, "category": rec.category, "prompt_tokens": rec.prompt_tokens,
                   "text": rec.text[:200], "strategies": figs[i]} for i, rec in enumerate(result.records)]
    return Summary(cfg, ref, summaries, categories, per_prompt, result.model_info, result.hardware,
                   result.tie_tolerance, dict(result.failed), dict(result.skipped))
