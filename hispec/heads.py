"""Exit heads: map the residual stream after layer l to features that the model's own (frozen) lm_head projects.

Contract: a head takes hidden states `[B, T, H]` at its exit and returns normed features `[B, T, H]`; logits are
`DecoderAdapter.project(features)` — heads never copy the vocabulary-sized output matrix. Types:

- `shared`  the model's own final norm (nothing to train; for early-exit-pretrained models such as LayerSkip)
- `norm`    its own copy of the final norm, trainable (LayerSkip-style, nearly free)
- `linear`  own norm + residual d×d adapter initialised to zero, so it starts exactly as `norm`
- `lowrank` own norm + residual rank-r adapter (up-projection zero-initialised)
- `layer`   one decoder layer (a copy of the base layer right after the exit, so it starts as "one layer deeper")
            with attention over the exit's previous positions, then its own norm and a zero-initialised residual
            d x d adapter. It is *stateful*: its keys/values live in the decoder's cache as an extra layer
            (index num_layers for the draft head, num_layers + 1 for the verifier) that is advanced and rolled back
            together with the exit's range, so it reuses KV exactly like the model's own layers. Callers pass
            `run_layer(module, hidden)` (the decoder: `DecoderAdapter.run_module` on its cache; training: a fresh
            cache over whole sequences, see `ExitHead.run_layer_fresh`). Trainable fully or with LoRA (peft).

`ExitHead.stateful` is True only for `layer`.

Any head may carry a reduced output vocabulary (`set_vocab(ids)`, a persistent `vocab` buffer of sorted token ids,
saved with the head): `EarlyExitModel.exit_logits` then projects onto those rows of the lm_head only (8k of 49k rows
costs ~1/6 of the full projection) and returns full-vocabulary logits with -inf outside the set, so every decoding
rule downstream is unchanged and stays lossless (a proposal with smaller support is still exact under speculative
sampling; greedy drafts outside the set are simply never proposed).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

HEAD_TYPES = ("shared", "norm", "linear", "lowrank", "layer")
STATELESS_HEAD_TYPES = ("shared", "norm", "linear", "lowrank")  # position-wise: no attention, no KV
EXTRA_CACHE_INDEX = {"draft": 0, "verify": 1}  # a layer head's cache layer: num_layers + this


def _set_layer_idx(module: nn.Module, idx: int) -> None:
    """Point every attention submodule of a copied decoder layer at cache layer `idx`."""
    found = False
    for sub in module.modules():
        if hasattr(sub, "layer_idx") and isinstance(sub.layer_idx, int):
            sub.layer_idx = idx
            found = True
    if not found:
        raise ValueError(f"{type(module).__name__} has no attention module with a layer_idx; a 'layer' head needs one")


class ExitHead(nn.Module):
    def __init__(self, head_type: str, final_norm: nn.Module, hidden_size: int, rank: int = 64, *,
                 layer: nn.Module | None = None, layer_type: str = "full_attention", cache_index: int | None = None):
        super().__init__()
        if head_type not in HEAD_TYPES:
            raise ValueError(f"unknown head type '{head_type}'; choose one of {', '.join(HEAD_TYPES)}")
        if head_type == "lowrank" and not 1 <= rank <= hidden_size:
            raise ValueError(f"lowrank head rank {rank} must be in 1..{hidden_size}")
        self.head_type = head_type
        self.rank = rank if head_type == "lowrank" else None
        if head_type == "shared":
            self._shared_norm = [final_norm]  # a reference, not a registered (saved, trained) submodule
            self.norm = None
        else:
            self.norm = copy.deepcopy(final_norm)
            for p in self.norm.parameters():
                p.requires_grad_(True)
        self.adapter: nn.Module | None = None
        self.layer: nn.Module | None = None
        self.layer_type = layer_type if head_type == "layer" else None
        self.cache_index = cache_index if head_type == "layer" else None
        if head_type == "layer":
            if layer is None or cache_index is None:
                raise ValueError("a 'layer' head needs the base decoder layer to copy and its cache index")
            self.layer = copy.deepcopy(layer)
            _set_layer_idx(self.layer, cache_index)
            for p in self.layer.parameters():
                p.requires_grad_(True)
        if head_type in ("linear", "layer"):
            self.adapter = nn.Linear(hidden_size, hidden_size, bias=False)
            nn.init.zeros_(self.adapter.weight)
        elif head_type == "lowrank":
            down = nn.Linear(hidden_size, rank, bias=False)
            up = nn.Linear(rank, hidden_size, bias=False)
            nn.init.normal_(down.weight, std=hidden_size**-0.5)
            nn.init.zeros_(up.weight)
            self.adapter = nn.Sequential(down, up)
        self.register_buffer("vocab", None)

    def set_vocab(self, ids: torch.Tensor | None) -> None:
        """Restrict this head's output to the token ids `ids` (1-D, unique; stored sorted), or lift it (None)."""
        if ids is None:
            self.vocab = None
            return
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("a head vocabulary needs at least one token id")
        ids = torch.unique(ids)  # sorted
        if int(ids[0]) < 0:
            raise ValueError("head vocabulary ids must be >= 0")
        dev = next((t.device for t in self.parameters()), ids.device)
        self.vocab = ids.to(dev)

    @property
    def vocab_size(self) -> int | None:
        return None if self.vocab is None else int(self.vocab.numel())

    @property
    def stateful(self) -> bool:
        return self.layer is not None

    def forward(self, hidden: torch.Tensor, run_layer=None) -> torch.Tensor:
        """hidden `[B, T, H]` residual stream at the exit -> `[B, T, H]` features for the lm_head.

        A `layer` head needs `run_layer(module, hidden) -> hidden` that runs its decoder layer over these positions
        with the right cache and positions (see the module docstring).
        """
        if self.layer is not None:
            if run_layer is None:
                raise ValueError("a 'layer' head attends over previous positions: call it with run_layer=... "
                                 "(the decoder does; for whole sequences use run_layer_fresh)")
            hidden = run_layer(self.layer, hidden)
        norm = self._shared_norm[0] if self.norm is None else self.norm
        y = norm(hidden)
        if self.adapter is not None:
            y = y + self.adapter(y)
        return y

    def run_layer_fresh(self, adapter, attention_mask: torch.Tensor | None = None):
        """`run_layer` for whole (left-padded) sequences without a decoder cache: training and evaluation."""
        from .layers import positions_from_mask

        def run(module, hidden):
            B, T = hidden.shape[:2]
            mask = torch.ones(B, T, dtype=torch.long, device=hidden.device) if attention_mask is None else attention_mask
            cache = adapter.new_cache(B, extra=self.cache_index - adapter.num_layers + 1)
            return adapter.run_module(module, self.layer_type, hidden, cache_index=self.cache_index,
                                      position_ids=positions_from_mask(mask), cache=cache, valid=mask.bool())

        return run

    def extra_repr(self) -> str:
        return (f"head_type={self.head_type}" + (f", rank={self.rank}" if self.rank else "")
                + (f", vocab={self.vocab_size}" if self.vocab is not None else ""))

    def shape_info(self) -> dict:
        return {"head_type": self.head_type, "rank": self.rank, "vocab_size": self.vocab_size,
                "layer_type": self.layer_type}
