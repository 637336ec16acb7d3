"""The trainer behind `train/heads.py`: configuration checks, the model and its data, the accelerate loop with
evaluation, checkpoints and resume, and the run's outputs. `train/heads.py` reads as parse -> build -> loop -> save
on these pieces; what each step does is described there (and in design.md §4, §6).

- `validate_static(m, d, t, g)`: checks that need no model (`ConfigError`; which precision pays on this CPU is
  `hispec.distill.precision`'s);
- `start_processes(t)`: the process group (gloo for CPU processes) before anything is loaded;
- `load_model(m, d, t, state)`: exits, tokenizer, data rows, the frozen base (a LoRA adapter merged) with fresh
  heads, the checkpoint to resume -- everything that can fail does so before any training;
- `build_data(...)`: self-written prompts, self-distilled answers, plain text, tokenization, the feature cache
  (`hispec.distill.run_cache`) -> `Data` (`data_only_summary` for `data_only: true`);
- `Trainer(model, data, ...)`: heads, optimizer and loaders through `accelerate.prepare`; `loop()` trains (after
  resuming a checkpoint: same data order, step and distance draws as an uninterrupted run), evaluating every
  `eval_steps` and checkpointing every `checkpointing_steps` (a temporary folder, then renamed); `save()` runs the
  final evaluation and writes the heads, `hispec_train.json` and `metrics.json` (each to a temporary name first).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import datasets
import torch
from accelerate import Accelerator, DataLoaderConfiguration, PartialState
from accelerate.utils import InitProcessGroupKwargs, set_seed
from datasets import Dataset, concatenate_datasets
from safetensors.torch import save_file
from torch.utils.data import DataLoader, SequentialSampler
from tqdm.auto import tqdm
from transformers import AutoConfig

from hispec.distill import data as tdata
from hispec.distill.answers import generate_responses, prompts_from, read_responses
from hispec.distill.args import (
    LR_SCHEDULES, TRAINABLE_HEADS, ConfigError, DataArguments, GenerationArguments, ModelArguments, TrainArguments,
)
from hispec.distill.document_prompts import answer_document_prompts
from hispec.distill.drafter import drafter_aux_layers, validate_drafter_args
from hispec.distill.data import LOSS_ON, DataError, builder_for, check_training_files, expand_path
from hispec.distill.features import CachedCollator
from hispec.distill.run_cache import check_feature_cache, prepare_feature_cache, validate_cache_args
from hispec.distill.self_prompts import SelfPromptError, ensure_self_prompts, validate_args
from hispec.distill.training import (
    HeadsForTraining, _distance_seed, _loss_fn, context_ranges, context_settings, distance_sampler, evaluate,
    format_agreement, lr_at, take_step,
)
from hispec.drafters.eagle3 import DRAFTER_CONFIG, DRAFTER_FILE
from hispec.drafters.heads import HEAD_TYPES
from hispec.io import HeapTrimmer, atomic_write, parse_dtype, write_json
from hispec.layers import DecoderAdapter
from hispec.model import (
    EXITS, HEADS_FILE, METRICS_FILE, TRAIN_FILE, EarlyExitModel, default_exits, load_base_model, load_tokenizer,
    validate_exits,
)
from hispec.vocab import vocab_for_model
from hispec.prompts import pad_id_of

logger = logging.getLogger("hispec.train")

STATE_FILE = "hispec_state.json"
CHECKPOINTS = "checkpoints"


def _step_hook(step: int) -> None:
    """Called after every optimizer step (tests replace it to simulate a kill)."""


# ---------------------------------------------------------------------------------------------------- checks
def find_checkpoint(output_dir: Path, spec: str | None) -> Path | None:
    """`latest` -> newest complete `checkpoints/step_N` (None if there is none); a path -> that folder."""
    if not spec:
        return None
    if spec != "latest":
        path = Path(os.path.expanduser(spec))
        if not (path / STATE_FILE).is_file():
            raise ConfigError(f"resume_from_checkpoint {spec} is not a checkpoint folder (no {STATE_FILE})")
        return path
    ckpts = _complete_checkpoints(output_dir)
    return ckpts[-1] if ckpts else None


def _complete_checkpoints(output_dir: Path) -> list[Path]:
    root = output_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if p.name.startswith("step_") and p.name[5:].isdigit() and (p / STATE_FILE).is_file():
            found.append((int(p.name[5:]), p))
    return [p for _, p in sorted(found)]


def validate_static(m: ModelArguments, d: DataArguments, t: TrainArguments, g=None) -> None:
    """Checks that need no model: raise ConfigError with what to change."""
    if not m.model_name_or_path:
        raise ConfigError("model_name_or_path is required (a Hub id, a local folder or a .gguf file)")
    if m.head_type not in HEAD_TYPES and m.head_type not in TRAINABLE_HEADS:
        raise ConfigError(f"unknown head type '{m.head_type}'; choose one of {', '.join(TRAINABLE_HEADS)}")
    if m.head_type not in TRAINABLE_HEADS:
        raise ConfigError(
            f"head type '{m.head_type}' has no trainable weights; choose one of {', '.join(TRAINABLE_HEADS)}"
        )
    if m.head_lora_rank < 0 or (m.head_lora_rank and m.head_type != "layer"):
        raise ConfigError(f"head_lora_rank {m.head_lora_rank}: LoRA applies to 'layer' heads only (>= 1; 0 = off)")
    context_ranges(m, t)  # context head settings and distance ranges (ConfigError when unusable)
    validate_drafter_args(m, d, t)
    if t.train_vocab_size < 0:
        raise ConfigError(f"train_vocab_size must be >= 0 (0 = the full vocabulary), got {t.train_vocab_size}")
    if t.train_vocab_size and not d.feature_cache:
        raise ConfigError("train_vocab_size needs a feature_cache (the teacher stored as its top-k, which the "
                          "reduced vocabulary is carved out of); set feature_cache or train_vocab_size 0")
    if not d.train_file and not d.dataset_name and not d.self_prompts and not d.plain_text_file:
        raise ConfigError("no training data: give --train_file (json/jsonl/parquet/txt), --dataset_name, "
                          "--self_prompts N and/or --plain_text_file")

    for f in [*d.train_file, *d.eval_file, *d.plain_text_file]:
        p = expand_path(f)
        if not Path(p).is_file():
            raise ConfigError(f"data file {f} does not exist")
        try:
            builder_for(p)
        except DataError as e:
            raise ConfigError(str(e)) from e
    try:
        check_training_files([*d.train_file, *d.plain_text_file])
    except DataError as e:
        raise ConfigError(str(e)) from e
    try:
        validate_args(d)
    except SelfPromptError as e:
        raise ConfigError(str(e)) from e
    if d.self_prompts and not d.self_distill:
        raise ConfigError("self_prompts are instructions for the model to answer: set self_distill: true")
    if d.self_distill and not (d.train_file or d.dataset_name or d.self_prompts):
        raise ConfigError("self_distill needs prompts: give --train_file, --dataset_name or --self_prompts N")
    if not 0.0 <= d.document_prompt_fraction <= 1.0:
        raise ConfigError(f"document_prompt_fraction must be in [0, 1], got {d.document_prompt_fraction}")
    if d.document_prompt_fraction and not d.self_distill:
        raise ConfigError("document_prompt_fraction builds prompts over the model's own answers: "
                          "set self_distill: true")
    if d.plain_text_loss_on not in LOSS_ON:
        raise ConfigError(f"unknown plain_text_loss_on '{d.plain_text_loss_on}'; choose one of {', '.join(LOSS_ON)}")

    if g is not None:
        try:
            parse_dtype(g.gen_dtype)
        except ValueError as e:
            raise ConfigError(f"gen_dtype: {e}") from e
    try:
        parse_dtype(t.loss_dtype)
    except ValueError as e:
        raise ConfigError(f"loss_dtype: {e}") from e
    validate_cache_args(d, t)
    if not 0.0 <= d.eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {d.eval_fraction}")
    if d.max_seq_length < 2:
        raise ConfigError(f"max_seq_length must be >= 2, got {d.max_seq_length}")
    if t.temperature <= 0:
        raise ConfigError(f"temperature must be > 0, got {t.temperature}")
    if not 0.0 <= t.ce_weight <= 1.0:
        raise ConfigError(f"ce_weight must be in [0, 1], got {t.ce_weight}")
    if t.lr_scheduler_type not in LR_SCHEDULES:
        raise ConfigError(f"unknown lr_scheduler_type '{t.lr_scheduler_type}'; choose one of {', '.join(LR_SCHEDULES)}")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "gamma"):
        if getattr(t, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(t, name)}")
    if t.max_steps <= 0 and t.num_train_epochs < 1:
        raise ConfigError("set max_steps > 0 or num_train_epochs >= 1")
    out = Path(os.path.expanduser(t.output_dir))
    has_run = (out / HEADS_FILE).exists() or (out / DRAFTER_FILE).exists() or (out / CHECKPOINTS).is_dir()
    if has_run and not t.overwrite_output_dir and not t.resume_from_checkpoint:
        raise ConfigError(
            f"output_dir {out} already holds a run; pass --resume_from_checkpoint latest to continue it or "
            "--overwrite_output_dir true to start afresh"
        )
    ckpt = find_checkpoint(out, t.resume_from_checkpoint)  # a named checkpoint must exist
    if ((out / HEADS_FILE).exists() or (out / DRAFTER_FILE).exists()) and ckpt is None and not t.overwrite_output_dir:
        raise ConfigError(
            f"output_dir {out} holds a finished run and no checkpoint to resume from; pass "
            "--overwrite_output_dir true to train again"
        )


def _num_layers_from_config(path: str, revision: str | None) -> int | None:
    if path.endswith(".gguf"):
        return None  # read from the loaded model instead
    cfg = AutoConfig.from_pretrained(path, **({"revision": revision} if revision else {}))
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return int(cfg.num_hidden_layers)


def resolve_exits(m: ModelArguments, num_layers: int) -> tuple[int, int]:
    d_def, v_def = default_exits(num_layers)
    draft = d_def if m.draft_layer is None else m.draft_layer
    verify = v_def if m.verify_layer is None else m.verify_layer
    try:
        validate_exits(draft, verify, num_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    return draft, verify


def load_base(m: ModelArguments):
    """The frozen base model, with a LoRA adapter merged in first when one is given."""
    path = expand_path(m.model_name_or_path)
    base = load_base_model(path, dtype=m.dtype, revision=m.revision)
    if hasattr(base, "set_attn_implementation"):
        base.set_attn_implementation(m.attn_implementation)
    if m.adapter_name_or_path:
        from peft import PeftModel

        base = PeftModel.from_pretrained(base, expand_path(m.adapter_name_or_path)).merge_and_unload()
        base.eval()
        for p in base.parameters():
            p.requires_grad_(False)
    return base


def wrap_model(base, m: ModelArguments, draft: int, verify: int, gamma: int, window: int):
    """EarlyExitModel with fresh heads; the base identity records the name given and any merged adapter. An
    `eagle3` run carries its frozen base the same way, with weightless `shared` exits (the data path is the same;
    `hispec.distill.drafter_trainer` builds the drafter)."""
    ctx = ({"context": context_settings(m), "context_mid": m.context_mid} if m.head_type == "context" else {})
    head_type = "shared" if m.head_type == "eagle3" else m.head_type
    model = EarlyExitModel.from_base(base, draft, verify, head_type, head_rank=m.head_rank, gamma=gamma,
                                     window=window, revision=m.revision, **ctx)
    model.hispec_config.base["name_or_path"] = m.model_name_or_path
    if m.adapter_name_or_path:
        model.hispec_config.base["merged_adapter"] = m.adapter_name_or_path
    if m.head_type == "layer" and m.head_lora_rank:
        add_layer_lora(model, m.head_lora_rank, m.lora_alpha)
    return model


def add_layer_lora(model, rank: int, alpha: float) -> None:
    """LoRA (peft) on every linear map of the heads' copied decoder layers; the layer's own weights freeze, the
    heads' norms and residual adapters keep training. The saved heads then hold peft keys that `hispec-export`
    merges (it reads `lora_alpha` from the run's arguments)."""
    from peft import LoraConfig
    from peft.tuners.lora import LoraModel

    targets = sorted(n for n, mod in model.heads.named_modules()
                     if isinstance(mod, torch.nn.Linear) and ".layer." in f".{n}.")
    if not targets:
        raise ConfigError("head_lora_rank: the heads' decoder layers have no nn.Linear maps to adapt")
    LoraModel(model.heads, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets), "default")
    for n, p in model.heads.named_parameters():
        p.requires_grad_("lora_" in n or ".layer." not in f".{n}.")


