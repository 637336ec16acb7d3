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
- `plain_text_file`: text distilled teacher-forced, nothing generated (whole chats, question + reference answer,
  .txt / .jsonl text); `plain_text_loss_on: assistant` limits the loss to assistant replies.
Without a feature cache each step runs the backbone once without grad, giving the hidden states at both exits and
the final features; both heads learn forward KL(p_final || p_exit) in one pass (hispec/distill/losses.py, chunked over
tokens). With `feature_cache: DIR` the backbone runs ONCE over the tokenized training and held-out sequences and
writes their exit hidden states and the final layer's top-k next-token distribution to DIR/train and DIR/eval
(hispec/distill/features.py: resumable, reused when it matches the run, refused when it does not); the steps then read
those instead of running the backbone and learn the "top-k + bucket" KL (`topk_distill_loss`, temperature 1),
so heads train many epochs cheaply (a `layer` head gets its exit's whole sequences, rebuilt from the cache's
offsets, since it attends over earlier positions; `feature_cache_backbone_dtype` / `loss_dtype: bf16` make the
cache and the steps ~2x cheaper on CPUs with native bf16, and far slower on those without: a warning says so).
`context` heads (hispec/heads.py) also read, for a window of earlier positions, the deepest state decoding holds:
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
(a `ValueError`) before any training; as a script they print `error: ...` and exit 2.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `train` and `hispec` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.utils.data import DataLoader, SequentialSampler  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from hispec.distill import data as tdata  # noqa: E402
from hispec.distill.answers import generate_responses, generation_dtype, prompts_from, read_responses  # noqa: E402
from hispec.distill.args import (  # noqa: E402
    LR_SCHEDULES, TRAINABLE_HEADS, ConfigError, DataArguments, GenerationArguments, ModelArguments,
    TrainArguments, build_parser, parse_args,
)
from hispec.distill.data import LOSS_ON, DataError, builder_for, expand_path  # noqa: E402
from hispec.distill.features import (  # noqa: E402
    CachedCollator, CachedSequences, FeatureCacheError, build_feature_cache, check_cache_layers, model_identity,
    write_manifest,
)
from hispec.distill.self_prompts import SelfPromptError, ensure_self_prompts, validate_args  # noqa: E402
from hispec.distill.training import (  # noqa: E402
    HeadsForTraining, _distance_seed, _loss_fn, context_ranges, context_settings, distance_sampler, evaluate,
    format_agreement, lr_at,
)
from hispec import io as hio  # noqa: E402  (hio.matmul_speed_ratio looked up per call: tests replace it)
from hispec.heads import HEAD_TYPES  # noqa: E402
from hispec.io import DTYPES, atomic_write, parse_dtype, write_json  # noqa: E402
from hispec.layers import DecoderAdapter  # noqa: E402
from hispec.model import EarlyExitModel, default_exits, load_base_model, load_tokenizer, validate_exits  # noqa: E402

__all__ = ["ConfigError", "DataArguments", "GenerationArguments", "ModelArguments", "TrainArguments", "build_parser",
           "main", "parse_args"]

logger = logging.getLogger("hispec.train")

HEADS_FILE = "hispec_heads.safetensors"
TRAIN_INFO_FILE = "hispec_train.json"
METRICS_FILE = "metrics.json"
STATE_FILE = "hispec_state.json"
CHECKPOINTS = "checkpoints"
# Benchmarks this project evaluates on: never training data (design.md §8).
EVAL_ONLY_FILES = ("spec_bench_question.jsonl", "mt_bench_question.jsonl")


# ---------------------------------------------------------------------------------------------------- helpers
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


