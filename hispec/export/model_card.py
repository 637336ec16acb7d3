"""The model card (README.md) of an exported hispec checkpoint, and the facts it states about the base model.

Contract:
- `render_model_card(run, model, name=, base_model=, license=, heads_only=, calibration=)` returns the README.md
  text: a YAML header (license, base_model, library_name, pipeline_tag, tags), then what the checkpoint is, how the
  heads were trained (the run's args, data and metrics as tables), speed and usage. Speed is stated only from a
  `hispec.latency.Calibration`, naming the machine it was measured on; without one the card says that speed was
  not measured and how to measure it. `write_model_card(folder, text)` writes it as `folder/README.md`.
- `base_license(source, revision)` is the base model's licence where it is written down (a local README's YAML
  header, a .gguf's `general.license`, a Hub repo's README); None when unknown, offline included.
- `resolve_base_model(run, model, override)` is the card's `base_model`: the override, else a recorded Hub id,
  else the Hub id a local base folder records as its origin (`origin_hub_id`: config.json's `_name_or_path`, or
  the `hub_id` in the marker `hispec.fetch` writes).
- `default_hierarchies(model)` names the checkpoint's own decoding defaults as hierarchies, for prediction tables.
Text and small file reads only; the Hub is contacted only by `base_license`, for a Hub id whose README is not
cached. `hispec.export.checkpoint` writes the card; `hispec.export` re-exports these names.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import yaml

from ..fetch.store import MARKER
from ..io import read_json
from ..latency import predictions
from ..model import METRICS_FILE, EarlyExitModel
from .run import TrainRun

CARD_FILE = "README.md"
CARD_TAGS = ("hispec", "early-exit", "speculative-decoding")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _front_matter(text: str) -> dict:
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    if end < 0:
        return {}
    try:
        meta = yaml.safe_load(text[3:end])
    except yaml.YAMLError:
        return {}
    return meta if isinstance(meta, dict) else {}


def base_license(source: str, revision: str | None = None) -> str | None:
    """The base model's licence where it is written down: a local README's YAML header, a .gguf's
    `general.license`, or a Hub repo's README. None when unknown (offline, no card, no field)."""
    path = Path(source)
    if path.is_dir():
        readme = path / CARD_FILE
        return _front_matter(readme.read_text(encoding="utf-8")).get("license") if readme.is_file() else None
    if source.endswith(".gguf"):
        try:
            from gguf import GGUFReader
        except ImportError:
            return None
        field_ = GGUFReader(source).fields.get("general.license")
        return bytes(field_.parts[field_.data[0]]).decode("utf-8") if field_ is not None else None
    if not _HUB_ID.match(source):
        return None
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import HTTPError

    cached = try_to_load_from_cache(source, CARD_FILE, revision=revision)
    if isinstance(cached, str):
        return _front_matter(Path(cached).read_text(encoding="utf-8")).get("license")
    try:  # one metadata request, no retries: offline this costs milliseconds
        card = HfApi().model_info(source, revision=revision).card_data
    except (OSError, HTTPError, ValueError):  # offline, gated, missing: the licence is simply unknown
        return None
    return getattr(card, "license", None) if card is not None else None


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            rows += _flatten(v, key + ".")
        else:
            rows.append((key, v))
    return rows


def _fmt(v) -> str:
    if isinstance(v, float):
        text = f"{v:.4g}" if math.isfinite(v) else str(v)
    elif isinstance(v, (list, tuple)):
        items = [_fmt(x) for x in v[:8]]
        text = "[" + ", ".join(items) + (", ..." if len(v) > 8 else "") + "]"
    else:
        text = str(v)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(d: dict, header: tuple[str, str]) -> str:
    rows = _flatten(d)
    if not rows:
        return "_(none recorded)_\n"
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"] + [f"| `{k}` | {_fmt(v)} |" for k, v in rows]
    return "\n".join(lines) + "\n"


