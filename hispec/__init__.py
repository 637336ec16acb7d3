"""hispec: hierarchical early-exit speculative decoding for Hugging Face causal LMs.

`hispec.load(path)` loads an exported early-exit checkpoint; `EarlyExitModel.from_base(...)` wraps any supported
base model with (untrained) exit heads; `model.generate(...)` decodes losslessly with any hierarchy of levels
('ar', 'self-spec', 'hispec', 'ngram', ... or 'auto', chosen per row by the latency model of `hispec.latency`).
Importing hispec has no side effects and loads nothing heavy beyond torch and transformers.
"""

from .layers import DecoderAdapter, UnsupportedModelError
from .model import CheckpointError, EarlyExitModel, HispecConfig, load, load_base_model, load_tokenizer
from .drafters.ngram import NgramConfig

__version__ = "0.1.0"

__all__ = [
    "DecoderAdapter",
    "UnsupportedModelError",
    "EarlyExitModel",
    "HispecConfig",
    "CheckpointError",
    "load",
    "load_base_model",
    "load_tokenizer",
    "NgramConfig",
    "__version__",
]
