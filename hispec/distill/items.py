"""Evaluation-style data as plain items (no `datasets`): prompt files of any `hispec.prompts` layout, chats and
documents, read, chosen, split and tokenized into sequences with the spans to score. `hispec-probe` reads its
training and held-out data through this module; the trainer reads its data through `hispec.distill.data`, with
which it shares the role table and turn normalization (`normalize_messages`), chat rendering (`chat_ids`) and the
rule that benchmarks are never training data (`check_training_files`).

Contract:
- `read_items(path, raw_text=False)` reads one file into `Item`s: Spec-Bench / MT-Bench question.jsonl, ShareGPT
  json, jsonl/json with a prompt/text/instruction/question field, text one prompt a line; records with
  `{"prompt", "response"}` (or "completion") and chats `{"messages": [...]}` (or "conversations" holding an
  assistant turn) are teacher-forced over their assistant turns; with `raw_text=True` a .txt file is one document
  and records with only a "text" field are documents scored on every token. A record's category is kept; records
  without one are named after their file. A file with nothing usable raises `DataError`.
- `select_items(items, n, accept)` takes n items round-robin over (file, category), lazily skipping those `accept`
  rejects; `split_items(items, fraction, seed)` splits by prompt (every item with the same prompt lands on one
  side), deterministically from the seed.
- `prepare_item(tokenizer, item, ...)` tokenizes an item into `Prepared`: a prompt still to be answered (answers:
  `hispec.distill.answers.answer_prompts`) or finished `Sequence`s (token ids + the `[a, b)` spans of tokens to
  predict); None when it cannot be used. `Acceptor` does that once per item for `select_items` and counts rejects.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from hispec.distill.data import DataError, chat_ids, normalize_messages
from hispec.prompts import _from_record


@dataclass
class Item:
    """One unit of data before tokenization. kind: 'prompt' (the model answers it), 'chat' (teacher forcing over
    the assistant turns of `messages`), 'text' (a document, every token scored)."""

    kind: str
    category: str
    source: str
    prompt: str | None = None
    messages: list[dict] | None = None
    text: str | None = None

    @property
    def key(self) -> str:
        """What the train / held-out split groups by: the prompt (first user turn) or the document."""
        if self.kind == "prompt":
            return self.prompt
        if self.kind == "chat":
            first = next((m["content"] for m in self.messages if m["role"] == "user"), None)
            return first if first is not None else json.dumps(self.messages, sort_keys=True)
        return self.text


def _turns(turns) -> list[dict] | None:
    try:
        return normalize_messages(turns) if all(isinstance(t, dict) for t in turns) else None
    except DataError:
        return None


def _record_item(rec, source: str, raw_text: bool) -> Item | None:
    if not isinstance(rec, dict):
        return None
    cat = str(rec.get("category", Path(source).stem))
    for key in ("messages", "conversations"):
        turns = rec.get(key)
        msgs = _turns(turns) if isinstance(turns, list) and turns else None
        if msgs and any(m["role"] == "assistant" and m["content"].strip() for m in msgs) and any(
                m["role"] == "user" for m in msgs):
            return Item("chat", cat, source, messages=msgs)
        if msgs and key == "messages":
            first = next((m["content"] for m in msgs if m["role"] == "user" and m["content"].strip()), None)
            if first:
                return Item("prompt", cat, source, prompt=first)
    prompt, response = rec.get("prompt"), rec.get("response", rec.get("completion"))
    if isinstance(prompt, str) and prompt.strip() and isinstance(response, str) and response.strip():
        return Item("chat", cat, source,
                    messages=[{"role": "user", "content": prompt}, {"role": "assistant", "content": response}])
    if raw_text and isinstance(rec.get("text"), str) and rec["text"].strip() and not any(
            isinstance(rec.get(k), str) for k in ("prompt", "instruction", "question")):
        return Item("text", cat, source, text=rec["text"])
    p = _from_record(rec, 0)
    if p is None:
        return None
    return Item("prompt", Path(source).stem if p.category == "default" else str(p.category), source, prompt=p.text)


def read_items(path: str | os.PathLike, raw_text: bool = False) -> list[Item]:
    """All usable items of one data file (see the module docstring); DataError if there are none."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        elif path.suffix == ".json":
            data = json.loads(text)
            records = data if isinstance(data, list) else data.get("data", [])
        elif raw_text:
            records = [{"text": text}] if text.strip() else []
        else:
            records = [{"prompt": line} for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise DataError(f"cannot read {path}: not valid JSON ({e})") from None
    items = [it for rec in records if (it := _record_item(rec, str(path), raw_text)) is not None]
    if not items:
        raise DataError(f"no usable prompts, chats or texts found in {path}")
    return items


def select_items(items: list[Item], n: int | None, accept=None) -> list[Item]:
    """Up to n items, round-robin over (file, category) groups in file order; `accept(item)` (evaluated lazily,
    only on candidates) may reject one, and the next of its group is tried instead."""
    accept = accept or (lambda it: True)
    if n is None:
        return [it for it in items if accept(it)]
    groups: dict[tuple[str, str], list[Item]] = {}
    for it in items:
        groups.setdefault((it.source, it.category), []).append(it)
    lists = [list(reversed(v)) for v in groups.values()]
    picked: list[Item] = []
    while len(picked) < n and any(lists):
        for lst in lists:
            while lst and len(picked) < n:
                it = lst.pop()
                if accept(it):
                    picked.append(it)
                    break
    return picked


def seeded_hash(seed: int, *parts) -> str:
    """sha256 of `seed:part:part...`: the seeded order of the split, and the probe's per-head seeds."""
    return hashlib.sha256(":".join(map(str, (seed, *parts))).encode("utf-8")).hexdigest()


def split_items(items: list[Item], fraction: float, seed: int) -> tuple[list[Item], list[Item]]:
    """(train, held_out) by prompt: keys ordered by a seeded hash, the first ~fraction of them held out
    (at least one key on each side when there are two or more)."""
    keys = sorted({it.key for it in items}, key=lambda k: seeded_hash(seed, k))
    n_eval = min(max(1, round(fraction * len(keys))), max(1, len(keys) - 1)) if keys else 0
    held = set(keys[:n_eval])
    return [it for it in items if it.key not in held], [it for it in items if it.key in held]


# ---------------------------------------------------------------------------------------------------- tokens
@dataclass
class Sequence:
    """Token ids and the spans `[a, b)` of tokens to predict (each span one answer; position p predicts p+1)."""

    ids: list[int]
    spans: list[tuple[int, int]]
    category: str
    held_out: bool = False

    @property
    def n_scored(self) -> int:
        return sum(b - a for a, b in self.spans)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def chat_sequence(tokenizer, messages: list[dict], max_len: int, chat: bool = True) -> tuple[list[int], list]:
    """Full chat ids (truncated to max_len) and the spans of its assistant turns."""
    full = chat_ids(tokenizer, messages, False, chat)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant" or k == 0:
            continue
        a = _common_prefix(chat_ids(tokenizer, messages[:k], True, chat), full)
        b = _common_prefix(chat_ids(tokenizer, messages[: k + 1], False, chat), full)
        a, b = max(a, 1), min(b, max_len)
        if b > a:
            spans.append((a, b))
    return full[:max_len], spans


@dataclass
class Prepared:
    """A tokenized item: a prompt still to be answered (`answer_needed`) or finished sequences."""

    item: Item
    prompt_ids: list[int] | None = None
    sequences: list[Sequence] = field(default_factory=list)
    held_out: bool = False

    @property
    def answer_needed(self) -> bool:
        return self.prompt_ids is not None

    def mark(self, held_out: bool) -> Prepared:
        self.held_out = held_out
        for s in self.sequences:
            s.held_out = held_out
        return self


def prepare_item(tokenizer, item: Item, *, max_prompt_tokens: int, max_seq_len: int, chat: bool = True,
                 held_out: bool = False) -> Prepared | None:
    """Tokenize one item; None when it cannot be used (prompt longer than `max_prompt_tokens`, nothing to score)."""
    if item.kind == "prompt":
        ids = chat_ids(tokenizer, [{"role": "user", "content": item.prompt}], True, chat)
        if not ids or len(ids) > max_prompt_tokens or len(ids) >= max_seq_len:
            return None
        return Prepared(item, prompt_ids=ids, held_out=held_out)
    if item.kind == "chat":
        ids, spans = chat_sequence(tokenizer, item.messages, max_seq_len, chat)
        seqs = [Sequence(ids, spans, item.category, held_out)] if spans else []
    else:
        ids = list(tokenizer(item.text)["input_ids"])
        blocks = [ids[i : i + max_seq_len] for i in range(0, len(ids), max_seq_len)]
        seqs = [Sequence(b, [(1, len(b))], item.category, held_out) for b in blocks if len(b) >= 2]
    return Prepared(item, sequences=seqs, held_out=held_out) if seqs else None


class Acceptor:
    """`accept(item)` for `select_items`: tokenizes an item once (`prepared[id(item)]`) and counts the unusable
    ones in `rejected`."""

    def __init__(self, tokenizer, **settings):
        self.tokenizer, self.settings = tokenizer, settings
        self.prepared: dict[int, Prepared] = {}
        self.rejected = 0

    def __call__(self, item: Item) -> bool:
        if id(item) not in self.prepared:
            p = prepare_item(self.tokenizer, item, **self.settings)
            if p is None:
                self.rejected += 1
                return False
            self.prepared[id(item)] = p
        return True

    def take(self, items: list[Item], held_out: bool) -> list[Prepared]:
        return [self.prepared[id(it)].mark(held_out) for it in items]