def _speed_section(name: str, model: EarlyExitModel, calibration) -> str:
    """What the card may say about speed: the calibration's predictions on the machine that made it (named), or
    that speed was not measured and how to measure it. Never a claim without a measurement behind it."""
    if calibration is None:
        return f"""## Speed

Not measured for this checkpoint. Whether speculative decoding pays off depends on the machine, the dtype and how
often the exits agree with the model (the output is the same either way), so measure it where you deploy:

```bash
hispec-bench --model {name} --prompts question.jsonl --strategies ar,self-spec,hispec
```

or store a calibrated latency model in the checkpoint with `hispec-export ... --calibrate` (hispec then decodes
with the hierarchy it predicts to be quickest on that machine, or plainly when none is).
"""
    rows = predictions(calibration, fixed=default_hierarchies(model))
    best = rows[-1]
    lines = ["| hierarchy | levels | gammas | predicted ms / token | predicted tok/s | vs plain decoding |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | `{'>'.join(r['levels'])}` | {','.join(map(str, r['gammas'])) or '-'} | "
                     f"{r['seconds_per_token'] * 1e3:.2f} | {r['tokens_per_second']:.1f} | "
                     f"{r['speedup_vs_plain']:.2f}x |")
    measured = calibration.measured or {}
    measured_text = ("Measured there: " + ", ".join(f"`{k}` {v:.1f} tok/s" for k, v in measured.items())
                     + " (decode steps, prefill excluded).\n\n") if measured else ""
    if best["levels"] == ["full"]:
        verdict = ("On that machine no speculative hierarchy is predicted to beat plain decoding with these heads: "
                   "decode with `strategy=\"ar\"` there.")
    else:
        verdict = (f"Best predicted there: `{'>'.join(best['levels'])}` with gammas "
                   f"{','.join(map(str, best['gammas']))}, {best['speedup_vs_plain']:.2f}x plain decoding.")
    acc = ", ".join(f"{k} {v:.2f}" for k, v in calibration.acceptance.items())
    return f"""## Speed

Calibrated by `hispec-export --calibrate` on **{calibration.describe_machine()}**: unit costs (decoder layer, heads,
lm_head, the decoder's per-step overhead) timed there with {calibration.context} cached positions, and per-token
acceptance rates counted on {calibration.positions} positions of the model's own greedy answers ({acc}; n-gram
lookup matches {calibration.ngram_match:.2f}{_ngram_choice(calibration)}). The latency model (`hispec.latency`)
predicts, greedy:

{chr(10).join(lines)}

{measured_text}{verdict} These are predictions for that machine type and dtype only: on another machine
or dtype hispec does not use this calibration (decoding defaults to plain there). Check with
`hispec-bench --model {name} --prompts question.jsonl`.
"""


def _ngram_choice(calibration) -> str:
    """The model card's note on the n-gram config the calibration chose (`latency.calibrate`), if it chose one."""
    if not calibration.ngram_options:
        return ""
    c = calibration.ngram
    return (f" with suffixes of {c['min_ngram']}..{c['max_ngram']} tokens and up to {c['max_len']} tokens proposed, "
            f"the one of {len(calibration.ngram_options)} configs measured that `auto` is predicted fastest with")


def default_hierarchies(model: EarlyExitModel) -> dict:
    """The checkpoint's own decoding defaults as hierarchies, for the prediction table."""
    cfg = model.hispec_config
    d, v = f"L{cfg.draft_layer}", f"L{cfg.verify_layer}"
    return {f"self-spec (gamma {cfg.gamma})": ([d, "full"], [cfg.gamma]),
            f"hispec (gamma {cfg.gamma}, window {cfg.window})": ([d, v, "full"], [cfg.gamma, cfg.window])}