def warn_if_slow_low_precision(m, d, g, t) -> list[str]:
    """Settings asking for bf16/fp16 on a CPU where that dtype's matmuls are much slower than fp32 (no native
    bf16 instructions): a logged warning each (a 2-core AVX2-only EPYC ran the bf16 feature cache 6x slower than
    fp32). Returns the warnings."""
    if torch.cuda.is_available():
        return []
    asked = {"gen_dtype": g.gen_dtype, "loss_dtype": t.loss_dtype}
    if d.feature_cache:
        asked["feature_cache_backbone_dtype"] = d.feature_cache_backbone_dtype
    ratios: dict = {}  # measured once per dtype
    out = []
    for key, name in asked.items():
        dtype = parse_dtype(name)
        if dtype not in (torch.bfloat16, torch.float16):
            continue
        if dtype not in ratios:
            ratios[dtype] = hio.matmul_speed_ratio(dtype)
        if ratios[dtype] > 2.0:
            out.append(f"{key}={name}: on this CPU ({torch.backends.cpu.get_cpu_capability()}) {name} matmuls run "
                       f"{ratios[dtype]:.0f}x slower than fp32; set {key}: fp32 (bf16 only pays on CPUs with native "
                       "bf16, e.g. AVX-512 BF16 / AMX, and on GPUs)")
    for w in out:
        logger.warning(w)
    return out


def validate_static(m: ModelArguments, d: DataArguments, t: TrainArguments, g=None) -> None:
    """Checks that need no model: raise ConfigError with what to change."""
    if not m.model_name_or_path:
        raise ConfigError("model_name_or_path is required (a Hub id, a local folder or a .gguf file)")
    if m.head_type not in HEAD_TYPES:
        raise ConfigError(f"unknown head type '{m.head_type}'; choose one of {', '.join(TRAINABLE_HEADS)}")
    if m.head_type not in TRAINABLE_HEADS:
        raise ConfigError(
            f"head type '{m.head_type}' has no trainable weights; choose one of {', '.join(TRAINABLE_HEADS)}"
        )
    if m.head_lora_rank < 0 or (m.head_lora_rank and m.head_type != "layer"):
        raise ConfigError(f"head_lora_rank {m.head_lora_rank}: LoRA applies to 'layer' heads only (>= 1; 0 = off)")
    context_ranges(m, t)  # context head settings and distance ranges (ConfigError when unusable)
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
    for f in [*d.train_file, *d.plain_text_file]:
        if Path(f).name in EVAL_ONLY_FILES:
            raise ConfigError(f"{f} is an evaluation benchmark (Spec-Bench / MT-Bench); never train on it")
    try:
        validate_args(d)
    except SelfPromptError as e:
        raise ConfigError(str(e)) from e
    if d.self_prompts and not d.self_distill:
        raise ConfigError("self_prompts are instructions for the model to answer: set self_distill: true")
    if d.self_distill and not (d.train_file or d.dataset_name or d.self_prompts):
        raise ConfigError("self_distill needs prompts: give --train_file, --dataset_name or --self_prompts N")
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
    if d.feature_cache:
        if t.temperature != 1.0:
            raise ConfigError(f"the feature cache stores the teacher at temperature 1; set temperature: 1.0 "
                              f"(got {t.temperature}) or train without feature_cache")
        if d.feature_cache_k < 1:
            raise ConfigError(f"feature_cache_k must be >= 1, got {d.feature_cache_k}")
        if d.feature_cache_dtype not in DTYPES:
            raise ConfigError(f"unknown feature_cache_dtype '{d.feature_cache_dtype}'; choose bf16, fp16 or fp32")
        try:
            parse_dtype(d.feature_cache_backbone_dtype)
        except ValueError as e:
            raise ConfigError(f"feature_cache_backbone_dtype: {e}") from e
        for name in ("feature_cache_shard_tokens", "feature_cache_batch_tokens"):
            if getattr(d, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(d, name)}")
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
    has_run = (out / HEADS_FILE).exists() or (out / CHECKPOINTS).is_dir()
    if has_run and not t.overwrite_output_dir and not t.resume_from_checkpoint:
        raise ConfigError(
            f"output_dir {out} already holds a run; pass --resume_from_checkpoint latest to continue it or "
            "--overwrite_output_dir true to start afresh"
        )
    ckpt = find_checkpoint(out, t.resume_from_checkpoint)  # a named checkpoint must exist
    if (out / HEADS_FILE).exists() and ckpt is None and not t.overwrite_output_dir:
        raise ConfigError(
            f"output_dir {out} holds a finished run and no checkpoint to resume from; pass "
            "--overwrite_output_dir true to train again"
        )


