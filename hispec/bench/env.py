"""What a benchmark ran on: `hardware_info()` (CPU as `hispec.latency.cpu_model` names it, threads, torch /
transformers versions, GPU) and `model_info(model)` (the checkpoint's exits, head type and decoding settings)."""

from __future__ import annotations

import os
import platform

import torch

from .. import packed
from ..latency import cpu_model


# ---------------------------------------------------------------------------------------------------- environment
def hardware_info() -> dict:
    import transformers

    info = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def model_info(model) -> dict:
    h = model.hispec_config
    return {"name_or_path": h.base.get("name_or_path") or getattr(model.base.config, "_name_or_path", ""),
            "num_layers": model.num_layers, "draft_layer": h.draft_layer, "verify_layer": h.verify_layer,
            "head_type": h.head_type, "gamma": h.gamma, "window": h.window,
            "draft_vocab_size": h.draft_vocab_size, "verify_vocab_size": h.verify_vocab_size,
            "dtype": str(model.dtype).replace("torch.", ""), "linear": packed.kind(model.base),
            "packed_time_ratio": {str(t): r for t, r in (packed.measured_ratio(model.base) or {}).items()} or None}