def render_model_card(run: TrainRun, model: EarlyExitModel, *, name: str, base_model: str | None,
                      license: str | None, heads_only: bool = False, calibration=None) -> str:
    """README.md: YAML header (base_model, library_name, tags, pipeline_tag, license) + what/how/figures/usage.

    Speed is stated only from a `hispec.latency.Calibration` (`calibration`), naming the machine it was measured
    on; without one the card says that speed was not measured and how to measure it."""

    cfg = model.hispec_config
    base = cfg.base
    header = {}
    if license:
        header["license"] = license
    if base_model:
        header["base_model"] = base_model
    header["library_name"] = "hispec"
    header["pipeline_tag"] = "text-generation"
    header["tags"] = list(CARD_TAGS) + [t for t in (base.get("model_type"),) if t]
    base_name = base_model or base.get("name_or_path") or "the base model"
    rev = f" (revision `{base['revision']}`)" if base.get("revision") else ""
    head_desc = cfg.head_type + (f" (rank {cfg.head_rank})" if cfg.head_rank else "")
    verification_note = ("; sampling verifies sequence-level (HSD, `verification=\"hsd\"`)"
                         if cfg.verification == "hsd" else "")
    contents = (
        f"this folder holds only the exit heads and a config that references `{base_name}`{rev}; "
        "`hispec.load` fetches the base itself."
        if heads_only else
        f"the base weights are unchanged, so stock `AutoModelForCausalLM.from_pretrained(\"{name}\")` loads it "
        f"as the plain `{base_name}`; `hispec.load` adds the exit heads."
    )
    body = f"""
# {name}

An early-exit checkpoint of [`{base_name}`]{f'(https://huggingface.co/{base_model})' if base_model else ''}{rev} for
lossless **hierarchical speculative decoding** with `hispec`: a draft head after layer {cfg.draft_layer} and an
intermediate-verifier head after layer {cfg.verify_layer} of the frozen {base.get('num_hidden_layers', '?')}-layer model.
The intermediate exit checks the drafts before the full model verifies them, so the output is exactly the base
model's (greedy: token for token; sampling: the same distribution). Whether it also saves time depends on the
machine and on how often the exits agree with the model: see [Speed](#speed).

In this checkpoint {contents}

| exit | after layer | head | output vocabulary |
|---|---|---|---|
| draft | {cfg.draft_layer} | {head_desc} | {cfg.draft_vocab_size or 'full'} |
| verify | {cfg.verify_layer} | {head_desc} | {cfg.verify_vocab_size or 'full'} |
| target | {base.get('num_hidden_layers', '?')} (all) | the model's own final norm + lm_head | full |

Decoding defaults: gamma = {cfg.gamma} drafts per intermediate round, window = {cfg.window} tokens per full
verification{verification_note}.

## How the heads were trained

The base model stayed frozen; the heads were distilled from the model's own final layer with `train/heads.py`.

{_table(run.args, ('argument', 'value'))}
Data:

{_table(run.data, ('field', 'value'))}
## Results

Figures recorded by the training run (`{METRICS_FILE}`):

{_table(run.metrics, ('metric', 'value'))}
{_speed_section(name, model, calibration)}
## How to use

```python
import hispec

model = hispec.load("{name}")          # base + exit heads, checked against each other
tok = model.tokenizer
enc = tok("The capital of France is", return_tensors="pt")
out = model.generate(enc.input_ids, attention_mask=enc.attention_mask,
                     max_new_tokens=64)   # "auto" (calibrated) or "ar"; "hispec", "ngram", ...: same tokens
print(tok.decode(out.sequences[0], skip_special_tokens=True))
print(out.stats)                        # acceptance counts and timings
```

From the command line:

```bash
hispec-generate --model {name} --prompt "The capital of France is"   # --strategy hispec / ngram / auto ...
```

## Files

- `config.json`: the base config plus the `hispec` entry (exit layers, head type, decoding defaults, base
  identity""" + (", latency calibration" if calibration is not None else "") + """)
- `hispec_heads.safetensors`: the exit-head weights
""" + ("" if heads_only else "- `model*.safetensors`: the unchanged base weights\n")
    return "---\n" + yaml.safe_dump(header, sort_keys=False) + "---\n" + body


def write_model_card(folder: Path, text: str) -> None:
    (folder / CARD_FILE).write_text(text, encoding="utf-8")


# Files in a local base folder that record the Hub repo it was converted from, as {"hub_id": "org/name"}:
# hispec.fetch (tools/get_demo_model.py) writes this marker when it converts a GGUF from PyPI.
ORIGIN_FILES = (MARKER,)


def origin_hub_id(folder: str | os.PathLike) -> str | None:
    """The Hub id a local model folder is a copy or conversion of, where the folder records it: config.json's
    `_name_or_path`, or `hub_id` in one of `ORIGIN_FILES`. None otherwise."""
    folder = Path(os.path.expanduser(os.path.expandvars(str(folder))))
    if not folder.is_dir():
        return None
    for name, key in [("config.json", "_name_or_path")] + [(f, "hub_id") for f in ORIGIN_FILES]:
        try:
            value = read_json(folder / name).get(key) if (folder / name).is_file() else None
        except (ValueError, OSError, AttributeError):
            continue
        if isinstance(value, str) and _HUB_ID.match(value):
            return value
    return None


def resolve_base_model(run: TrainRun, model: EarlyExitModel, override: str | None) -> str | None:
    """The card's `base_model`: `override`, else the recorded base when it is a Hub id, else the Hub id a local
    base folder records as its origin (e.g. the demo model converted from GGUF)."""
    if override:
        return override
    candidates = [c for c in (run.recorded_base.get("name_or_path"), model.hispec_config.base.get("name_or_path"))
                  if c]
    for candidate in candidates:
        if _HUB_ID.match(candidate) and not Path(candidate).exists():
            return candidate
    for candidate in candidates:
        hub_id = origin_hub_id(candidate)
        if hub_id:
            return hub_id
    return None