# ---------------------------------------------------------------------------------------------------- build
def start_processes(t: TrainArguments):
    """The process group, first of all: -> (PartialState, the Accelerator's process settings).

    CPU processes talk through gloo (design.md §6: without it each rank may believe it is rank 0 of 1); a plain
    single process must not get a backend, or accelerate would try to start a process group. `accelerate launch
    --multi_gpu` sets ACCELERATE_USE_CPU=False in the workers: without cpu=True accelerate gives several CPU
    processes DistributedType.NO, so barriers, gathers and DDP's gradient sync silently do nothing (each rank trains
    its own heads). DeepSpeed brings its own CPU path and must not get cpu=True. The Accelerator (and with it
    DeepSpeed's ZeRO-3 hook into from_pretrained, which would shard the frozen backbone) comes only after the
    backbone is loaded. Ranks wait at barriers while the main process writes self-written prompts or a cache plan:
    far longer than gloo's default 30 min timeout."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    gloo = ("WORLD_SIZE" in os.environ or deepspeed) and not torch.cuda.is_available()
    multi_cpu = {"cpu": True} if gloo and not deepspeed else {}
    long_wait = {"timeout": timedelta(hours=12)} if multi_cpu else {}
    state = PartialState(**({"backend": "gloo", **multi_cpu, **long_wait} if gloo else {}))
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not state.is_main_process:
        logger.setLevel(logging.WARNING)
        datasets.disable_progress_bars()
    set_seed(t.seed)
    return state, {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")] if gloo else [], **multi_cpu}


def output_dir_of(t: TrainArguments) -> Path:
    return Path(os.path.expanduser(t.output_dir)).absolute()


@dataclass
class Rows:
    """The run's data as read, before prompts are answered and text is tokenized ({messages, text} Datasets)."""

    train: object | None
    eval: object | None
    plain: object | None


