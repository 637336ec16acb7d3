"""Turn a training run's output into a hispec checkpoint folder (design.md §5), with a model card, and push it.

Contract (the run folder itself is read by `hispec.export.run.read_train_output`):
- `build_model(run, base=None, dtype=None)` loads the recorded base (or `base`: a folder, Hub id or .gguf), refuses
  one that does not fit the heads (depth, hidden size, vocabulary, architecture), and loads the heads. LoRA keys in
  the heads file (peft layout, `<module>.lora_A[.<adapter>].weight`) are merged with peft `merge_and_unload` first,
  so the checkpoint always holds plain head weights; today's head types never produce them, a LoRA-trained head
  type only needs its `lora_alpha` recorded in the run's args (or the heads file's metadata).
- `export(...)` writes the folder atomically: everything, README.md included, goes into a temporary sibling that
  is renamed into place at the end, so an interrupted export never leaves a folder under the final name.
- `push_to_hub(folder, repo_id, ...)` uploads a finished folder (create_repo + upload_folder); any Hub or network
  failure raises `HubPushError` and never touches the local folder.
The model card (README.md: `render_model_card`, `base_license`, `origin_hub_id`, ...) is written by
`hispec.export.model_card`. Nothing here contacts the Hub unless the base is a Hub id or a push is asked for.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from ..io import atomic_dir, write_json, write_text
from ..latency import DEFAULT_MAX_SECONDS, calibrate, predictions, write_calibration
from ..model import (TRAIN_FILE, CheckpointError, EarlyExitModel, HispecConfig, base_identity, check_base_matches,
                     load, load_base_model, load_tokenizer)
from ..sampling import VERIFICATIONS
from ..vocab import vocab_for_model
from .model_card import (CARD_FILE, base_license, default_hierarchies, render_model_card, resolve_base_model,
                         write_model_card)
from .run import ExportError, TrainRun, read_train_output

DEFAULT_MAX_SHARD_SIZE = "5GB"
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


class HubPushError(RuntimeError):
    """Uploading to the Hugging Face Hub failed; the local export is left as it was."""


def _log(msg: str) -> None:
    print(f"[hispec-export] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- heads
def _read_heads_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Key -> shape and the metadata of a safetensors file, without loading tensors; a clear error if unreadable."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"could not read heads file {path}: {e} (truncated or corrupt?)") from e


def _check_heads_fit(path: Path, shapes: dict[str, tuple[int, ...]], model: EarlyExitModel) -> None:
    expected = {k: tuple(v.shape) for k, v in model.heads.state_dict().items()}
    problems = [f"missing {k}" for k in sorted(expected.keys() - shapes.keys())]
    problems += [f"unexpected {k}" for k in sorted(shapes.keys() - expected.keys())]
    problems += [
        f"{k}: file has {list(shapes[k])}, heads need {list(expected[k])}"
        for k in sorted(expected.keys() & shapes.keys())
        if shapes[k] != expected[k]
    ]
    if problems:
        cfg = model.hispec_config
        raise CheckpointError(
            f"heads file {path} does not fit '{cfg.head_type}' heads on a {model.num_layers}-layer, "
            f"hidden-size-{model.adapter.hidden_size} model: " + "; ".join(problems[:8])
            + (f"; ... ({len(problems)} problems)" if len(problems) > 8 else "")
        )


def _lora_targets(keys) -> dict[str, str | None]:
    """Module name -> adapter name (None in peft's saved-adapter layout) for every LoRA pair in `keys`."""
    targets = {}
    for k in keys:
        m = _LORA_KEY.match(k)
        if m:
            targets[m["module"]] = m["adapter"]
    return targets


def merge_lora_heads(model: EarlyExitModel, state: dict[str, torch.Tensor], lora_alpha: float) -> None:
    """Load a heads state dict holding peft LoRA weights into `model.heads` and merge them (peft merge_and_unload).

    Accepts both layouts: the wrapped module's own state dict (`X.base_layer.weight`, `X.lora_A.default.weight`)
    and peft's adapter layout (`X.weight`, `X.lora_A.weight`). Afterwards `model.heads` holds plain weights.
    """
    from peft import LoraConfig
    from peft.tuners.lora import LoraModel

    targets = _lora_targets(state)
    adapters = {a for a in targets.values() if a is not None}
    if len(adapters) > 1:
        raise CheckpointError(f"heads hold several LoRA adapters ({sorted(adapters)}); export one at a time")
    adapter = adapters.pop() if adapters else "default"
    ranks = {state[f"{m}.lora_A{'.' + a if a else ''}.weight"].shape[0] for m, a in targets.items()}
    if len(ranks) != 1:
        raise CheckpointError(f"LoRA heads with mixed ranks {sorted(ranks)} are not supported")
    normalized = {}
    for k, v in state.items():
        m = _LORA_KEY.match(k)
        if m:
            k = f"{m['module']}.lora_{m['ab']}.{adapter}.weight"
        else:
            module, _, leaf = k.rpartition(".")
            if module in targets and leaf in ("weight", "bias"):
                k = f"{module}.base_layer.{leaf}"
        normalized[k] = v
    dtype = model.dtype
    model.heads.float()  # merge in fp32, then back to the base's dtype
    config = LoraConfig(r=ranks.pop(), lora_alpha=lora_alpha, target_modules=sorted(targets))
    wrapped = LoraModel(model.heads, config, adapter)
    try:
        model.heads.load_state_dict({k: v.float() for k, v in normalized.items()}, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"LoRA heads do not fit these heads: {e}") from e
    model.heads = wrapped.merge_and_unload().to(dtype)


def load_heads_checked(model: EarlyExitModel, path: str | os.PathLike, lora_alpha: float | None = None) -> None:
    """`model.load_heads(path)` after checking keys and shapes (clear errors); LoRA heads are merged first."""
    path = Path(path)
    shapes, metadata = _read_heads_header(path)
    if not _lora_targets(shapes):
        _check_heads_fit(path, shapes, model)
        model.load_heads(path)
        return
    if lora_alpha is None and "lora_alpha" in metadata:
        lora_alpha = float(metadata["lora_alpha"])
    if lora_alpha is None:
        raise CheckpointError(
            f"heads file {path} holds LoRA weights but the run records no lora_alpha (args.lora_alpha in "
            f"{TRAIN_FILE} or 'lora_alpha' in the file's metadata); it is needed to merge them"
        )
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"could not read heads file {path}: {e} (truncated or corrupt?)") from e
    merge_lora_heads(model, state, lora_alpha)


