"""Self-distillation answers, standalone: `python train/generate_data.py --model_name_or_path ... --train_file ...`.

The code is `hispec.distill.answers` (the installed distillation core); `train/heads.py --self_distill true` calls
the same code before training.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `hispec` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hispec.distill.answers import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
