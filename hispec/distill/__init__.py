"""The distillation core: everything that trains exit heads by distillation from the model's own final layer,
shared by `train/heads.py` (the accelerate entry point), `hispec-probe` and the data tools.

- `args`: the run's argument dataclasses and recipe parsing (no torch at import);
- `data`: training files / Hub datasets, chat normalization and rendering, tokenization, collators, samplers;
- `answers`: self-distillation answers (`generate_responses`, resumable) and `generation_dtype`;
- `self_prompts`: instructions the model writes itself (resumable, deterministic);
- `features`: the feature cache (exit hidden states + the final layer's top-k, resumable shards);
- `losses`: forward KL / top-k + bucket KL, chunked over tokens, and agreement counts.

Shipped with the package; `pip install hispec[train]` adds what training needs (accelerate, datasets, peft).
Importing `hispec.distill` itself loads nothing.
"""