# ---------------------------------------------------------------------------------------------- model
def build_model(run: TrainRun, base: str | None = None, *, base_revision: str | None = None,
                dtype=None) -> EarlyExitModel:
    """Base (recorded by the run, or `base`) + the run's heads, checked against each other."""
    recorded = run.recorded_base
    source = str(base) if base else recorded.get("name_or_path")
    revision = base_revision if (base or base_revision) else recorded.get("revision")
    if not source:
        raise ExportError(f"{run.folder / TRAIN_FILE} records no base model name; pass --base")
    expanded = os.path.expanduser(os.path.expandvars(source))  # recipes record paths like ~/.cache/...
    if Path(expanded).exists():
        source = expanded
    if Path(source).exists():  # a local folder / .gguf: record it so the checkpoint works from any directory
        source = str(Path(source).absolute())
    hconf = HispecConfig.from_dict(run.hispec)
    _log(f"loading base {source}" + (f"@{revision}" if revision else ""))
    model = load_base_model(source, dtype=dtype, revision=revision)
    check_base_matches(recorded, model, where=f"heads in {run.folder}")
    hconf.base = {**recorded, **base_identity(model, revision), "name_or_path": source}
    tokenizer = load_tokenizer(source, revision)
    ee = EarlyExitModel(model, hconf, tokenizer=tokenizer)
    lora_alpha = run.args.get("lora_alpha")
    load_heads_checked(ee, run.heads_file, None if lora_alpha is None else float(lora_alpha))
    return ee


