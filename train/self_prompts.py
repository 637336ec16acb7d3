"""Self-written prompts, standalone: `python train/self_prompts.py --model_name_or_path ... --self_prompts N`.

The code is `hispec.distill.self_prompts` (the installed distillation core); `train/heads.py --self_prompts N`
calls the same code before self-distillation.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `hispec` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hispec.distill.self_prompts import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