def load_model(m: ModelArguments, d: DataArguments, t: TrainArguments, state):
    """-> (EarlyExitModel with fresh heads on the device, tokenizer, `Rows`, checkpoint to resume or None). The exits
    and a feature cache are checked against the model's config before anything is loaded (a GGUF file's depth is
    known once loaded)."""
    output_dir, path = output_dir_of(t), expand_path(m.model_name_or_path)
    n_layers = _num_layers_from_config(path, m.revision)
    if n_layers is not None:
        draft, verify = resolve_exits(m, n_layers)
        check_feature_cache(m, d, (draft, verify), n_layers)
    tokenizer = load_tokenizer(path, revision=m.revision)
    if tokenizer is None:
        raise ConfigError(f"no tokenizer found for {m.model_name_or_path}; training needs one to read text")
    with state.main_process_first():
        try:
            rows = Rows(*tdata.load_examples(d, t.seed, require_train=False), tdata.load_plain_text(d, t.seed))
        except tdata.DataError as e:
            raise ConfigError(str(e)) from e
    resume_dir = find_checkpoint(output_dir, t.resume_from_checkpoint)
    if state.is_main_process and t.overwrite_output_dir and not resume_dir:
        for p in (output_dir / CHECKPOINTS, output_dir / HEADS_FILE, output_dir / METRICS_FILE,
                  output_dir / DRAFTER_FILE, output_dir / DRAFTER_CONFIG):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    state.wait_for_everyone()

    t0 = time.time()
    base = load_base(m)
    if n_layers is None:
        n_layers = DecoderAdapter(base).num_layers
        draft, verify = resolve_exits(m, n_layers)
        check_feature_cache(m, d, (draft, verify), n_layers)
    set_seed(t.seed)
    model = wrap_model(base, m, draft, verify, t.gamma, t.window)
    model.tokenizer = tokenizer  # train_vocab_size counts the self-distilled answers with it
    model.base.to(state.device)
    what = (f"eagle3 drafter reading layers {drafter_aux_layers(m, n_layers)}" if m.head_type == "eagle3"
            else f"exits draft={draft} verify={verify}, head={m.head_type}")
    logger.info("loaded %s (%d layers) in %.1fs; %s", m.model_name_or_path, n_layers, time.time() - t0, what)
    return model, tokenizer, rows, resume_dir