# ---------------------------------------------------------------------------------------------- export
@dataclass
class ExportResult:
    output_dir: Path
    files: list[tuple[str, int]]  # (path relative to output_dir, bytes), sorted
    heads_only: bool
    calibration: object = None  # hispec.latency.Calibration when the export calibrated the checkpoint
    predictions: list = field(default_factory=list)  # hispec.latency.predictions rows for it

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def list_files(folder: Path) -> list[tuple[str, int]]:
    return sorted((p.relative_to(folder).as_posix(), p.stat().st_size) for p in folder.rglob("*") if p.is_file())


def export(
    train_dir: str | os.PathLike,
    output_dir: str | os.PathLike,
    *,
    base: str | None = None,
    base_revision: str | None = None,
    dtype=None,
    heads_only: bool = False,
    overwrite: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    base_model_id: str | None = None,
    license: str | None = None,
    name: str | None = None,
    draft_vocab_size: int | None = None,
    verify_vocab_size: int | None = None,
    vocab_data: list[str] | tuple = (),
    gamma: int | None = None,
    window: int | None = None,
    verification: str | None = None,
    calibration_prompts: list | None = None,
    calibration_max_new_tokens: int = 64,
    calibration_dtype=None,
    calibration_max_seconds: float | None = DEFAULT_MAX_SECONDS,
    progress: bool = False,
    drafter: str | os.PathLike | None = None,
) -> ExportResult:
    """Training output -> checkpoint folder (atomic). `name` is what the model card tells users to load.

    `drafter`: an EAGLE-3 drafter run (train/heads.py --head_type eagle3) for the same base; its files
    (`hispec_drafter.*`) go into the checkpoint, which then also decodes with the `eagle3` level (`eagle`).

    `draft_vocab_size` / `verify_vocab_size` (0 = full) restrict a head's output vocabulary (hispec.vocab): the
    most frequent tokens of `vocab_data` files, by default of the run's self-distilled answers when it kept them,
    else by token id order. `gamma` / `window` / `verification` ("token" | "hsd") replace the decoding defaults
    recorded by the run.

    With `calibration_prompts` (texts, `hispec.prompts.Prompt`s or token id lists), the finished checkpoint is then
    loaded (in `calibration_dtype`, default as stored) and calibrated on this machine (`hispec.latency.calibrate`,
    within `calibration_max_seconds`, None: no limit); the calibration goes into its config.json and the model card
    states the predicted speeds. A failure there leaves the exported checkpoint valid, without a calibration.
    """
    check_options(gamma=gamma, window=window, verification=verification)
    out = Path(output_dir).absolute()
    train_dir = Path(train_dir).absolute()
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists; pass --overwrite to replace it")
    run = read_train_output(train_dir)
    for protected in (train_dir, base, run.recorded_base.get("name_or_path")):
        if protected and Path(protected).exists() and Path(protected).absolute().resolve() == out.resolve():
            raise ExportError(f"--output-dir {out} is an input of this export; choose another folder")
    model = build_model(run, base, base_revision=base_revision, dtype=dtype)
    if drafter is not None:
        model.attach_drafter(drafter)  # checks it fits this base before anything is written
    apply_options(model, run, gamma=gamma, window=window, verification=verification,
                  draft_vocab_size=draft_vocab_size, verify_vocab_size=verify_vocab_size, vocab_data=vocab_data)
    source = model.hispec_config.base["name_or_path"]
    card_base_model = resolve_base_model(run, model, base_model_id)
    card_license = license or base_license(source, model.hispec_config.base.get("revision"))
    card = render_model_card(run, model, name=name or out.name, base_model=card_base_model, license=card_license,
                             heads_only=heads_only)
    _log(f"writing {'heads-only ' if heads_only else ''}checkpoint to {out}")
    with atomic_dir(out, overwrite=overwrite) as tmp:
        model.write_into(tmp, heads_only=heads_only, max_shard_size=max_shard_size)
        if drafter is not None:
            from ..drafters.eagle3 import DRAFTER_CONFIG, DRAFTER_FILE

            for f in (DRAFTER_FILE, DRAFTER_CONFIG):
                shutil.copyfile(Path(drafter) / f, tmp / f)
        write_model_card(tmp, card)
    result = ExportResult(output_dir=out, files=list_files(out), heads_only=heads_only)
    if calibration_prompts:
        del model  # the checkpoint is calibrated as users load it
        try:
            result.calibration, result.predictions = calibrate_checkpoint(
                out, calibration_prompts, max_new_tokens=calibration_max_new_tokens, dtype=calibration_dtype,
                max_seconds=calibration_max_seconds, progress=progress,
                card=dict(run=run, name=name or out.name, base_model=card_base_model, license=card_license,
                          heads_only=heads_only))
        except (ValueError, OSError, RuntimeError) as e:
            raise ExportError(f"the checkpoint {out} was exported, but calibrating it failed: {e}; it is usable "
                              "without a calibration (decoding then defaults to plain)") from e
        result.files = list_files(out)
    return result


