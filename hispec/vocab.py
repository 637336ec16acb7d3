"""Reduced output vocabularies for exit heads: which K tokens a draft (or verifier) head may propose.

Projecting onto K of the V rows of the lm_head is what makes a shallow exit cheap: for SmolLM2 (V = 49,152, hidden
576) the full projection costs as much as several decoder layers, 8,192 rows a sixth of it. The full model's
distribution stays full, so output is unchanged whatever the set; the set only decides how often a draft can be
right at all (its *coverage* of the tokens the model actually emits).

Choice: the K most frequent tokens of broad text (`token_counts` over any files), ties and the remainder filled by
lowest token id (BPE ids follow merge order, itself a frequency ranking of the tokenizer's training corpus), plus
the special tokens (EOS must stay proposable). Measured on SmolLM2's greedy answers to 24 Spec-Bench questions
(2,207 tokens): coverage 0.79 / 0.87 / 0.93 for K = 4k / 8k / 16k, the same within ±0.01 whether counted on the
model's own answers, on GSM8K + ShareGPT text, or taken purely by id order.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch


def _strings(obj) -> Iterable[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


def texts_from_files(paths: Iterable[str | os.PathLike], max_texts: int | None = None) -> list[str]:
    """Every string value of .json / .jsonl files (all fields, all turns) and the lines of other text files."""
    texts: list[str] = []
    for path in paths:
        path = Path(os.path.expandvars(str(path))).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"vocabulary data file not found: {path}")
        with open(path, encoding="utf-8") as f:
            if path.suffix == ".jsonl":
                for line in f:
                    if line.strip():
                        texts.extend(_strings(json.loads(line)))
            elif path.suffix == ".json":
                texts.extend(_strings(json.load(f)))
            else:
                texts.extend(line for line in f if line.strip())
        if max_texts is not None and len(texts) >= max_texts:
            return texts[:max_texts]
    return texts


def token_counts(tokenizer, texts: Iterable[str], vocab_size: int, batch: int = 256) -> torch.Tensor:
    """Occurrences of each token id in `texts` -> LongTensor `[vocab_size]`."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    texts = list(texts)
    for i in range(0, len(texts), batch):
        for ids in tokenizer(texts[i : i + batch], add_special_tokens=False)["input_ids"]:
            if ids:
                counts += torch.bincount(torch.tensor(ids).clamp(max=vocab_size - 1), minlength=vocab_size)
    return counts


def special_ids(tokenizer=None, generation_config=None) -> list[int]:
    """Token ids a reduced vocabulary always keeps: EOS (generation config) and the tokenizer's special tokens."""
    ids: set[int] = set()
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else list(eos))
    if tokenizer is not None:
        ids.update(int(i) for i in getattr(tokenizer, "all_special_ids", []) if i is not None)
    return sorted(ids)


def select_vocab(size: int, vocab_size: int, counts: torch.Tensor | None = None, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` token ids to keep (sorted): `always` first, then by count (descending), ties by lowest id."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"a reduced vocabulary of {size} tokens must be within 1..{vocab_size}")
    always = sorted({int(i) for i in always if 0 <= int(i) < vocab_size})
    if len(always) > size:
        raise ValueError(f"a reduced vocabulary of {size} tokens cannot hold the {len(always)} special tokens")
    # score: count (or 0), ties by lowest id; `always` ids forced to the top
    order = torch.arange(vocab_size, dtype=torch.float64)
    score = -order / vocab_size
    if counts is not None:
        if counts.numel() != vocab_size:
            raise ValueError(f"counts have {counts.numel()} entries, the vocabulary {vocab_size}")
        score = score + counts.to(torch.float64)
    if always:
        score[torch.tensor(always)] = float("inf")
    return torch.sort(torch.topk(score, size).indices).values


def coverage(vocab: torch.Tensor, tokens: torch.Tensor) -> float:
    """Share of `tokens` that fall inside `vocab`."""
    if tokens.numel() == 0:
        return float("nan")
    return float(torch.isin(tokens.flatten(), vocab).float().mean())


def vocab_for_model(model, size: int, files: Iterable[str | os.PathLike] = (), tokenizer=None) -> torch.Tensor:
    """A reduced vocabulary for `model` (an EarlyExitModel): counted on `files` if any, else by token id order."""
    tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    V = model.adapter.vocab_size
    files = list(files)
    counts = None
    if files:
        if tokenizer is None:
            raise ValueError("counting tokens in --vocab-data needs the model's tokenizer")
        counts = token_counts(tokenizer, texts_from_files(files), V)
    always = special_ids(tokenizer, getattr(model.base, "generation_config", None))
    return select_vocab(size, V, counts, always)


def apply_vocab_sizes(model, draft: int | None = None, verify: int | None = None) -> None:
    """CLI helper: give exits a reduced vocabulary of this size by token id order (0: full; None: leave as is).

    A head that already has a vocabulary of exactly that size (e.g. counted on data by hispec-export) keeps it.
    """
    for name, size in (("draft", draft), ("verify", verify)):
        if size is None or model.vocab_size_of(name) == (size or None):
            continue
        model.set_exit_vocab(name, vocab_for_model(model, size) if size else None)
