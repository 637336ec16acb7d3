"""Which precision pays on this machine, said before a training run loads anything (`train/heads.py`).

`warn_if_slow_low_precision(m, d, g, t)`: bf16 / fp16 settings (generation, loss, feature-cache backbone, and
accelerate's mixed precision from the launcher's environment) on a CPU where that dtype's matmuls are much slower
than fp32 get a logged warning each (returned); an fp32 run on a CPU whose bf16 matmuls are clearly faster gets an
info line naming `recipes/accelerate/cpu-bf16.yaml`. The speed is measured (`hispec.io.matmul_speed_ratio`), not
read from CPU flags: AVX2-only x86 runs bf16 through a slow fallback, AVX-512 BF16 / AMX run it faster than fp32.
"""

from __future__ import annotations

import logging
import os

import torch

from hispec import io as hio  # hio.matmul_speed_ratio looked up per call: tests replace it
from hispec.io import parse_dtype

logger = logging.getLogger("hispec.train")


def warn_if_slow_low_precision(m, d, g, t) -> list[str]:
    """Settings asking for bf16/fp16 on a CPU where that dtype's matmuls are much slower than fp32 (no native
    bf16 instructions): a logged warning each (a 2-core AVX2-only EPYC ran the bf16 feature cache 6x slower than
    fp32). accelerate's mixed precision (`accelerate launch --mixed_precision bf16`, read from the launcher's
    environment) is one of them; the other way round, an fp32 run on a CPU whose bf16 matmuls are >= 1.5x faster
    gets an info line naming `recipes/accelerate/cpu-bf16.yaml` (bf16 autocast trained the Qwen2.5-Coder EAGLE-3
    drafter 2.5x faster per step on an AVX512-bf16 EPYC). Returns the warnings."""
    if torch.cuda.is_available():
        return []
    asked = {"gen_dtype": g.gen_dtype, "loss_dtype": t.loss_dtype}
    if d.feature_cache:
        asked["feature_cache_backbone_dtype"] = d.feature_cache_backbone_dtype
    mixed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if mixed in ("bf16", "fp16"):
        asked["mixed_precision"] = mixed
    ratios: dict = {}  # measured once per dtype

    def ratio(dtype):
        if dtype not in ratios:
            ratios[dtype] = hio.matmul_speed_ratio(dtype)
        return ratios[dtype]

    out = []
    for key, name in asked.items():
        dtype = parse_dtype(name)
        if dtype not in (torch.bfloat16, torch.float16) or ratio(dtype) <= 2.0:
            continue
        fix = "launch with --mixed_precision no" if key == "mixed_precision" else f"set {key}: fp32"
        out.append(f"{key}={name}: on this CPU ({torch.backends.cpu.get_cpu_capability()}) {name} matmuls run "
                   f"{ratios[dtype]:.0f}x slower than fp32; {fix} (bf16 only pays on CPUs with native bf16, e.g. "
                   "AVX-512 BF16 / AMX, and on GPUs)")
    for w in out:
        logger.warning(w)
    if mixed == "no" and ratio(torch.bfloat16) <= 1 / 1.5:
        logger.info("bf16 matmuls run %.1fx faster than fp32 on this CPU: `accelerate launch --config_file "
                    "recipes/accelerate/cpu-bf16.yaml ...` trains in bf16 autocast (fp32 weights and optimizer)",
                    1 / ratios[torch.bfloat16])
    return out
