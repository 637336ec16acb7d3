"""Exit heads: map the residual stream after layer l to features that the model's own (frozen) lm_head projects.

Contract: a head takes hidden states `[B, T, H]` at its exit and returns normed features `[B, T, H]`; logits are
`DecoderAdapter.project(features)` — heads never copy the vocabulary-sized output matrix. Types:

- `shared`  the model's own final norm (nothing to train; for early-exit-pretrained models such as LayerSkip)
- `norm`    its own copy of the final norm, trainable (LayerSkip-style, nearly free)
- `linear`  own norm + residual d×d adapter initialised to zero, so it starts exactly as `norm`
- `lowrank` own norm + residual rank-r adapter (up-projection zero-initialised)

`ExitHead.stateful` is False for all of these; a head with its own attention and KV cache sets it True and
receives the decoder's per-head cache (reserved for richer heads).

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

HEAD_TYPES = ("shared", "norm", "linear", "lowrank")


class ExitHead(nn.Module):
    stateful = False

    def __init__(self, head_type: str, final_norm: nn.Module, hidden_size: int, rank: int = 64):
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
        if head_type == "linear":
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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, T, H] residual stream at the exit -> [B, T, H] features for the lm_head
        norm = self._shared_norm[0] if self.norm is None else self.norm
        y = norm(hidden)
        if self.adapter is not None:
            y = y + self.adapter(y)
        return y

    def extra_repr(self) -> str:
        return (f"head_type={self.head_type}" + (f", rank={self.rank}" if self.rank else "")
                + (f", vocab={self.vocab_size}" if self.vocab is not None else ""))

    def shape_info(self) -> dict:
        return {"head_type": self.head_type, "rank": self.rank, "vocab_size": self.vocab_size}
