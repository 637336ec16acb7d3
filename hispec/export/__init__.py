"""From a training run to a checkpoint users load: `hispec-export`'s library (design.md §5).

- `run`: a training run's output folder (`TrainRun`, `read_train_output`, `ExportError`); the lowest module here.
- `model_card`: the checkpoint's README.md and the facts it states about the base model (reads runs, never writes).
- `checkpoint`: base + heads (LoRA merged) checked against each other, written atomically with the card, the
  calibration and the decoding defaults; `push_to_hub`.
- `speculators`: an EAGLE-3 drafter run as a `speculators` folder that vLLM and SGLang load as it is (§5.1);
  imported on its own (`from hispec.export.speculators import export_speculators`).

`from hispec.export import X` reaches the names of `run`, `model_card` and `checkpoint`.
"""

from ..model import HEADS_FILE, TRAIN_FILE
from .checkpoint import (ExportResult, HubPushError, apply_options, build_model,
                         calibrate_checkpoint, check_options, default_vocab_data, export, hub_api, hub_token,
                         list_files, load_heads_checked, merge_lora_heads, push_to_hub, restrict_vocab,
                         write_decoding_defaults)
from .model_card import (CARD_FILE, CARD_TAGS, ORIGIN_FILES, base_license, default_hierarchies, origin_hub_id,
                         render_model_card, resolve_base_model, write_model_card)
from .run import ExportError, TrainRun, read_train_output

__all__ = [
    "CARD_FILE", "CARD_TAGS", "HEADS_FILE", "ORIGIN_FILES", "TRAIN_FILE", "ExportError", "ExportResult",
    "HubPushError", "TrainRun", "apply_options", "base_license", "build_model", "calibrate_checkpoint",
    "check_options", "default_hierarchies", "default_vocab_data", "export", "hub_api", "hub_token", "list_files",
    "load_heads_checked", "merge_lora_heads", "origin_hub_id", "push_to_hub", "read_train_output",
    "render_model_card", "resolve_base_model", "restrict_vocab", "write_decoding_defaults", "write_model_card",
]
