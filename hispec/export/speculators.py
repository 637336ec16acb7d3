"""A trained EAGLE-3 drafter -> a `speculators`-format folder that vLLM and SGLang load as it is.

    hispec-export runs/smollm2-eagle3 --format speculators --output-dir exports/smollm2-eagle3

Contract: the folder is a plain Hugging Face folder, written atomically (temporary sibling, one rename):
- `config.json`: built and validated through `speculators`' own classes (`Eagle3SpeculatorConfig`,
  `SpeculatorsConfig`, `VerifierConfig`, `GreedyTokenProposalConfig`): `speculators_model_type: "eagle3"`, the
  one-layer Llama `transformer_layer_config`, `draft_vocab_size`, `target_hidden_size`, `norm_before_residual`,
  `eagle_aux_hidden_state_layer_ids` and the verifier (the target's name or path and architectures), written by
  `speculators`' own `save_pretrained` (which adds `config.py`, the config class its `auto_map` names);
- `model.safetensors`: the drafter's weights under the names `speculators`' `Eagle3DraftModel` expects (`fc`,
  `layers.0.*`, `norm`, `lm_head`, and the vocabulary mapping `d2t` (offsets: target id = draft id + d2t) and
  `t2d` (a mask over the target vocabulary) when the draft vocabulary is reduced). The token embedding is left out,
  as in the drafters `speculators` publishes: engines and `speculators` take it from the verifier;
- `README.md`: a model card naming the target model and revision it drafts for, and how to serve it.

`speculators` is an optional dependency (`pip install hispec[speculators]`); exporting without it is refused with that
instruction, since its classes are the validation. Only `eagle3` drafters export: a run of exit heads (linear, layer,
context, ...) has no `speculators` equivalent and is refused with a message that says so.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..drafters.eagle3 import Eagle3Drafter, is_drafter_run, load_drafter
from ..io import atomic_dir, atomic_write, write_text


class SpeculatorsExportError(ValueError):
    """The run cannot be written in the `speculators` format; the message says why and what to do."""


def _speculators():
    try:
        import speculators  # noqa: F401
        from speculators.config import SpeculatorsConfig, VerifierConfig
        from speculators.models.eagle3 import Eagle3SpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig
    except ImportError as e:
        raise SpeculatorsExportError(
            f"--format speculators needs the `speculators` package ({e}); install it with "
            "`pip install 'hispec[speculators]'`") from e
    return Eagle3SpeculatorConfig, SpeculatorsConfig, VerifierConfig, GreedyTokenProposalConfig


def speculators_config(drafter: Eagle3Drafter, *, verifier: str, architectures: list[str],
                       speculative_tokens: int = 3):
    """The drafter's `Eagle3SpeculatorConfig` (validated by pydantic on construction)."""
    Eagle3SpeculatorConfig, SpeculatorsConfig, VerifierConfig, GreedyTokenProposalConfig = _speculators()
    c = drafter.config
    layer = c.llama_config()
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=c.draft_vocab_size,
        norm_before_residual=c.norm_before_residual, target_hidden_size=c.hidden_size,
        eagle_aux_hidden_state_layer_ids=list(c.aux_layers),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=list(architectures))))


def speculators_state_dict(drafter: Eagle3Drafter, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The drafter's tensors under `speculators`' names (floating ones cast to `dtype` if given)."""
    out = {}
    for k, v in drafter.state_dict().items():
        if k.startswith("rotary_emb."):
            continue
        v = v.detach().cpu()
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.contiguous()
    return out


def _card(meta: dict, cfg, verifier: str, revision: str | None, out_name: str) -> str:
    c = meta["config"]
    rev = f" (revision `{revision}`)" if revision else ""
    metrics = meta.get("metrics") or {}
    lines = [
        "---", "library_name: speculators", "tags: [speculative-decoding, eagle3, hispec]", "---", "",
        f"# EAGLE-3 drafter for `{verifier}`", "",
        f"Drafts for **`{verifier}`**{rev}, trained by hispec (distillation from the model's own outputs, "
        f"training-time test over {meta.get('ttt_steps', '?')} steps) and written in the `speculators` format "
        "(`speculators_model_type: eagle3`).", "",
        "| setting | value |", "|---|---|",
        f"| target layers read (`eagle_aux_hidden_state_layer_ids`) | {c['aux_layers']} |",
        f"| draft vocabulary | {c['draft_vocab_size']} of {c['vocab_size']} tokens |",
        f"| decoder layers | 1 (hidden {c['hidden_size']}, {c['num_attention_heads']} heads, "
        f"{c['num_key_value_heads']} KV heads) |",
    ]
    if metrics:
        lines += [f"| {k} | {v} |" for k, v in metrics.items()]
    lines += ["", "## Serve", "", "vLLM:", "", "```bash",
              f"vllm serve {verifier} --speculative-config "
              f"'{{\"model\": \"{out_name}\", \"num_speculative_tokens\": 3, \"method\": \"eagle3\"}}'",
              "```", "", "SGLang:", "", "```bash",
              f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
              f"--speculative-draft-model-path {out_name} --speculative-num-steps 3 "
              "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4", "```", "",
              "The token embedding is not in this folder: the engine shares the verifier's.", ""]
    return "\n".join(lines)


def export_speculators(run_dir, output_dir, *, verifier: str | None = None, revision: str | None = None,
                       dtype: torch.dtype | None = None, speculative_tokens: int = 3,
                       overwrite: bool = False) -> Path:
    """Write `run_dir`'s drafter as a `speculators` folder at `output_dir`; returns its path.

    `verifier`: the target's Hub id or path written into the config (default: the one the run recorded)."""
    run_dir = Path(run_dir)
    if not is_drafter_run(run_dir):
        head = _head_type_of(run_dir)
        raise SpeculatorsExportError(
            f"{run_dir} holds no EAGLE-3 drafter" + (f" (its heads are {head!r})" if head else "")
            + ": only `eagle3` drafters (train/heads.py --head_type eagle3) export to the speculators format; "
            "exit heads (shared, norm, linear, lowrank, layer, context) have no speculators equivalent -- export "
            "them as a hispec checkpoint (without --format)")
    if speculative_tokens < 1:
        raise SpeculatorsExportError("speculative_tokens must be >= 1")
    drafter, meta = load_drafter(run_dir)
    base = meta.get("base") or {}
    verifier = verifier or base.get("name_or_path")
    if not verifier:
        raise SpeculatorsExportError(f"{run_dir} records no target model; pass the verifier's Hub id or path")
    revision = revision if revision is not None else base.get("revision")
    cfg = speculators_config(drafter, verifier=os.path.expanduser(verifier),
                             architectures=base.get("architectures") or [], speculative_tokens=speculative_tokens)
    state = speculators_state_dict(drafter, dtype)
    from safetensors.torch import save_file

    output_dir = Path(output_dir)
    with atomic_dir(output_dir, overwrite=overwrite) as tmp:
        cfg.save_pretrained(str(tmp))  # speculators' own writer (config.json)
        atomic_write(tmp / "model.safetensors", lambda f: save_file(state, str(f), metadata={"format": "pt"}))
        write_text(tmp / "README.md", _card(meta, cfg, verifier, revision, output_dir.name))
    return output_dir


def _head_type_of(run_dir: Path) -> str | None:
    from ..io import read_json

    for name in ("hispec_train.json", "config.json"):
        p = run_dir / name
        if p.is_file():
            try:
                d = read_json(p)
            except ValueError:
                return None
            head = (d.get("hispec") or {}).get("head") or {}
            return head.get("type")
    return None
