"""Prompt files, chat rendering and generated-row helpers shared by the CLI, the benchmark, the probe, the
distillation data tools and the tests.

`load_prompts(path)` reads Spec-Bench / MT-Bench `question.jsonl` (first turn, with its category), ShareGPT json
(first human turn) or any jsonl/json with a `prompt` (or `text`/`instruction`) field, or plain text (one per line).
`encode_prompts(tokenizer, prompts, chat=True)` renders them with the chat template and left-pads a batch;
`eos_ids` / `cut_at_eos` find a model's end-of-sequence ids and cut a generated row at the first one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Prompt:
    text: str
    category: str = "default"
    id: str | int | None = None


def _from_record(rec: dict, i: int) -> Prompt | None:
    if "turns" in rec and rec["turns"]:
        return Prompt(rec["turns"][0], rec.get("category", "default"), rec.get("question_id", i))
    if "conversations" in rec:
        first = next((c for c in rec["conversations"] if c.get("from") in ("human", "user")), None)
        if first and first.get("value", "").strip():
            return Prompt(first["value"], rec.get("category", "sharegpt"), rec.get("id", i))
        return None
    for key in ("prompt", "text", "instruction", "question"):
        if isinstance(rec.get(key), str) and rec[key].strip():
            return Prompt(rec[key], rec.get("category", "default"), rec.get("id", i))
    return None


def load_prompts(path: str | Path, num: int | None = None, categories: list[str] | None = None,
                 spread: bool = True) -> list[Prompt]:
    """Read prompts; with `categories` keep only those; `num` takes that many, spread over categories."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    elif path.suffix == ".json":
        data = json.loads(text)
        records = data if isinstance(data, list) else data.get("data", [])
    else:
        records = [{"prompt": line} for line in text.splitlines() if line.strip()]
    prompts = [p for i, r in enumerate(records) if (p := _from_record(r, i)) is not None]
    if categories:
        prompts = [p for p in prompts if p.category in set(categories)]
    if not prompts:
        raise ValueError(f"no prompts found in {path}" + (f" for categories {categories}" if categories else ""))
    if num is not None and num < len(prompts):
        prompts = spread_over_categories(prompts, num) if spread else prompts[:num]
    return prompts


def spread_over_categories(prompts: list[Prompt], num: int) -> list[Prompt]:
    """`num` prompts taken round-robin over categories (Spec-Bench subsets are reported per category)."""
    by_cat: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    picked, lists = [], [list(v) for v in by_cat.values()]
    while len(picked) < min(num, len(prompts)):
        for lst in lists:
            if lst and len(picked) < num:
                picked.append(lst.pop(0))
    return picked


def render(tokenizer, text: str, chat: bool = True) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)
    return tokenizer(text)["input_ids"]


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def eos_ids(tokenizer=None, generation_config=None) -> list[int]:
    """The end-of-sequence ids of a tokenizer and/or a generation config (either may be None, an id or a list),
    each once, in that order."""
    out: list[int] = []
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        for t in (src if isinstance(src, (list, tuple, set)) else [src]):
            if t is not None and int(t) not in out:
                out.append(int(t))
    return out


def cut_at_eos(tokens: list[int], eos, *, keep_eos: bool = True) -> tuple[list[int], bool]:
    """`tokens` up to the first id in `eos` (including it when `keep_eos`), and whether one came: the one place
    generated rows are cut at their end of sequence (benchmark, probe answers, self-distillation data)."""
    eos = eos if isinstance(eos, (set, frozenset)) else set(eos)
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1] if keep_eos else tokens[:i], True
    return tokens, False


def pad_id_of(tokenizer) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its EOS, else 0."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def encode_prompts(tokenizer, texts: list[str], chat: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return left_pad([render(tokenizer, t, chat) for t in texts], pad_id_of(tokenizer))
