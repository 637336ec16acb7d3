"""A training run's output folder, as `train/heads.py` writes it: `TrainRun` and `read_train_output`.

Contract: `read_train_output(dir)` reads `hispec_heads.safetensors` (keys as `EarlyExitModel.heads_state_dict()`),
`hispec_train.json` = {"hispec", "base", "args", "data"} and an optional free-form `metrics.json`, and raises
`ExportError` (what is missing and what to do) for anything else. The lowest module of `hispec.export`: the
checkpoint writer (`checkpoint`) and the model card (`model_card`) both read runs through it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..io import read_json
from ..model import HEADS_FILE, METRICS_FILE, TRAIN_FILE


class ExportError(ValueError):
    """The training output or the export request is unusable; the message says what to do."""



@dataclass
class TrainRun:
    """What one training run left in its output folder."""

    folder: Path
    hispec: dict  # HispecConfig.to_dict()
    base: dict  # base identity: name_or_path, revision, architectures, depth, hidden size, vocab size
    args: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    @property
    def heads_file(self) -> Path:
        return self.folder / HEADS_FILE

    @property
    def recorded_base(self) -> dict:
        """The base identity, the top-level "base" entry winning over the copy inside "hispec"."""
        return {**self.hispec.get("base", {}), **{k: v for k, v in self.base.items() if v is not None}}


def read_train_output(folder: str | os.PathLike) -> TrainRun:
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"training output folder {folder} does not exist")
    for name in (TRAIN_FILE, HEADS_FILE):
        if not (folder / name).is_file():
            raise ExportError(
                f"{folder / name} is missing: {folder} is not a finished train/heads.py output folder "
                f"(it needs {TRAIN_FILE} and {HEADS_FILE})"
            )
    try:
        train = read_json(folder / TRAIN_FILE)
        metrics = read_json(folder / METRICS_FILE) if (folder / METRICS_FILE).is_file() else {}
    except ValueError as e:  # json.JSONDecodeError
        raise ExportError(f"unreadable JSON in {folder}: {e}") from e
    if not isinstance(train.get("hispec"), dict):
        raise ExportError(f"{folder / TRAIN_FILE} has no 'hispec' entry (the HispecConfig of the run)")
    return TrainRun(folder=folder, hispec=train["hispec"], base=dict(train.get("base") or {}),
                    args=dict(train.get("args") or {}), data=dict(train.get("data") or {}),
                    metrics=metrics if isinstance(metrics, dict) else {"metrics": metrics})
