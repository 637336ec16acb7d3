"""Hierarchies: which levels a strategy runs, parsed from its name or spec and built into `Level` objects.

A level is one of
- `ngram`: prompt lookup over the row's own prompt and output (`hispec.drafters.ngram`); no model cost; only at level 0;
- an exit: the decoder layers up to the exit's layer plus its trained head (`draft` at L_d, `verify` at L_i);
- `full`: the whole model, always the top;
- `eagle3` (level 0 only, directly under `full`): the checkpoint's EAGLE-3 drafter (`hispec.drafters.eagle3`), one decoder
  layer of its own over the full model's states at a few layers (`hispec.decoding.eagle`);
- `ngram|EXIT` (level 0 only): both drafters in one level, the n-gram lookup first and the exit wherever the lookup
  finds nothing. They are strong in different places (the lookup where answers copy from the context: code edits,
  RAG, summaries; the head elsewhere), and a row pays the exit only when the lookup missed.
Level 0 drafts; each level k >= 1 verifies, in one pass, what level k-1 gathered, and the top level is the full
model. Named strategies are hierarchies (`NAMED`): `ar` = full, `self-spec` = draft>full, `hispec` =
draft>verify>full, `ngram` = ngram>full, `ngram-self-spec` = ngram>draft>full, `ngram-hispec` =
ngram>draft>verify>full, `self-spec-lookup` = ngram|draft>full, `hispec-lookup` = ngram|draft>verify>full; any
other spec string (e.g. `"ngram>L8>full"`, exits named or given by layer) works too, and `auto` picks one from the
checkpoint's calibration (`hispec.decoding.plan`) and adapts it per row while decoding (`hispec.decoding.auto`).

Contract: `parse_hierarchy(spec, model)` -> level names bottom-up, or ValueError on anything malformed;
`build_levels(model, names, gammas, ...)` -> `Level`s with their default (or given) gammas; `_plan_levels` does the
same for a plan in the calibration's level names ("L4", "ngram|L4"). Pure functions of the model's config.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..latency import LOOKUP
from ..drafters.ngram import NgramConfig

NAMED = {
    "ar": ("full",),
    "self-spec": ("draft", "full"),
    "hispec": ("draft", "verify", "full"),
    "ngram": ("ngram", "full"),
    "ngram-self-spec": ("ngram", "draft", "full"),
    "ngram-hispec": ("ngram", "draft", "verify", "full"),
    "self-spec-lookup": ("ngram|draft", "full"),
    "hispec-lookup": ("ngram|draft", "verify", "full"),
    "eagle": ("eagle3", "full"),
    "eagle-lookup": ("ngram|eagle3", "full"),
}
STRATEGIES = ("auto",) + tuple(NAMED)



@dataclass(frozen=True)
class Level:
    kind: str  # 'ngram' | 'exit' | 'eagle3' | 'full'
    exit_layer: int  # decoder layers run to reach this level (0 for ngram, num_layers for full)
    head: str | None = None  # the exit head's name ('draft' / 'verify') for kind 'exit'
    threshold: int = 1  # default gamma: tokens gathered before the next level verifies them (ngram: longest proposal)
    lookup: bool = False  # an exit at level 0 that tries the n-gram lookup first (`ngram|EXIT`)

    @property
    def name(self) -> str:
        name = {"ngram": "ngram", "full": "full", "eagle3": "eagle3"}.get(self.kind, f"L{self.exit_layer}")
        return LOOKUP + name if self.lookup else name


def parse_hierarchy(spec, model) -> list[str]:
    """A strategy name or spec (`"ngram>L4>full"`, `"draft>verify>full"`, a list of such names) -> level names
    bottom-up (`ngram`, exit head names, `full`); raises ValueError on anything malformed."""
    if isinstance(spec, str):
        if spec in NAMED:
            return list(NAMED[spec])
        parts = [p.strip() for p in spec.split(">")]
    else:
        parts = [str(p).strip() for p in spec]
    by_layer = {f"L{model.hispec_config.layer_of(n)}": n for n in model.exit_names}
    by_layer["eagle3"] = "eagle3"
    names = []
    for p in parts:
        lookup = p.startswith(LOOKUP)
        if lookup:
            p = p[len(LOOKUP):].strip()
            if p in ("ngram", "full") or (p not in model.exit_names and p not in by_layer):
                raise ValueError(f"level {LOOKUP + p!r} in {spec!r}: '{LOOKUP}' pairs the lookup with an exit of "
                                 f"this checkpoint ({', '.join(model.exit_names)}), e.g. 'ngram|draft>full'")
            names.append(LOOKUP + by_layer.get(p, p))
            if len(names) > 1:
                raise ValueError(f"hierarchy {spec!r}: '{LOOKUP}EXIT' can only be the lowest level (it drafts)")
            continue
        if p in ("ngram", "full", "eagle3") or p in model.exit_names:
            names.append(p)
        elif p in by_layer:
            names.append(by_layer[p])
        else:
            known = ", ".join(list(NAMED) + ["auto"])
            exits = ", ".join(f"{n} (L{model.hispec_config.layer_of(n)})" for n in model.exit_names)
            raise ValueError(f"unknown strategy or level {p!r} in {spec!r}: strategies are {known}; a hierarchy is "
                             f"levels joined by '>' from ngram, this checkpoint's exits {exits}, and full")
    if not names or names[-1] != "full":
        raise ValueError(f"hierarchy {spec!r} must end with the full model ('full')")
    if "ngram" in names[1:]:
        raise ValueError(f"hierarchy {spec!r}: 'ngram' can only be the lowest level (it drafts, it cannot verify)")
    if any(n.removeprefix(LOOKUP) == "eagle3" for n in names):
        if names[0].removeprefix(LOOKUP) != "eagle3" or len(names) != 2:
            raise ValueError(f"hierarchy {spec!r}: the eagle3 drafter drafts directly for the full model "
                             "(eagle3>full or ngram|eagle3>full)")
        if getattr(model, "drafter", None) is None:
            raise ValueError(f"hierarchy {spec!r} needs an EAGLE-3 drafter and this model has none: load it with "
                             "hispec.load(path, drafter=RUN) or export one into the checkpoint (hispec-export RUN "
                             "--drafter DRAFTER_RUN)")
        return names
    depth = [0 if n == "ngram" else model.num_layers if n == "full"
             else model.hispec_config.layer_of(n.removeprefix(LOOKUP)) for n in names]
    if any(b <= a for a, b in zip(depth, depth[1:])):
        raise ValueError(f"hierarchy {spec!r}: each level must be strictly deeper than the one below it "
                         f"(layers {depth})")
    return names


def build_levels(model, names: list[str], gammas=None, *, gamma: int, window: int, ngram: NgramConfig,
                 eagle_gamma: int | None = None) -> list[Level]:
    """Level objects for level names; default thresholds: ngram -> its max_len, the lowest exit -> gamma, higher
    exits -> window, an eagle3 drafter -> `eagle_gamma` (else gamma); `gammas` (one per non-top level) overrides
    them."""
    levels = []
    first_exit = next((n for n in names if n not in ("ngram", "full")), None)
    for n in names:
        if n == "ngram":
            levels.append(Level("ngram", 0, None, ngram.max_len))
        elif n.removeprefix(LOOKUP) == "eagle3":
            levels.append(Level("eagle3", 0, None, eagle_gamma or gamma, lookup=n.startswith(LOOKUP)))
        elif n == "full":
            levels.append(Level("full", model.num_layers, None, 1))
        elif n.startswith(LOOKUP):
            exit_name = n[len(LOOKUP):]
            levels.append(Level("exit", model.hispec_config.layer_of(exit_name), exit_name, gamma, lookup=True))
        else:
            levels.append(Level("exit", model.hispec_config.layer_of(n), n, gamma if n == first_exit else window))
    if gammas is not None:
        gammas = list(gammas)
        if len(gammas) != len(levels) - 1:
            raise ValueError(f"gammas has {len(gammas)} values; the hierarchy {'>'.join(names)} needs one per level "
                             f"below the full model ({len(levels) - 1})")
        for g in gammas:
            if not isinstance(g, int) or g < 1:
                raise ValueError(f"gammas must be integers >= 1, got {gammas}")
        levels = [Level(lv.kind, lv.exit_layer, lv.head, g, lv.lookup) for lv, g in zip(levels, gammas)] + [levels[-1]]
    return levels


def _plan_levels(model, names, gammas, *, gamma, window, ngram) -> list[Level]:
    """Level objects for a plan in calibration level names ("L4", "ngram|L4", ...)."""
    by_name = {f"L{model.hispec_config.layer_of(n)}": n for n in model.exit_names}
    by_name.update({LOOKUP + k: LOOKUP + v for k, v in by_name.items()})
    return build_levels(model, [by_name.get(n, n) for n in names], list(gammas) or None, gamma=gamma, window=window,
                        ngram=ngram)

