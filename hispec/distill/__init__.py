"""The distillation core: everything that trains exit heads by distillation from the model's own final layer,
shared by `train/heads.py` (the accelerate entry point), `hispec-probe` and the data tools: one implementation of
each job.

- `args`: the run's argument dataclasses and recipe parsing (no torch at import);
- `data`: training files / Hub datasets, chat normalization and rendering, tokenization, collators, samplers, the
  rule that benchmarks are never training data;
- `items`: the same formats as plain items (no `datasets`; what `hispec-probe` reads), held-out splits by prompt;
- `generate`: the one batched generator (`generate_rows`) and answering loop (`answer_batches`);
- `answers`: self-distillation answers (`generate_responses`, resumable), token answers with their cache
  (`answer_prompts`, `AnswerCache`), `generation_dtype` and `generating` (that, prepacked);
- `self_prompts`: instructions the model writes itself (resumable, deterministic);
- `features`: the frozen pass over many sequences (`frozen_batches`), the feature cache (exit hidden states + the
  final layer's top-k, resumable shards) and its in-memory form for scored positions (`scored_features`);
- `losses`: forward KL / top-k + bucket KL, chunked over tokens, and agreement counts;
- `metrics`: agreement with the final layer, tokens per round (i.i.d. and measured), checkpoint heads' predictions;
- `training`: the LR schedule and optimizer step, context-head distances, the accelerate evaluation, `fit_head`;
- `run_cache`: a training run's feature cache (the layers it stores and reads, the check before loading, the
  build over processes);
- `trainer`: `train/heads.py`'s checks, model and data building, loop, checkpoints and outputs.

Shipped with the package; `pip install hispec[train]` adds what training needs (accelerate, datasets, peft).
Importing `hispec.distill` itself loads nothing.
"""
