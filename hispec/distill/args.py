"""The distillation run's configuration: the argument dataclasses of `train/heads.py` and of the standalone data
tools (`GenerationArguments`, `SelfPromptArguments`), recipe parsing (`parse_args`: YAML defaults, the command
line wins) and `ConfigError`.

Dataclasses and parsing only: importing this module loads neither torch nor transformers (`build_parser` imports
`transformers.HfArgumentParser` when called: transformers is heavy).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

TRAINABLE_HEADS = ("norm", "linear", "lowrank", "layer", "context", "eagle3")
EVAL_DISTANCES = (1, 2, 3, 4)  # frontier distances at which context heads are evaluated (metrics.json)
LR_SCHEDULES = ("constant", "linear", "cosine")


class ConfigError(ValueError):
    """The run configuration is unusable; raised before any training, with what to change."""


@dataclass
class GenerationArguments:
    gen_max_new_tokens: int = field(default=256, metadata={"help": "Self-distillation: new tokens per answer."})
    gen_batch_size: int = field(default=8, metadata={"help": "Self-distillation: prompts per generate() call."})
    gen_do_sample: bool = field(default=False, metadata={"help": "Self-distillation: sample (true) or greedy."})
    gen_temperature: float = field(default=0.7, metadata={"help": "Self-distillation sampling temperature."})
    gen_top_p: float = field(default=0.95, metadata={"help": "Self-distillation nucleus sampling top-p."})
    gen_max_prompt_tokens: int = field(
        default=1024, metadata={"help": "Self-distillation: prompts longer than this many tokens are skipped."}
    )
    gen_dtype: str = field(
        default="auto",
        metadata={"help": "Dtype the backbone generates in (answers, self-written prompts): auto (as loaded), fp32, "
                          "bf16, fp16. Training keeps the backbone's own dtype."},
    )


@dataclass
class SelfPromptArguments:
    """Settings of the self-written prompts (fields of `DataArguments`, too)."""

    self_prompts: int = field(
        default=0, metadata={"help": "Number of self-written prompts to write (train/heads.py: and answer); 0 = none."}
    )
    self_prompts_dir: str | None = field(
        default=None,
        metadata={"help": "Where self-written prompts are written/reused (default output_dir/self_prompts)."},
    )
    self_prompt_cue_fraction: float = field(
        default=0.85, metadata={"help": "Share of self-written prompts that start from a built-in task cue."}
    )
    self_prompt_max_new_tokens: int = field(default=96, metadata={"help": "Max tokens of a self-written prompt."})
    self_prompt_temperature: float = field(default=0.9, metadata={"help": "Sampling temperature of self prompts."})
    self_prompt_top_p: float = field(default=0.95, metadata={"help": "Nucleus top-p of self-written prompts."})
    self_prompt_batch_size: int = field(default=32, metadata={"help": "Self-written prompts sampled per batch."})
    self_prompt_system: str | None = field(
        default=None, metadata={"help": "System message of the prompt-writing chat (default: the template's own)."}
    )
    self_prompt_cues: str | None = field(
        default=None,
        metadata={"help": "Task cues to draw from instead of the built-in TASK_CUES: a .json list of strings or a "
                          "text file with one cue per line (a literal \\n is a newline; blank lines and lines "
                          "starting with # are skipped). Repeat a cue to weight it."},
    )


# ---------------------------------------------------------------------------------------------------- config
@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model: Hub id, local HF folder or .gguf file (~ and $VARS expanded)."}
    )
    revision: str | None = field(default=None, metadata={"help": "Hub revision of the base model."})
    dtype: str = field(
        default="auto", metadata={"help": "Backbone dtype: auto, fp32, bf16 or fp16 (heads train in fp32)."}
    )
    adapter_name_or_path: str | None = field(
        default=None, metadata={"help": "A LoRA adapter (peft) merged into the base model before training."}
    )
    draft_layer: int | None = field(
        default=None, metadata={"help": "Draft exit: hidden state after this many layers (default round(depth/8))."}
    )
    verify_layer: int | None = field(
        default=None, metadata={"help": "Intermediate-verifier exit (default round(depth/4))."}
    )
    head_type: str = field(default="linear", metadata={"help": f"Exit head type: {', '.join(TRAINABLE_HEADS)}."})
    head_rank: int = field(default=64, metadata={"help": "Rank of 'lowrank' heads."})
    head_lora_rank: int = field(
        default=0, metadata={"help": "'layer' heads: train the copied decoder layer through LoRA of this rank (peft; "
                                     "0 = train it fully). Norm and residual adapter always train fully."}
    )
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA alpha of 'layer' heads (hispec-export merges)."})
    context_window: int = field(
        default=16, metadata={"help": "'context' heads: positions <= t each query attends over (hispec.drafters.heads)."}
    )
    context_heads: int = field(default=4, metadata={"help": "'context' heads: attention heads."})
    context_head_dim: int | None = field(
        default=None, metadata={"help": "'context' heads: dimension per attention head (default min(64, H / heads))."}
    )
    context_mlp_mult: int = field(default=2, metadata={"help": "'context' heads: MLP width as a multiple of H."})
    context_frontier: bool = field(
        default=True, metadata={"help": "'context' heads: a direct path from the newest verified final state (+ a "
                                        "distance embedding) into the MLP (hispec.drafters.heads)."}
    )
    context_mid: bool = field(
        default=False, metadata={"help": "'context' heads: the draft head also reads the verifier exit's states of "
                                         "positions the verifier passed (hispec's draft > verify > full)."}
    )
    eagle3_aux_layers: list[int] = field(
        default_factory=list,
        metadata={"help": "'eagle3' drafter: target layer ids whose residual streams it reads (id i = after i "
                          "layers; default 2, depth/2, depth-3 as speculators/vLLM)."})
    eagle3_ttt_steps: int = field(
        default=3, metadata={"help": "'eagle3' drafter: draft steps unrolled per position in training (>= 1)."})
    eagle3_step_decay: float = field(
        default=1.0, metadata={"help": "'eagle3' drafter: loss weight of draft step s is decay**s."})
    eagle3_draft_vocab_size: int = field(
        default=8192, metadata={"help": "'eagle3' drafter: draft vocabulary (the teacher's most frequent tokens in "
                                        "the training cache); 0 = the full vocabulary."})
    eagle3_intermediate_size: int = field(
        default=0, metadata={"help": "'eagle3' drafter: its MLP width (0 = the target's; smaller keeps a drafter of a "
                                     "wide target small: Qwen2.5-1.5B's 8,960 makes ~82M parameters)."})
    eagle3_init_from: str | None = field(
        default=None,
        metadata={"help": "'eagle3' drafter: start from the drafter in this folder (a run's output_dir or "
                          "recipes/artifacts/<model>/eagle3) instead of from scratch: its weights and draft vocabulary; "
                          "its shape must be the one this run asks for. For more training on new data."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "Backbone attention: sdpa or eager."})


@dataclass
class DataArguments(SelfPromptArguments):
    train_file: list[str] = field(
        default_factory=list, metadata={"help": "Local training files (json, jsonl, parquet, txt); several allowed."}
    )
    dataset_name: str | None = field(default=None, metadata={"help": "A Hugging Face Hub dataset to train on."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Config name of --dataset_name."})
    dataset_split: str = field(default="train", metadata={"help": "Split of --dataset_name."})
    text_column: str = field(
        default="text", metadata={"help": "Column of plain text (a user prompt when self_distill)."}
    )
    messages_column: str = field(
        default="messages",
        metadata={"help": "Column of chats ({role, content} or ShareGPT {from, value} turns), used where present."},
    )
    max_samples_per_file: int | None = field(
        default=None, metadata={"help": "Keep at most this many rows of each source."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep at most this many training rows."})
    eval_file: list[str] = field(
        default_factory=list, metadata={"help": "Held-out files; default: an eval_fraction split."}
    )
    eval_fraction: float = field(default=0.05, metadata={"help": "Share of training rows held out for evaluation."})
    max_eval_samples: int | None = field(default=64, metadata={"help": "Keep at most this many held-out rows."})
    max_seq_length: int = field(default=512, metadata={"help": "Tokens per training sequence (truncate or pack)."})
    packing: bool = field(
        default=False, metadata={"help": "Pack sequences into max_seq_length blocks instead of padding."}
    )
    self_distill: bool = field(
        default=False, metadata={"help": "First let the model answer the prompts itself; train on its own answers."}
    )
    self_distill_dir: str | None = field(
        default=None, metadata={"help": "Where answers are written/reused (default output_dir/self_distill)."}
    )
    document_prompt_fraction: float = field(
        default=0.0,
        metadata={"help": "With self_distill: this share of the model's own training answers (of >= 64 tokens) "
                          "becomes the passage of a further instruction (summarise, extract, answer from, rewrite, "
                          "translate it) that the model answers too (hispec.distill.document_prompts); 0 = none."},
    )
    plain_text_file: list[str] = field(
        default_factory=list,
        metadata={"help": "Files distilled teacher-forced on every position, nothing generated: chats (all turns), "
                          "text_column + plain_text_answer_column pairs, plain text (json/jsonl/parquet/txt)."},
    )
    plain_text_loss_on: str = field(
        default="all", metadata={"help": "Plain-text loss positions: all, or assistant (chat replies only)."}
    )
    plain_text_answer_column: str | None = field(
        default="answer",
        metadata={"help": "Plain text: a column that, next to text_column, makes a user + assistant chat."},
    )
    plain_text_max_samples_per_file: int | None = field(
        default=None, metadata={"help": "Keep at most this many rows of each plain-text file."}
    )
    feature_cache: str | None = field(
        default=None,
        metadata={"help": "Folder of cached backbone features (built first if missing; train from it): exit hidden "
                          "states + the final layer's top-k distribution, see hispec/distill/features.py."},
    )
    feature_cache_reuse: list[str] = field(
        default_factory=list,
        metadata={"help": "Earlier feature cache folders (a feature_cache root or one split folder) of the same "
                          "model: sequences already cached there are copied, only new ones run through the "
                          "backbone. Growing the data: a new feature_cache folder, the old one here."},
    )
    feature_cache_k: int = field(default=64, metadata={"help": "Teacher tokens kept per position in the cache."})
    feature_cache_final_states: bool = field(
        default=False,
        metadata={"help": "Also cache the final layer's raw residual (hidden.<num_layers>), which 'context' heads "
                          "read (always on for them): one cache then trains linear and context heads alike."},
    )
    feature_cache_dtype: str = field(default="bf16", metadata={"help": "Dtype of cached hidden states: bf16 or fp32."})
    feature_cache_backbone_dtype: str = field(
        default="auto",
        metadata={"help": "Dtype the backbone runs in while building the cache: auto (as loaded), fp32, bf16, fp16 "
                          "(bf16: ~2.5x faster on this CPU; the teacher is then the bf16 model's)."},
    )
    feature_cache_shard_tokens: int = field(default=65536, metadata={"help": "Tokens per cache shard file."})
    feature_cache_batch_tokens: int = field(
        default=4096, metadata={"help": "Padded tokens per backbone pass while building the cache."}
    )


@dataclass
class TrainArguments:
    output_dir: str = field(default="runs/heads", metadata={"help": "Run folder: checkpoints/, heads, metrics."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Start afresh even if output_dir holds a run."})
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; > 0 overrides num_train_epochs."})
    num_train_epochs: int = field(default=1, metadata={"help": "Passes over the training data (if max_steps <= 0)."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Sequences per process per micro-batch."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Sequences per process per eval batch."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    learning_rate: float = field(default=1e-3, metadata={"help": "Peak AdamW learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "Gradient clipping norm (0 = off; DeepSpeed: its JSON)."}
    )
    lr_scheduler_type: str = field(default="cosine", metadata={"help": f"LR schedule: {', '.join(LR_SCHEDULES)}."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear LR warm-up, in optimizer steps."})
    min_lr_ratio: float = field(
        default=0.0, metadata={"help": "Linear / cosine decay ends at this share of the peak LR (0 = decays to 0)."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Distillation temperature T (loss scaled by T^2)."})
    ce_weight: float = field(
        default=0.0, metadata={"help": "Weight of next-token cross-entropy mixed into the KL, in [0, 1]."}
    )
    loss_chunk_size: int = field(
        default=0, metadata={"help": "Tokens per logits chunk in the loss (0 = auto: <= 32M logits)."}
    )
    loss_dtype: str = field(
        default="auto",
        metadata={"help": "Dtype of the frozen lm_head matmuls in the loss: auto (the backbone's), fp32, bf16, fp16; "
                          "softmax and KL stay fp32 (bf16: ~2x faster steps on this CPU)."},
    )
    train_vocab_size: int = field(
        default=0,
        metadata={"help": "Both heads learn to propose only the K most frequent tokens of the self-distilled answers "
                          "(hispec.vocab, as hispec-export --draft-vocab-size K picks them; specials always in): the "
                          "loss narrows the lm_head to those K rows (~V/K x cheaper; what decoding with a reduced "
                          "vocabulary computes) and the trained heads keep the vocabulary, so a plain hispec-export "
                          "uses it. Needs feature_cache. 0 = full vocabulary."},
    )
    seed: int = field(default=42, metadata={"help": "Seed of data order, head init and sampling."})
    checkpointing_steps: int = field(
        default=0, metadata={"help": "Save the training state every N optimizer steps (0 = never)."}
    )
    save_total_limit: int | None = field(
        default=3, metadata={"help": "Keep only the newest N checkpoints (none = all)."}
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={"help": "A checkpoint folder, or 'latest' (newest in output_dir/checkpoints; none: fresh start)."},
    )
    eval_steps: int = field(
        default=0, metadata={"help": "Evaluate every N optimizer steps (0 = only before and after)."}
    )
    eval_at_start: bool = field(default=True, metadata={"help": "Evaluate the untrained heads before training."})
    gamma: int = field(
        default=4, metadata={"help": "Drafts per round: for expected tokens per round and the saved config."}
    )
    window: int = field(default=4, metadata={"help": "Decoding window N_i recorded in the saved hispec config."})
    context_draft_distance: list[int] = field(
        default_factory=list,
        metadata={"help": "'context' heads: LO HI, the range (inclusive) the draft head's distance to the verified "
                          "frontier is drawn from, uniformly per position and step (default: 1 gamma+window-1 when "
                          "the recipe or command line sets gamma or window, as hispec decoding produces; else 1 4)."},
    )
    context_verify_distance: list[int] = field(
        default_factory=list,
        metadata={"help": "'context' heads: LO HI for the verifier head (default 1 gamma+window, else 1 8)."},
    )
    context_mid_distance: list[int] = field(
        default_factory=list,
        metadata={"help": "'context' heads with context_mid: LO HI of the draft's distance to the verifier's "
                          "frontier, drawn <= its final distance (default 1 gamma, else 1 4)."},
    )
    logging_steps: int = field(default=10, metadata={"help": "Log to the trackers every N optimizer steps."})
    data_only: bool = field(
        default=False, metadata={"help": "Prepare the data (prompts, answers, feature cache), then exit untrained."}
    )
    report_to: str = field(
        default="none", metadata={"help": "accelerate trackers: none, all, tensorboard, wandb, ... (comma-separated)."}
    )


def build_parser():
    from transformers import HfArgumentParser

    parser = HfArgumentParser((ModelArguments, DataArguments, GenerationArguments, TrainArguments))
    parser.add_argument("--config", default=None, help="A YAML recipe giving defaults for any field (CLI wins).")
    return parser


def parse_args(argv=None):
    """argv -> (ModelArguments, DataArguments, GenerationArguments, TrainArguments); YAML defaults, CLI wins."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    parser = build_parser()
    if known.config:
        path = Path(os.path.expanduser(known.config))
        if not path.is_file():
            raise ConfigError(f"recipe {known.config} does not exist")
        recipe = yaml.safe_load(path.read_text()) or {}
        if not isinstance(recipe, dict):
            raise ConfigError(f"recipe {known.config} must be a mapping of field: value")
        names = {f.name for dc in parser.dataclass_types for f in fields(dc)}
        unknown = sorted(set(recipe) - names)
        if unknown:
            raise ConfigError(f"recipe {known.config}: unknown field(s) {unknown}; see `train/heads.py --help`")
        for key in ("train_file", "eval_file", "plain_text_file"):
            if isinstance(recipe.get(key), str):
                recipe[key] = [recipe[key]]
        parser.set_defaults(**recipe)
        given = set(recipe)
    else:
        given = set()
    given |= {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    try:
        *dcs, extra = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    dcs[-1].decoding_given = bool(given & {"gamma", "window"})  # context distances follow them (context_ranges)
    return tuple(dcs)
