"""Train hispec exit heads by distillation from the frozen model's own final layer (design.md §4).

Launch:

    accelerate launch --config_file recipes/accelerate/cpu.yaml train/heads.py --config recipes/smollm2-135m.yaml

Any recipe field can be overridden on the command line (`--max_steps 20`); the YAML gives defaults, the command
line wins. `python train/heads.py --help` lists every field. The same entry point runs on one CPU, several CPU
processes (gloo), DDP and DeepSpeed ZeRO-2/3: choose an `accelerate` config from recipes/accelerate/.

What it does: loads the base model (Hub id, folder or .gguf; a LoRA adapter is merged first), freezes it and adds
two heads (`draft_layer`, `verify_layer`). Data, all optional and mixed (hispec/distill/data.py):
- prompts from files / a Hub dataset (`train_file`, `dataset_name`), plus `self_prompts: N` instructions the
  model writes itself (hispec/distill/self_prompts.py, resumable); with `self_distill` the model answers all of them
  (hispec/distill/answers.py, resumable, `gen_dtype: bf16` to generate in bf16) and the heads train on its answers;
  `document_prompt_fraction: f` makes a share f of those answers the passage of a further instruction (summarise,
  extract, answer from, rewrite, translate it) that the model answers too (hispec/distill/document_prompts.py);
- `plain_text_file`: text distilled teacher-forced, nothing generated (whole chats, question + reference answer,
  .txt / .jsonl text); `plain_text_loss_on: assistant` limits the loss to assistant replies.
Without a feature cache each step runs the backbone once without grad, giving the hidden states at both exits and
the final features; both heads learn forward KL(p_final || p_exit) in one pass (hispec/distill/losses.py, chunked over
tokens). With `feature_cache: DIR` the backbone runs ONCE over the tokenized training and held-out sequences and
writes their exit hidden states and the final layer's top-k next-token distribution to DIR/train and DIR/eval
(hispec/distill/features.py: resumable, reused when it matches the run, refused when it does not; a new cache over
grown data copies what `feature_cache_reuse: [OLD_DIR]` already holds); the steps then read
those instead of running the backbone and learn the "top-k + bucket" KL (`topk_distill_loss`, temperature 1),
so heads train many epochs cheaply (a `layer` head gets its exit's whole sequences, rebuilt from the cache's
offsets, since it attends over earlier positions; `feature_cache_backbone_dtype` / `loss_dtype: bf16` make the
cache and the steps ~2x cheaper on CPUs with native bf16, and far slower on those without: a warning says so).
`context` heads (hispec/drafters/heads.py) also read, for a window of earlier positions, the deepest state decoding holds:
the final layer's raw residual for positions the full model verified, else (with `context_mid`) the verifier
exit's, else their own exit's. They get whole sequences of every layer they read (on the fly, or rebuilt from the
cache, which then stores `hidden.<num_layers>` too: `feature_cache_final_states` builds such a cache for linear runs
as well, and a cache holding more layers than a run reads serves it) and, per position and step, a fresh distance
to the verified frontier drawn uniformly from the range decoding produces (`context_ranges`; seeded by step, so
resume stays exact); the loss is the same KL on the same loss positions. A context run pointed at a cache without
the final layer's states stops before any work with what is missing and how to rebuild. Their evaluation adds
top-1 / top-5 agreement at fixed distances d = 1..4 (`by_distance`; `by_distance_mid1` for a draft head that reads
the verifier exit, with the verifier's frontier at distance 1).
`data_only: true` stops once the data (and cache) are ready. Only the heads go through `accelerator.prepare`
(the backbone is replicated, never sharded). Every `checkpointing_steps` the accelerate state is saved under
`output_dir/checkpoints/step_N` (written to a temporary name, then renamed);
`--resume_from_checkpoint latest` continues with the same data order and step and ends with the same heads as an
uninterrupted run (with or without a cache). Several CPU processes (gloo) get accelerate's MULTI_CPU mode, so
barriers, gathers and DDP gradient sync are real (without `cpu=True` accelerate silently ran them as independent
single processes); they split answer generation and cache shards between them. At the end `output_dir` holds
`hispec_heads.safetensors` (keys as `EarlyExitModel.heads_state_dict()`, fp32), `hispec_train.json` (hispec
config, base identity, arguments, data sizes and sources) and `metrics.json` (per exit top-1 and top-5
agreement with the final layer's argmax and expected tokens per verification round, before/during/after
training; held-out tokens are those of the loss mask; with a cache the reported KL is the top-k + bucket KL;
context heads also per frontier distance in the final evaluation). The final evaluation is also printed.

Contract: `main(argv=None) -> int`; importing this module does nothing. Bad configurations raise `ConfigError`
(a `ValueError`) before any training; as a script they print `error: ...` and exit 2. The code is the
distillation core's (`hispec/distill/trainer.py` and the modules above); this file is its accelerate entry point.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `hispec` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hispec.distill import precision, trainer  # noqa: E402
from hispec.distill.args import (  # noqa: E402
    ConfigError, DataArguments, GenerationArguments, ModelArguments, TrainArguments, build_parser, parse_args,
)

__all__ = ["ConfigError", "DataArguments", "GenerationArguments", "ModelArguments", "TrainArguments", "build_parser",
           "main", "parse_args"]


def main(argv=None) -> int:
    m, d, g, t = parse_args(argv)  # ---- parse the config (YAML defaults, the command line wins)
    trainer.validate_static(m, d, t, g)  # everything that needs no model fails here
    precision.warn_if_slow_low_precision(m, d, g, t)
    state, accelerate_kwargs = trainer.start_processes(t)

    model, tokenizer, rows, resume_dir = trainer.load_model(m, d, t, state)  # ---- build
    data = trainer.build_data(state, model, tokenizer, rows, m, d, g, t)
    if t.data_only:
        return trainer.data_only_summary(state, data)
    if m.head_type == "eagle3":  # an EAGLE-3 drafter instead of exit heads (hispec/distill/drafter_trainer.py)
        from hispec.distill.drafter_trainer import DrafterTrainer

        run = DrafterTrainer(model, data, m, d, g, t, accelerate_kwargs, resume_dir)
    else:
        run = trainer.Trainer(model, data, m, d, g, t, accelerate_kwargs, resume_dir)

    run.loop()  # ---- loop (resumed from the checkpoint, if any)
    run.save()  # ---- save: final evaluation, heads, hispec_train.json, metrics.json
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
