"""N-gram (prompt-lookup) drafting: propose the tokens that followed the latest earlier occurrence of the row's
last n tokens in its own prompt and output. No model cost; strongest where answers copy from the context
(summarisation, RAG, translation of names and numbers, code edits).

transformers has the same idea as `PromptLookupCandidateGenerator` (`generate(prompt_lookup_num_tokens=...)`), but
it is a candidate generator for batch size 1 bound to `generate`'s assisted-decoding loop; hispec needs proposals
for every row of a batch, as a level of its own hierarchy (below an exit level or the full model), so the lookup
is reimplemented here in a few tensor ops. It follows transformers' rule where they overlap: longest n first
(max_ngram .. min_ngram), continuation capped at `max_len`; it differs in taking the *latest* earlier match
(transformers takes the first), which follows the most recent context and measured no worse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NgramConfig:
    max_ngram: int = 3  # longest suffix matched first
    min_ngram: int = 1  # shortest suffix tried
    max_len: int = 8  # most tokens proposed per round (the level's gamma caps it further)

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram", "max_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"n-gram {name} must be an integer >= 1, got {v!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"n-gram min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")


def propose(tokens: torch.Tensor, config: NgramConfig = NgramConfig(), max_len: int | None = None) -> torch.Tensor:
    """`tokens` [S] (one row's prompt + output so far) -> the proposed continuation [<= max_len] (possibly empty)."""
    limit = config.max_len if max_len is None else min(max_len, config.max_len)
    S = tokens.shape[0]
    if limit <= 0 or S < 2:
        return tokens[:0]
    for n in range(min(config.max_ngram, S - 1), config.min_ngram - 1, -1):
        suffix = tokens[S - n:]
        windows = tokens[: S - 1].unfold(0, n, 1)  # windows starting at 0 .. S-1-n: each has a following token
        hits = (windows == suffix).all(1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start: min(start + limit, S)]
    return tokens[:0]


def propose_batch(tok: torch.Tensor, seq: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                  config: NgramConfig = NgramConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposals for the rows in `rows` (bool [B]) of `tok` [B, cap] whose first `seq[b]` tokens are known, at
    most `lengths[b]` tokens each. Returns (`props` [B, W] token ids, `n` [B] proposal lengths; 0 = no match)."""
    B = tok.shape[0]
    out = [tok.new_empty(0)] * B
    for b in rows.nonzero().flatten().tolist():
        out[b] = propose(tok[b, : int(seq[b])], config, int(lengths[b]))
    n = torch.tensor([len(p) for p in out], dtype=torch.long, device=tok.device)
    W = int(n.max()) if B else 0
    props = torch.zeros(B, max(W, 1), dtype=torch.long, device=tok.device)
    for b, p in enumerate(out):
        if len(p):
            props[b, : len(p)] = p
    return props, n