def check_options(*, gamma=None, window=None, verification=None) -> None:
    """Export's decoding options, checked before any work (also tools/pack_artifact.py's)."""
    for flag, v in (("gamma", gamma), ("window", window)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ExportError(f"--{flag} must be an integer >= 1, got {v!r}")
    if verification is not None and verification not in VERIFICATIONS:
        raise ExportError(f"--verification must be one of {', '.join(VERIFICATIONS)}, got {verification!r}")


def apply_options(model: EarlyExitModel, run: TrainRun, *, gamma=None, window=None, verification=None,
                  draft_vocab_size=None, verify_vocab_size=None, vocab_data=()) -> None:
    """Write export's options into the model: decoding defaults (None keeps the run's) and reduced vocabularies."""
    if gamma is not None:
        model.hispec_config.gamma = gamma
    if window is not None:
        model.hispec_config.window = window
    if verification is not None:
        model.hispec_config.verification = verification
    if draft_vocab_size is not None or verify_vocab_size is not None:
        restrict_vocab(model, run, draft_vocab_size, verify_vocab_size, vocab_data)


def calibrate_checkpoint(folder: str | os.PathLike, prompts, *, max_new_tokens: int = 64, dtype=None,
                         max_seconds: float | None = DEFAULT_MAX_SECONDS, progress: bool = False,
                         card: dict | None = None):
    """Load the checkpoint `folder`, calibrate the latency model on `prompts` on this machine, store it in
    config.json (atomically) and, given the model card's inputs (`card`: run, name, base_model, license,
    heads_only), rewrite README.md with the predicted speeds. Returns (calibration, prediction rows)."""
    folder = Path(folder)
    _log(f"calibrating the latency model on {len(prompts)} prompts (greedy answers of up to {max_new_tokens} "
         f"tokens, then unit costs)")
    model = load(folder, dtype=dtype)
    cal = calibrate(model, prompts, max_new_tokens=max_new_tokens, progress=progress, max_seconds=max_seconds)
    if (cal.budget or {}).get("skipped"):
        _log(f"the calibration's time budget ({max_seconds:g} s) left out {cal.budget['skipped']}")
    write_calibration(folder, cal)
    if card is not None:
        text = render_model_card(card["run"], model, name=card["name"], base_model=card["base_model"],
                                 license=card["license"], heads_only=card["heads_only"], calibration=cal)
        write_text(folder / CARD_FILE, text)
    return cal, predictions(cal, fixed=default_hierarchies(model))


def default_vocab_data(run: TrainRun) -> list[Path]:
    """The run's self-distilled answers (the model's own outputs), when the run folder kept them."""
    folders = [run.folder / "self_distill"]
    if run.args.get("self_distill_dir"):
        folders.insert(0, Path(os.path.expandvars(str(run.args["self_distill_dir"]))).expanduser())
    for folder in folders:
        files = sorted(folder.glob("*.jsonl")) if folder.is_dir() else []
        if files:
            return files
    return []


def restrict_vocab(model: EarlyExitModel, run: TrainRun, draft_size: int | None, verify_size: int | None,
                   files=()) -> None:
    files = [Path(f) for f in files] or default_vocab_data(run)
    for f in files:
        if not Path(os.path.expandvars(str(f))).expanduser().is_file():
            raise ExportError(f"--vocab-data file not found: {f}")
    for exit_name, size in (("draft", draft_size), ("verify", verify_size)):
        if size is None:
            continue
        if size == 0:
            model.set_exit_vocab(exit_name, None)
            continue
        if not 1 <= size <= model.adapter.vocab_size:
            raise ExportError(f"--{exit_name}-vocab-size {size} must be within 1..{model.adapter.vocab_size} (0: full)")
        model.set_exit_vocab(exit_name, vocab_for_model(model, size, files))
        _log(f"{exit_name} head: {size} tokens, counted on " + (", ".join(str(f) for f in files) if files
                                                                else "nothing (token id order)"))


# ---------------------------------------------------------------------------------------------- hub
def hub_api(endpoint: str | None = None):
    """The Hub client; token from $HF_TOKEN or `hf auth login`. Tests replace this function."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint)


def hub_token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def push_to_hub(folder: str | os.PathLike, repo_id: str, *, private: bool | None = None,
                revision: str | None = None, create_pr: bool = False, commit_message: str | None = None,
                api=None) -> str:
    """Upload `folder` to model repo `repo_id` (created if missing); returns the commit or PR URL.

    `revision` is the branch to push to (created from main if missing); with `create_pr` a pull request is opened
    against it instead. Any Hub or network failure raises `HubPushError`; the local folder is never modified.
    """
    from huggingface_hub.errors import HTTPError

    folder = Path(folder)
    api = api if api is not None else hub_api()
    message = commit_message or f"Upload hispec early-exit checkpoint ({folder.name})"
    step = "create the repository"
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        if revision and not create_pr:
            step = f"create branch '{revision}'"
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        step = "upload the files"
        info = api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model", revision=revision,
                                 commit_message=message, create_pr=create_pr or None)
    except (OSError, HTTPError, ValueError) as e:  # HfHubHTTPError is an OSError; connection errors are HTTPError
        raise HubPushError(
            f"could not push to the Hub repo '{repo_id}' (failed to {step}): {type(e).__name__}: {e}\n"
            f"The local export at {folder} is intact; retry later, or upload it with `hf upload {repo_id} {folder}`"
        ) from e
    return getattr(info, "pr_url", None) or getattr(info, "commit_url", None) or str(info)




def write_decoding_defaults(folder: str | os.PathLike, setting, *, write_exits: bool = False) -> dict:
    """Store gamma/window (and, when `write_exits`, the exits) in config.json's hispec entry, atomically.

    `setting`: anything with `gamma`, `window`, `draft_layer`, `verify_layer` (a `hispec.bench.sweep.Setting`, the
    sweep's best)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: --write-defaults needs a local hispec checkpoint folder")
    cfg = json.loads(path.read_text(encoding="utf-8"))
    if "hispec" not in cfg:
        raise ValueError(f"{path} has no 'hispec' entry: --write-defaults needs a hispec checkpoint, not a base model")
    hc = HispecConfig.from_dict(cfg["hispec"])  # read any format, write the current one (other keys kept)
    hc.gamma = setting.gamma
    if setting.window is not None:
        hc.window = setting.window
    if write_exits:
        hc.draft_layer, hc.verify_layer = setting.draft_layer, setting.verify_layer or hc.verify_layer
    h = {**cfg["hispec"], **hc.to_dict()}
    cfg["hispec"] = h
    write_json(path, cfg)
    return h