def _num_layers_from_config(path: str, revision: str | None) -> int | None:
    if path.endswith(".gguf"):
        return None  # read from the loaded model instead
    from transformers import AutoConfig

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
    """EarlyExitModel with fresh heads; the base identity records the name given and any merged adapter."""
    ctx = ({"context": context_settings(m), "context_mid": m.context_mid} if m.head_type == "context" else {})
    model = EarlyExitModel.from_base(base, draft, verify, m.head_type, head_rank=m.head_rank, gamma=gamma,
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


def _step_hook(step: int) -> None:
    """Called after every optimizer step (tests replace it to simulate a kill)."""


def _build_split(state, adapter, ds, folder, kwargs, extra, t0):
    """One cache folder: built by this process alone, or shard-wise by all processes and finished by the main."""
    if state.num_processes == 1:
        build_feature_cache(adapter, ds, folder, show_progress=state.is_local_main_process, **kwargs)
        return
    with state.main_process_first():  # the main process checks the folder and writes the plan first
        build_feature_cache(adapter, ds, folder, rank=state.process_index, world_size=state.num_processes,
                            plan_only=True, **kwargs)
    build_feature_cache(adapter, ds, folder, rank=state.process_index, world_size=state.num_processes,
                        show_progress=state.is_local_main_process, **kwargs)
    state.wait_for_everyone()
    if state.is_main_process and not (folder / "manifest.json").is_file():
        write_manifest(folder, extra=extra, build_seconds=time.time() - t0)
    state.wait_for_everyone()


def cache_layers(exits, num_layers: int, m: ModelArguments, d: DataArguments) -> tuple[list[int], list[int]]:
    """(layers the feature cache stores, layers this run reads): the exits, plus the final layer's raw residual
    for context heads (read) or with `feature_cache_final_states` (stored for later context runs)."""
    read = sorted({*exits, *([num_layers] if m.head_type == "context" else [])})
    store = sorted({*read, *([num_layers] if d.feature_cache_final_states else [])})
    return store, read


def check_feature_cache(m: ModelArguments, d: DataArguments, exits, num_layers: int) -> None:
    """Before any work: a feature cache folder that exists but lacks layers this run reads is a ConfigError naming
    what is missing and how to rebuild (a context run on a cache built for linear heads, mostly)."""
    if not d.feature_cache:
        return
    _, read = cache_layers(exits, num_layers, m, d)
    need = (f"context heads read the final layer's raw residual, layer {num_layers}, for verified positions"
            if m.head_type == "context" else "the exit heads' layers")
    root = Path(tdata.expand_path(d.feature_cache))
    for split in ("train", "eval"):
        try:
            check_cache_layers(root / split, read, need)
        except FeatureCacheError as e:
            raise ConfigError(str(e)) from e


def _prepare_feature_cache(state, model, adapter, exits, m, d, g, t, train_ds, eval_ds, pad_id):
    """Build (or resume / reuse) DIR/train and DIR/eval, then -> (train, eval CachedSequences, info for the run)."""
    root = Path(tdata.expand_path(d.feature_cache)).absolute()
    with generation_dtype(model.base, d.feature_cache_backbone_dtype):  # the identity records the dtype used
        identity = model_identity(model.base, m.model_name_or_path)
    # Recorded for people, not compared: the sequences' fingerprint decides whether a cache fits.
    extra = {"data": {k: v for k, v in asdict(d).items() if not k.startswith("feature_cache")},
             "generation": asdict(g), "seed": t.seed}
    store, read = cache_layers(exits, adapter.num_layers, m, d)
    out = {}
    for split, ds in (("train", train_ds), ("eval", eval_ds)):
        if ds is None or len(ds) == 0:
            continue
        folder = root / split
        kwargs = dict(layers=store, k=d.feature_cache_k, identity=identity, hidden_dtype=d.feature_cache_dtype,
                      shard_tokens=d.feature_cache_shard_tokens, batch_tokens=d.feature_cache_batch_tokens,
                      pad_id=pad_id, extra=extra)
        t0 = time.time()
        try:
            with generation_dtype(model.base, d.feature_cache_backbone_dtype):
                _build_split(state, adapter, ds, folder, kwargs, extra, t0)
            out[split] = CachedSequences(folder, layers=read)
        except FeatureCacheError as e:
            raise ConfigError(str(e)) from e
        man = out[split].manifest
        logger.info("feature cache %s: %d sequences, %d tokens (%d in the loss), layers %s, k=%d (%.1fs)", folder,
                    man["num_sequences"], man["num_tokens"], man["num_loss_tokens"], man["layers"], man["k"],
                    time.time() - t0)
    info = {"dir": str(root), "k": d.feature_cache_k, "hidden_dtype": d.feature_cache_dtype,
            "backbone_dtype": identity["dtype"],
            **{f"{s}_tokens": c.manifest["num_tokens"] for s, c in out.items()},
            **{f"{s}_loss_tokens": c.manifest["num_loss_tokens"] for s, c in out.items()}}
    return out["train"], out.get("eval"), info


# ---------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    m, d, g, t = parse_args(argv)
    validate_static(m, d, t, g)
    warn_if_slow_low_precision(m, d, g, t)
    output_dir = Path(os.path.expanduser(t.output_dir)).absolute()

    from accelerate import Accelerator, DataLoaderConfiguration, PartialState
    from accelerate.utils import InitProcessGroupKwargs, set_seed
    from datasets import concatenate_datasets

    report_to = [r.strip() for r in t.report_to.split(",") if r.strip() and r.strip() != "none"]
    # CPU processes talk through gloo (design.md §6: without it each rank may believe it is rank 0 of 1); a
    # plain single process must not get a backend, or accelerate would try to start a process group.
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    launched = "WORLD_SIZE" in os.environ or deepspeed
    gloo = launched and not torch.cuda.is_available()
    # `accelerate launch --multi_gpu` sets ACCELERATE_USE_CPU=False in the workers: without cpu=True accelerate
    # gives several CPU processes DistributedType.NO, so barriers, gathers and DDP's gradient sync silently do
    # nothing (each rank trains its own heads). DeepSpeed brings its own CPU path and must not get cpu=True.
    multi_cpu = {"cpu": True} if gloo and not deepspeed else {}
    # The process group comes first; the Accelerator (and with it DeepSpeed's ZeRO-3 hook into from_pretrained,
    # which would shard the frozen backbone) only after the backbone is loaded. Ranks wait at barriers while the
    # main process writes self-written prompts or a cache plan: far longer than gloo's default 30 min timeout.

    long_wait = {"timeout": timedelta(hours=12)} if multi_cpu else {}
    state = PartialState(**({"backend": "gloo", **multi_cpu, **long_wait} if gloo else {}))
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not state.is_main_process:
        logger.setLevel(logging.WARNING)
        import datasets

        datasets.disable_progress_bars()
    set_seed(t.seed)

    # ---- everything that can fail does so here, before any training
    model_path = tdata.expand_path(m.model_name_or_path)
    n_layers = _num_layers_from_config(model_path, m.revision)
    if n_layers is not None:
        draft, verify = resolve_exits(m, n_layers)
        check_feature_cache(m, d, (draft, verify), n_layers)
    tokenizer = load_tokenizer(model_path, revision=m.revision)
    if tokenizer is None:
        raise ConfigError(f"no tokenizer found for {m.model_name_or_path}; training needs one to read text")
    with state.main_process_first():
        try:
            train_rows, eval_rows = tdata.load_examples(d, t.seed, require_train=False)
            plain_rows = tdata.load_plain_text(d, t.seed)
        except tdata.DataError as e:
            raise ConfigError(str(e)) from e
    resume_dir = find_checkpoint(output_dir, t.resume_from_checkpoint)
    if state.is_main_process and t.overwrite_output_dir and not resume_dir:
        for p in (output_dir / CHECKPOINTS, output_dir / HEADS_FILE, output_dir / METRICS_FILE):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    state.wait_for_everyone()

    t0 = time.time()
    base = load_base(m)
    if n_layers is None:  # GGUF: the depth is known once loaded

        n_layers = DecoderAdapter(base).num_layers
        draft, verify = resolve_exits(m, n_layers)
        check_feature_cache(m, d, (draft, verify), n_layers)
    set_seed(t.seed)
    model = wrap_model(base, m, draft, verify, t.gamma, t.window)
    model.base.to(state.device)
    adapter = model.adapter
    exits = (draft, verify)
    logger.info("loaded %s (%d layers) in %.1fs; exits draft=%d verify=%d, head=%s", m.model_name_or_path,
                n_layers, time.time() - t0, draft, verify, m.head_type)

    sources = {"file_prompts": len(train_rows) if train_rows is not None else 0,
               "plain_text_rows": len(plain_rows) if plain_rows is not None else 0}

    # ---- self-written prompts (resumable; written by the main process, read by all)
    if d.self_prompts:
        from datasets import Dataset

        sp_dir = Path(tdata.expand_path(d.self_prompts_dir)) if d.self_prompts_dir else output_dir / "self_prompts"
        t0 = time.time()
        with state.main_process_first():
            try:
                written = ensure_self_prompts(model.base, tokenizer, d.self_prompts, sp_dir, d, seed=t.seed,
                                              gen_dtype=g.gen_dtype, show_progress=state.is_local_main_process)
            except SelfPromptError as e:
                raise ConfigError(str(e)) from e
        logger.info("self-written prompts: %d in %s (%.1fs)", len(written), sp_dir, time.time() - t0)
        sp_ds = Dataset.from_list([{"messages": p["messages"], "text": ""} for p in written])
        if train_rows is None and eval_rows is None and d.eval_fraction > 0 and len(sp_ds) > 1:
            n_eval = max(1, int(round(d.eval_fraction * len(sp_ds))))
            n_eval = min(n_eval, d.max_eval_samples or n_eval, len(sp_ds) - 1)
            eval_rows, sp_ds = sp_ds.select(range(n_eval)), sp_ds.select(range(n_eval, len(sp_ds)))
        train_rows = sp_ds if train_rows is None else concatenate_datasets([train_rows, sp_ds])
        sources["self_prompts"] = len(written)

    # ---- self-distillation: the model answers the prompts itself (resumable, sharded over processes)
    if d.self_distill:
        sd_dir = Path(tdata.expand_path(d.self_distill_dir)) if d.self_distill_dir else output_dir / "self_distill"
        prompts = prompts_from(train_rows) + (prompts_from(eval_rows) if eval_rows is not None else [])
        t0 = time.time()
        n_new = generate_responses(model.base, tokenizer, prompts, sd_dir, g, rank=state.process_index,
                                   world_size=state.num_processes, seed=t.seed,
                                   show_progress=state.is_local_main_process)
        state.wait_for_everyone()
        answers = read_responses(sd_dir)
        logger.info("self-distillation: %d new answers in %.1fs, %d total", n_new, time.time() - t0, len(answers))

        def with_answers(ds):
            from datasets import Dataset

            rows = []
            for p in prompts_from(ds):
                if p["id"] in answers:
                    rows.append({"messages": answers[p["id"]]["messages"], "text": ""})
            return Dataset.from_list(rows) if rows else None

        train_rows = with_answers(train_rows)
        eval_rows = with_answers(eval_rows) if eval_rows is not None else None
        if train_rows is None:
            raise ConfigError("self-distillation produced no answers for the training prompts")
        sources["answers"] = len(train_rows)
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
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    collate = tdata.PadCollator(pad_id)
    cached = bool(d.feature_cache)
    cache_info = None
    if cached:
        train_ds, eval_ds, cache_info = _prepare_feature_cache(state, model, adapter, exits, m, d, g, t, train_ds,
                                                               eval_ds, pad_id)

        collate = CachedCollator()
    if t.data_only:
        summary = {"data_only": True, "train_sequences": len(train_ds),
                   "eval_sequences": len(eval_ds) if eval_ds is not None else 0, "sources": sources,
                   "feature_cache": cache_info}
        logger.info("data ready: %s", summary)
        if state.is_main_process:
            print(json.dumps(summary))
        return 0
    sampler = tdata.EpochSampler(len(train_ds), t.seed)
    train_dl = DataLoader(train_ds, batch_size=t.per_device_train_batch_size, sampler=sampler, collate_fn=collate)
    eval_dl = (DataLoader(eval_ds, batch_size=t.per_device_eval_batch_size, sampler=SequentialSampler(eval_ds),
                          collate_fn=collate) if eval_ds is not None and len(eval_ds) else None)

    # ---- heads, optimizer, accelerate
    accelerator = Accelerator(
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        log_with=report_to or None,
        project_dir=str(output_dir),
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if gloo else [],
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=False),
        **multi_cpu,
    )
    heads = HeadsForTraining(model.heads.float(), adapter)
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    if eval_dl is not None:
        heads, optimizer, train_dl, eval_dl = accelerator.prepare(heads, optimizer, train_dl, eval_dl)
    else:
        heads, optimizer, train_dl = accelerator.prepare(heads, optimizer, train_dl)
    param_dtype = next(accelerator.unwrap_model(heads).parameters()).dtype

    steps_per_epoch = max(1, math.ceil(len(train_dl) / t.gradient_accumulation_steps))
    total_steps = t.max_steps if t.max_steps > 0 else steps_per_epoch * t.num_train_epochs
    num_epochs = math.ceil(total_steps / steps_per_epoch)

    ranges = context_ranges(m, t)
    ctx_info = None if ranges is None else {"settings": context_settings(m), "mid": m.context_mid,
                                            "ranges": {k: list(v) if v else None for k, v in ranges.items()},
                                            "layers": model.hispec_config.context_layers}
    completed, history, prior_seconds = 0, [], 0.0
    if resume_dir is not None:
        state = json.loads((resume_dir / STATE_FILE).read_text())
        now = {"draft_layer": draft, "verify_layer": verify, "head_type": m.head_type, "context": ctx_info}
        for key in ("draft_layer", "verify_layer", "head_type", "context"):
            if state["run"].get(key) != now[key]:
                raise ConfigError(f"checkpoint {resume_dir} was trained with {key}={state['run'].get(key)!r}, this "
                                  f"run asks for {now[key]!r}; resume with the same configuration")
        accelerator.load_state(str(resume_dir))
        completed, history = int(state["step"]), list(state.get("history", []))
        prior_seconds = float(state.get("train_seconds", 0.0))
        logger.info("resumed from %s at step %d", resume_dir, completed)

    run_info = {"draft_layer": draft, "verify_layer": verify, "head_type": m.head_type, "context": ctx_info,
                "train_examples": len(train_ds), "eval_examples": len(eval_ds) if eval_ds is not None else 0,
                "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
                "world_size": accelerator.num_processes, "sources": sources, "feature_cache": cache_info}
    config_dump = {**asdict(m), **asdict(d), **asdict(g), **asdict(t)}
    if report_to:
        accelerator.init_trackers("hispec-heads", config={k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                                                          for k, v in config_dump.items()})
    logger.info("training: %d sequences, %d steps/epoch, %d steps, %d process(es)", len(train_ds), steps_per_epoch,
                total_steps, accelerator.num_processes)

    def run_eval(step, final=False):
        if eval_dl is None:
            return None
        res = evaluate(accelerator, heads, adapter, eval_dl, exits, t, param_dtype, cached=cached, ranges=ranges,
                       by_distance=final)
        res["step"] = step
        history.append(res)
        accelerator.log({f"eval/{k}_agreement": res[k]["top1_agreement"] for k in ("draft", "verify", "draft_verify")},
                        step=step)
        logger.info("eval @%d: agreement draft %.3f verify %.3f draft-verify %.3f", step,
                    res["draft"]["top1_agreement"], res["verify"]["top1_agreement"],
                    res["draft_verify"]["top1_agreement"])
        return res

    def save_checkpoint(step):
        final = output_dir / CHECKPOINTS / f"step_{step}"
        tmp = output_dir / CHECKPOINTS / f".tmp_step_{step}"
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_json(tmp / STATE_FILE, {"step": step, "history": history, "run": run_info,
                                                  "train_seconds": prior_seconds + time.time() - t_train})
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            if t.save_total_limit:
                for old in _complete_checkpoints(output_dir)[: -t.save_total_limit]:
                    shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()

    if completed == 0 and t.eval_at_start:
        run_eval(0)

    # ---- the loop
    loss_fn = _loss_fn(adapter, exits, t, param_dtype, cached)
    bar = tqdm(total=total_steps, initial=completed, desc="training heads",
               disable=not accelerator.is_local_main_process)
    heads.train()
    window_stats: dict[str, float] = {}
    window_n = 0
    t_train = time.time()
    micro = 0  # micro-batch within the optimizer step (seeds the context heads' distance draws)
    start_epoch = completed // steps_per_epoch
    for epoch in range(start_epoch, num_epochs):
        if completed >= total_steps:
            break
        train_dl.set_epoch(epoch)
        skip = (completed - epoch * steps_per_epoch) * t.gradient_accumulation_steps
        loader = accelerator.skip_first_batches(train_dl, skip) if skip > 0 else train_dl
        if skip > 0:
            loader.set_epoch(epoch)
        for batch in loader:
            dist = None
            if ranges:  # fresh frontier distances per position and step, as decoding produces them
                gen = torch.Generator().manual_seed(_distance_seed(t.seed, completed, micro,
                                                                   accelerator.process_index))
                dist = distance_sampler(ranges, gen)
            with accelerator.accumulate(heads):
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(completed, total_steps, t)
                out, _, _ = loss_fn(batch, heads, dist=dist)
                accelerator.backward(out.loss)
                if accelerator.sync_gradients and t.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(params, t.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            stats = {"loss": out.loss.item(), **{f"kl/{k}": v.item() for k, v in out.kl.items()},
                     **{f"agreement/{k}": v.item() for k, v in out.agree.items()}}
            for k, v in stats.items():
                window_stats[k] = window_stats.get(k, 0.0) + v
            window_n += 1
            micro += 1
            if not accelerator.sync_gradients:
                continue
            micro = 0
            completed += 1
            bar.update(1)
            if completed % t.logging_steps == 0 or completed == total_steps:
                logs = {k: v / window_n for k, v in window_stats.items()}
                logs["lr"] = lr_at(completed - 1, total_steps, t)
                accelerator.log(logs, step=completed)
                bar.set_postfix(loss=f"{logs['loss']:.3f}", d=f"{logs['agreement/draft']:.2f}",
                                v=f"{logs['agreement/verify']:.2f}")
                window_stats, window_n = {}, 0
            if t.eval_steps and completed % t.eval_steps == 0 and completed < total_steps:
                run_eval(completed)
            if t.checkpointing_steps and completed % t.checkpointing_steps == 0 and completed < total_steps:
                save_checkpoint(completed)
            _step_hook(completed)
            if completed >= total_steps:
                break
    bar.close()
    train_seconds = prior_seconds + time.time() - t_train  # across resumes

    # ---- final evaluation and outputs (each file written to a temporary name, then renamed)
    final = run_eval(completed, final=True)
    state = accelerator.get_state_dict(heads)
    if accelerator.is_main_process:
        prefix = "heads."
        heads_state = {k[len(prefix):] if k.startswith(prefix) else k: v.detach().float().cpu().contiguous()
                       for k, v in state.items()}
        output_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(output_dir / HEADS_FILE,
                     lambda p: save_file(heads_state, str(p), metadata={"format": "pt", "hispec": "1"}))
        info = {
            "hispec": model.hispec_config.to_dict(),
            "base": model.hispec_config.base,
            "heads_file": HEADS_FILE,
            "heads_dtype": "float32",
            "steps": completed,
            "train_seconds": round(train_seconds, 1),
            "data": run_info,
            "args": config_dump,
        }
        write_json(output_dir / TRAIN_INFO_FILE, info)
        write_json(output_dir / METRICS_FILE, {"final": final, "history": history,
                                               "steps": completed, "train_seconds": round(train_seconds, 1)})
        if final is not None:
            print("held-out agreement with the final layer's argmax (" + METRICS_FILE + "):\n"
                  + format_agreement(final))
            line = {"steps": completed, "draft_agreement": final["draft"]["top1_agreement"],
                    "verify_agreement": final["verify"]["top1_agreement"],
                    "draft_top5": final["draft"]["top5_agreement"], "verify_top5": final["verify"]["top5_agreement"],
                    "train_seconds": round(train_seconds, 1)}
            for k in ("draft", "verify"):
                if "by_distance" in final[k]:
                    line[f"{k}_agreement_by_distance"] = {d: round(v["top1_agreement"], 4)
                                                          for d, v in final[k]["by_distance"].items()}
            print(json.dumps(line))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