@dataclass
class Data:
    """What training reads: tokenized rows (or `CachedSequences`), their collator, and where they came from."""

    train: object
    eval: object | None
    collate: object
    cached: bool
    cache_info: dict | None
    sources: dict


def build_data(state, model, tokenizer, rows: Rows, m: ModelArguments, d: DataArguments, g: GenerationArguments,
               t: TrainArguments) -> Data:
    """Self-written prompts (written by the main process, read by all), self-distilled answers (sharded over
    processes), plain text without held-out prompts, tokenization, the feature cache."""
    output_dir, train_rows, eval_rows, plain_rows = output_dir_of(t), rows.train, rows.eval, rows.plain
    sources = {"file_prompts": len(train_rows) if train_rows is not None else 0,
               "plain_text_rows": len(plain_rows) if plain_rows is not None else 0}
    if d.self_prompts:
        sp_dir = Path(expand_path(d.self_prompts_dir)) if d.self_prompts_dir else output_dir / "self_prompts"
        t0 = time.time()
        with state.main_process_first():
            try:
                written = ensure_self_prompts(model.base, tokenizer, d.self_prompts, sp_dir, d, seed=t.seed,
                                              gen_dtype=g.gen_dtype, show_progress=state.is_local_main_process)
            except SelfPromptError as e:
                raise ConfigError(str(e)) from e
        logger.info("self-written prompts: %d in %s (%.1fs)", len(written), sp_dir, time.time() - t0)
        sp_ds = Dataset.from_list([{"messages": p["messages"], "text": ""} for p in written])
        if train_rows is None and eval_rows is None:
            sp_ds, eval_rows = tdata.split_off_eval(sp_ds, d.eval_fraction, d.max_eval_samples)
        train_rows = sp_ds if train_rows is None else concatenate_datasets([train_rows, sp_ds])
        sources["self_prompts"] = len(written)

    if d.self_distill:  # the model answers the prompts itself (resumable, sharded over processes)
        sd_dir = Path(expand_path(d.self_distill_dir)) if d.self_distill_dir else output_dir / "self_distill"
        train_prompts = prompts_from(train_rows)
        prompts = train_prompts + (prompts_from(eval_rows) if eval_rows is not None else [])
        t0 = time.time()
        n_new = generate_responses(model.base, tokenizer, prompts, sd_dir, g, rank=state.process_index,
                                   world_size=state.num_processes, seed=t.seed,
                                   show_progress=state.is_local_main_process)
        state.wait_for_everyone()
        answers = read_responses(sd_dir)
        logger.info("self-distillation: %d new answers in %.1fs, %d total", n_new, time.time() - t0, len(answers))

        def with_answers(ds):
            rows = [{"messages": answers[p["id"]]["messages"], "text": ""} for p in prompts_from(ds)
                    if p["id"] in answers]
            return Dataset.from_list(rows) if rows else None

        train_rows = with_answers(train_rows)
        eval_rows = with_answers(eval_rows) if eval_rows is not None else None
        if train_rows is None:
            raise ConfigError("self-distillation produced no answers for the training prompts")
        sources["answers"] = len(train_rows)
        if d.document_prompt_fraction:  # training answers as the passages of further prompts (held-out ones never)
            held = {p["id"] for p in prompts[len(train_prompts):]}
            doc_rows, sources["document_prompts"] = answer_document_prompts(
                state, model.base, tokenizer, [answers[p["id"]] for p in train_prompts
                                               if p["id"] in answers and p["id"] not in held], sd_dir, d, g, t.seed)
            if doc_rows:
                train_rows = concatenate_datasets([train_rows, Dataset.from_list(doc_rows)])
            sources["document_answers"] = len(doc_rows)
    if plain_rows is not None and eval_rows is not None:
        n_plain = len(plain_rows)
        plain_rows = tdata.drop_overlap(plain_rows, eval_rows)
        sources["plain_text_rows_dropped_as_held_out"] = n_plain - len(plain_rows)
        if len(plain_rows) == 0:
            plain_rows = None

    with state.main_process_first():
        parts = []
        if train_rows is not None:
            parts.append(tdata.tokenize(train_rows, tokenizer, d.max_seq_length, d.packing, desc="tokenizing train"))
        if plain_rows is not None:
            try:
                parts.append(tdata.tokenize(plain_rows, tokenizer, d.max_seq_length, d.packing,
                                            desc="tokenizing plain text", loss_on=d.plain_text_loss_on))
            except tdata.DataError as e:
                raise ConfigError(str(e)) from e
            sources["plain_text_sequences"] = len(parts[-1])
        train_ds = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
        eval_ds = (tdata.tokenize(eval_rows, tokenizer, d.max_seq_length, False, desc="tokenizing eval")
                   if eval_rows is not None else None)
    if len(train_ds) == 0:
        raise ConfigError(
            "the training data is empty after tokenization (every row shorter than 2 tokens, or without a loss "
            "position" + (f", or no full {d.max_seq_length}-token block to pack" if d.packing else "") + ")"
        )
    if not d.feature_cache:
        return Data(train_ds, eval_ds, tdata.PadCollator(pad_id_of(tokenizer)), False, None, sources)
    exits = (model.draft_layer, model.verify_layer)
    train_ds, eval_ds, info = prepare_feature_cache(state, model, model.adapter, exits, m, d, g, t, train_ds,
                                                    eval_ds, pad_id_of(tokenizer))
    return Data(train_ds, eval_ds, CachedCollator(), True, info, sources)


def data_only_summary(state, data: Data) -> int:
    """`data_only: true`: the data (and cache) are ready; one JSON line says what there is."""
    summary = {"data_only": True, "train_sequences": len(data.train),
               "eval_sequences": len(data.eval) if data.eval is not None else 0, "sources": data.sources,
               "feature_cache": data.cache_info}
    logger.info("data ready: %s", summary)
    if state.is_main_process:
        print(json.dumps(summary))
    return 0


# ---------------------------------------------------------------------------------------------------- loop
class Trainer:
    """One training run once its data is ready (see the module docstring). Only the heads go through
    `accelerator.prepare`; the backbone is replicated, never sharded."""

    def __init__(self, model, data: Data, m: ModelArguments, d: DataArguments, g: GenerationArguments,
                 t: TrainArguments, accelerate_kwargs: dict, resume_dir: Path | None = None):
        self.model, self.data, self.t, self.adapter = model, data, t, model.adapter
        self.output_dir = output_dir_of(t)
        self.exits = (model.draft_layer, model.verify_layer)
        vocab_info = self._restrict_vocab(model, d, t)
        self._prepare(HeadsForTraining(model.heads.float(), self.adapter), data.collate, accelerate_kwargs)
        self.param_dtype = next(self.accelerator.unwrap_model(self.heads).parameters()).dtype
        self.ranges = context_ranges(m, t)
        ctx_info = None if self.ranges is None else {
            "settings": context_settings(m), "mid": m.context_mid, "layers": model.hispec_config.context_layers,
            "ranges": {k: list(v) if v else None for k, v in self.ranges.items()}}
        draft, verify = self.exits
        self.run_info = {"draft_layer": draft, "verify_layer": verify, "head_type": m.head_type, "context": ctx_info,
                         "train_vocab": vocab_info, **self._data_info()}
        self._resume(resume_dir, ("draft_layer", "verify_layer", "head_type", "context", "train_vocab"))
        self._start_trackers("hispec-heads", m, d, g, t)
        logger.info("training: %d sequences, %d steps/epoch, %d steps, %d process(es)", len(data.train),
                    self.steps_per_epoch, self.total_steps, self.accelerator.num_processes)

    def _prepare(self, module, collate, accelerate_kwargs: dict) -> None:
        """What every trained module shares (exit heads here, the EAGLE-3 drafter in `drafter_trainer`): the loaders
        (a seeded epoch order, so resume is exact), the accelerator, AdamW, `accelerate.prepare`, the step counts;
        `self.heads` is then the prepared module."""
        t, data = self.t, self.data
        train_dl = DataLoader(data.train, batch_size=t.per_device_train_batch_size,
                              sampler=tdata.EpochSampler(len(data.train), t.seed), collate_fn=collate)
        eval_dl = (DataLoader(data.eval, batch_size=t.per_device_eval_batch_size, sampler=SequentialSampler(data.eval),
                              collate_fn=collate) if data.eval is not None and len(data.eval) else None)
        self.report_to = [r.strip() for r in t.report_to.split(",") if r.strip() and r.strip() != "none"]
        self.accelerator = acc = Accelerator(
            gradient_accumulation_steps=t.gradient_accumulation_steps, log_with=self.report_to or None,
            project_dir=str(self.output_dir), dataloader_config=DataLoaderConfiguration(use_seedable_sampler=False),
            **accelerate_kwargs)
        self.params = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(self.params, lr=t.learning_rate, weight_decay=t.weight_decay)
        prepared = acc.prepare(module, optimizer, train_dl, *([eval_dl] if eval_dl is not None else []))
        self.heads, self.optimizer, self.train_dl = prepared[:3]
        self.eval_dl = prepared[3] if eval_dl is not None else None
        self.steps_per_epoch = max(1, math.ceil(len(self.train_dl) / t.gradient_accumulation_steps))
        self.total_steps = t.max_steps if t.max_steps > 0 else self.steps_per_epoch * t.num_train_epochs
        self.completed, self.history, self.prior_seconds, self.t_train = 0, [], 0.0, time.time()
        self.loss_fn = None

    def _data_info(self) -> dict:
        """What the run records about its data and steps (beside what trains)."""
        data = self.data
        return {"train_examples": len(data.train), "eval_examples": len(data.eval) if data.eval is not None else 0,
                "steps_per_epoch": self.steps_per_epoch, "total_steps": self.total_steps,
                "world_size": self.accelerator.num_processes, "sources": data.sources, "feature_cache": data.cache_info}

    def _resume(self, resume_dir: Path | None, keys) -> None:
        """Continue from a checkpoint (None: a fresh run) that was trained with the same `run_info[keys]`."""
        if resume_dir is None:
            return
        saved = json.loads((resume_dir / STATE_FILE).read_text())
        for key in keys:
            if saved["run"].get(key) != self.run_info[key]:
                raise ConfigError(f"checkpoint {resume_dir} was trained with {key}={saved['run'].get(key)!r}, "
                                  f"this run asks for {self.run_info[key]!r}; resume with the same configuration")
        self.accelerator.load_state(str(resume_dir))
        self.completed, self.history = int(saved["step"]), list(saved.get("history", []))
        self.prior_seconds = float(saved.get("train_seconds", 0.0))
        logger.info("resumed from %s at step %d", resume_dir, self.completed)

    def _start_trackers(self, project: str, m, d, g, t) -> None:
        self.config_dump = {**asdict(m), **asdict(d), **asdict(g), **asdict(t)}
        if self.report_to:
            self.accelerator.init_trackers(project, config={k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                                                            for k, v in self.config_dump.items()})

    def _restrict_vocab(self, model, d: DataArguments, t: TrainArguments) -> dict | None:
        """`train_vocab_size`: both heads get the K most frequent tokens of the self-distilled answers (the files
        `hispec-export` counts by default; token id order without them) -> what the run records, or None."""
        if not t.train_vocab_size:
            return None
        if not 1 <= t.train_vocab_size <= self.adapter.vocab_size:
            raise ConfigError(f"train_vocab_size {t.train_vocab_size} must be within 1..{self.adapter.vocab_size}")
        folder = Path(expand_path(d.self_distill_dir)) if d.self_distill_dir else self.output_dir / "self_distill"
        files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
        vocab = vocab_for_model(model, t.train_vocab_size, files)
        for name in EXITS:
            model.set_exit_vocab(name, vocab)
        logger.info("heads train on a %d-token vocabulary counted on %s", t.train_vocab_size,
                    ", ".join(str(f) for f in files) or "nothing (token id order)")
        # the ids' checksum makes a resume with different answers (hence another vocabulary) fail loudly
        return {"size": t.train_vocab_size, "counted_on": [str(f) for f in files],
                "ids_sum": int(vocab.sum()), "ids_sq_sum": int((vocab * vocab).sum())}

    def evaluate(self, step: int, final: bool = False) -> dict | None:
        if self.eval_dl is None:
            return None
        res = evaluate(self.accelerator, self.heads, self.adapter, self.eval_dl, self.exits, self.t, self.param_dtype,
                       cached=self.data.cached, ranges=self.ranges, by_distance=final)
        res["step"] = step
        self.history.append(res)
        self.accelerator.log({f"eval/{k}_agreement": res[k]["top1_agreement"]
                              for k in ("draft", "verify", "draft_verify")}, step=step)
        logger.info("eval @%d: agreement draft %.3f verify %.3f draft-verify %.3f", step,
                    res["draft"]["top1_agreement"], res["verify"]["top1_agreement"],
                    res["draft_verify"]["top1_agreement"])
        return res

    def save_checkpoint(self, step: int) -> None:
        """The accelerate state and ours, under a temporary name first, then renamed: a killed save is never
        picked up; only the newest `save_total_limit` are kept."""
        acc, root = self.accelerator, self.output_dir / CHECKPOINTS
        final, tmp = root / f"step_{step}", root / f".tmp_step_{step}"
        if acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        acc.wait_for_everyone()
        acc.save_state(str(tmp))
        acc.wait_for_everyone()
        if acc.is_main_process:
            write_json(tmp / STATE_FILE, {"step": step, "history": self.history, "run": self.run_info,
                                          "train_seconds": self.prior_seconds + time.time() - self.t_train})
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            if self.t.save_total_limit:
                for old in _complete_checkpoints(self.output_dir)[: -self.t.save_total_limit]:
                    shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()

    progress_name = "training heads"

    def step_loss(self, batch, micro: int):
        """One micro-batch -> (loss, stats to log); context heads draw fresh frontier distances per position and
        step, as decoding produces them (seeded by step, micro-batch and process: resume is exact)."""
        dist = None
        if self.ranges:
            gen = torch.Generator().manual_seed(_distance_seed(self.t.seed, self.completed, micro,
                                                               self.accelerator.process_index))
            dist = distance_sampler(self.ranges, gen)
        if self.loss_fn is None:
            self.loss_fn = _loss_fn(self.adapter, self.exits, self.t, self.param_dtype, self.data.cached)
        out, _, _ = self.loss_fn(batch, self.heads, dist=dist)
        return out.loss, {"loss": out.loss.item(), **{f"kl/{k}": v.item() for k, v in out.kl.items()},
                          **{f"agreement/{k}": v.item() for k, v in out.agree.items()}}

    @staticmethod
    def postfix(logs: dict) -> dict:
        return {"loss": f"{logs['loss']:.3f}", "d": f"{logs['agreement/draft']:.2f}",
                "v": f"{logs['agreement/verify']:.2f}"}

    def loop(self) -> None:
        """Train to `total_steps` (from the resumed step: the same batches, learning rates and distance draws)."""
        t, acc = self.t, self.accelerator
        if self.completed == 0 and t.eval_at_start:
            self.evaluate(0)
        bar = tqdm(total=self.total_steps, initial=self.completed, desc=self.progress_name,
                   disable=not acc.is_local_main_process)
        self.heads.train()
        window, window_n, micro = {}, 0, 0  # micro: micro-batch within the step (seeds context distance draws)
        trim = HeapTrimmer()  # batches of every length fragment the C heap: hand its free pages back now and then
        self.t_train = time.time()
        for epoch in range(self.completed // self.steps_per_epoch, math.ceil(self.total_steps / self.steps_per_epoch)):
            if self.completed >= self.total_steps:
                break
            self.train_dl.set_epoch(epoch)
            skip = (self.completed - epoch * self.steps_per_epoch) * t.gradient_accumulation_steps
            loader = acc.skip_first_batches(self.train_dl, skip) if skip > 0 else self.train_dl
            if skip > 0:
                loader.set_epoch(epoch)
            for batch in loader:
                with acc.accumulate(self.heads):
                    loss, stats = self.step_loss(batch, micro)
                    clip = t.max_grad_norm > 0 and acc.sync_gradients
                    take_step(self.optimizer, loss, lr_at(self.completed, self.total_steps, t),
                              backward=acc.backward,
                              clip=(lambda: acc.clip_grad_norm_(self.params, t.max_grad_norm)) if clip else None)
                for k, v in stats.items():
                    window[k] = window.get(k, 0.0) + v
                window_n, micro = window_n + 1, micro + 1
                if not acc.sync_gradients:
                    continue
                micro, self.completed = 0, self.completed + 1
                bar.update(1)
                if self.completed % t.logging_steps == 0 or self.completed == self.total_steps:
                    logs = {k: v / window_n for k, v in window.items()}
                    logs["lr"] = lr_at(self.completed - 1, self.total_steps, t)
                    acc.log(logs, step=self.completed)
                    bar.set_postfix(self.postfix(logs))
                    window, window_n = {}, 0
                if t.eval_steps and self.completed % t.eval_steps == 0 and self.completed < self.total_steps:
                    self.evaluate(self.completed)
                if t.checkpointing_steps and self.completed % t.checkpointing_steps == 0 \
                        and self.completed < self.total_steps:
                    self.save_checkpoint(self.completed)
                trim()
                _step_hook(self.completed)
                if self.completed >= self.total_steps:
                    break
        bar.close()

    def save(self) -> None:
        """The final evaluation, then `hispec_heads.safetensors` (keys as `EarlyExitModel.heads_state_dict()`,
        fp32), `hispec_train.json` and `metrics.json` (each to a temporary name, then renamed); the evaluation is
        printed, with one JSON line."""
        acc = self.accelerator
        train_seconds = round(self.prior_seconds + time.time() - self.t_train, 1)  # across resumes
        final = self.evaluate(self.completed, final=True)
        state = acc.get_state_dict(self.heads)
        if acc.is_main_process:
            heads_state = {k.removeprefix("heads."): (v.detach().float() if v.is_floating_point() else v.detach()).cpu()
                           .contiguous() for k, v in state.items()}  # vocabulary ids stay integers
            self.output_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(self.output_dir / HEADS_FILE,
                         lambda p: save_file(heads_state, str(p), metadata={"format": "pt", "hispec": "1"}))
            hc = self.model.hispec_config
            write_json(self.output_dir / TRAIN_FILE, {
                "hispec": hc.to_dict(), "base": hc.base, "heads_file": HEADS_FILE, "heads_dtype": "float32",
                "steps": self.completed, "train_seconds": train_seconds, "data": self.run_info,
                "args": self.config_dump})
            write_json(self.output_dir / METRICS_FILE, {"final": final, "history": self.history,
                                                        "steps": self.completed, "train_seconds": train_seconds})
            if final is not None:
                print(f"held-out agreement with the final layer's argmax ({METRICS_FILE}):\n" + format_agreement(final))
                line = {"steps": self.completed, "draft_agreement": final["draft"]["top1_agreement"],
                        "verify_agreement": final["verify"]["top1_agreement"],
                        "draft_top5": final["draft"]["top5_agreement"],
                        "verify_top5": final["verify"]["top5_agreement"], "train_seconds": train_seconds}
                for k in ("draft", "verify"):
                    if "by_distance" in final[k]:
                        line[f"{k}_agreement_by_distance"] = {d: round(v["top1_agreement"], 4)
                                                              for d, v in final[k]["by_distance"].items()}
                print(json.dumps(line))
        acc.wait_for_everyone()
        acc.end_training()
