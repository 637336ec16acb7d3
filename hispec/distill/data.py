"""Training data for exit heads, through `datasets`.

Contract:
- `load_examples(cfg, seed)` reads local files (json / jsonl / parquet / txt) and/or a Hub dataset and returns
  `(train, eval)` `datasets.Dataset`s with two columns: `messages` (a chat, list of {role, content}; empty for
  plain text) and `text` (plain text; "" for chats). A file is read through whichever of `messages_column`
  (chats: {role, content} or ShareGPT {from, value} turns, or alternating strings) and `text_column` it has; a
  file with neither fails with the columns it does have. Held-out rows come from `eval_file` or a seeded
  `eval_fraction` split. Empty results fail before any training. With `require_train=False` and no training
  source at all it returns `(None, eval rows or None)` (a run whose data is only self-written prompts or text).
- `load_plain_text(cfg, seed)` reads `cfg.plain_text_file` for teacher-forced distillation (every position of the
  text is a training signal, nothing is generated): a `messages_column` chat keeps ALL its turns; a
  `text_column` row that also has `plain_text_answer_column` (GSM8K: question + reference answer) becomes a
  user + assistant chat; otherwise the text (a .txt file's `text` column too) is taken as is. At most
  `plain_text_max_samples_per_file` rows per file (seeded choice). Same {messages, text} rows, training only.
- `drop_overlap(rows, held_out)` removes rows whose first user turn (or text) equals a held-out prompt's, after
  normalising case and whitespace: the same file may feed both prompts and plain text, and held-out prompts must
  never be trained on.
- `check_training_files(paths)`: Spec-Bench / MT-Bench files (by name) are evaluation data, never training data
  (the trainer and the probe both refuse them). `split_off_eval(ds, fraction, max_eval)`: the seeded-order held-out
  split of a Dataset.
- `chat_ids(tokenizer, messages, add_generation_prompt, chat=True)`: token ids of a chat (the probe's prompts and
  chats), the same template / plain layout as `render_chat`.
- `prompt_of(row)` gives the chat a model should answer for self-distillation (a text row becomes one user turn;
  a trailing assistant turn is dropped so the model writes its own).
- `tokenize(ds, tokenizer, max_seq_length, packing, loss_on="all")`: chats are rendered with the tokenizer's chat
  template (a plain "role: content" layout when it has none), text is tokenized as is; then truncation (padding
  mode) or packing into `max_seq_length` blocks. Rows get `input_ids` and `loss_mask` (bool per position: does
  this position's next-token distribution train the heads). `loss_on="all"`: every position (what self-distilled
  answers always use). `loss_on="assistant"`: in chats only the positions that predict an assistant reply's
  tokens and the token closing it (the reply is located in the rendered text; needs a fast tokenizer); plain text
  rows keep every position. Rows with fewer than 2 tokens or no loss position are dropped.
- `PadCollator(pad_id)`: right-pads a batch -> `input_ids`, `attention_mask` (`[B, T]` long) and, when the rows
  have one, `loss_mask` (`[B, T]` bool, False on padding).
- `EpochSampler(n, seed)`: a random order fixed by (seed, epoch) and nothing else, so a resumed run sees the same
  order; `set_epoch(e)` chooses the epoch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Sampler

logger = logging.getLogger(__name__)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
         "model": "assistant", "chatgpt": "assistant", "system": "system"}
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}
LOSS_ON = ("all", "assistant")
EVAL_SET_MARKERS = ("spec_bench", "spec-bench", "specbench", "mt_bench", "mt-bench", "mtbench")


class DataError(ValueError):
    """The training data cannot be used; the message says which file/column and what to do."""


def is_eval_set_file(path: str | os.PathLike) -> bool:
    """Whether a file's name says it is an evaluation benchmark (Spec-Bench / MT-Bench)."""
    name = Path(path).name.lower()
    return any(m in name for m in EVAL_SET_MARKERS)


def check_training_files(paths, allow_eval_sets: bool = False, advice: str = "never train on them") -> None:
    """Refuse Spec-Bench / MT-Bench files as training data (design.md §8) unless explicitly allowed: the one rule
    of `train/heads.py` and `hispec-probe`."""
    bad = [str(p) for p in paths if is_eval_set_file(p)]
    if bad and not allow_eval_sets:
        raise DataError(f"{', '.join(bad)} look like evaluation benchmarks (Spec-Bench / MT-Bench): evaluation sets "
                        f"are not training data, training heads on them would leak the benchmark; {advice}")


def expand_path(p: str | None) -> str | None:
    """`~` and `$VARS` expanded (recipes may say `~/.cache/...` or `${HISPEC_MODELS_DIR}/...`)."""
    if p is None:
        return None
    return os.path.expanduser(os.path.expandvars(p))


def builder_for(path: str) -> str:
    ext = Path(path).suffix.lower()
    if ext not in _BUILDERS:
        raise DataError(f"cannot read {path}: unknown extension '{ext}'; use one of {', '.join(sorted(_BUILDERS))}")
    return _BUILDERS[ext]


def normalize_messages(turns, where: str = "") -> list[dict]:
    """Chat turns in any common layout -> [{role, content}] (roles user/assistant/system)."""
    if isinstance(turns, str):
        turns = json.loads(turns)
    out = []
    for i, t in enumerate(turns or []):
        if isinstance(t, str):
            role, content = ("user" if i % 2 == 0 else "assistant"), t
        elif isinstance(t, dict):
            raw_role = t.get("role", t.get("from"))
            content = t.get("content", t.get("value"))
            role = ROLES.get(str(raw_role).lower()) if raw_role is not None else None
            if role is None or content is None:
                raise DataError(
                    f"{where}: chat turn {i} {dict(t)!r} has no usable role/content (expected keys role+content "
                    f"or from+value, roles {sorted(ROLES)})"
                )
        else:
            raise DataError(f"{where}: chat turn {i} is a {type(t).__name__}, expected a dict or a string")
        out.append({"role": role, "content": str(content)})
    return out


def _load_one(source: str, cfg, *, hub: bool = False):
    from datasets import load_dataset

    if hub:
        ds = load_dataset(source, cfg.dataset_config_name, split=cfg.dataset_split)
    else:
        if not Path(source).exists():
            raise DataError(f"training file {source} does not exist")
        ds = load_dataset(builder_for(source), data_files=source, split="train")
    cols = ds.column_names
    if cfg.messages_column in cols:
        col, kind = cfg.messages_column, "messages"
    elif cfg.text_column in cols:
        col, kind = cfg.text_column, "text"
    else:
        raise DataError(
            f"{source} has neither messages_column '{cfg.messages_column}' nor text_column '{cfg.text_column}'; "
            f"its columns are {cols}. Set --messages_column or --text_column."
        )
    return _convert(ds, source, col, kind, cfg.max_samples_per_file,
                    keep=lambda r: bool(r["messages"]) or bool(r["text"].strip()))


def _convert(ds, source: str, col: str, kind: str, cap: int | None, keep, answer_col: str | None = None):
    """A source's rows -> {messages, text} rows (`kind`: messages, text, or pair = `col` + `answer_col` as a user +
    assistant chat), those `keep` accepts, at most `cap` of them (a seeded choice)."""

    def convert(row):
        if kind == "messages":
            return {"messages": normalize_messages(row[col], where=source), "text": ""}
        if kind == "pair" and row[answer_col] is not None and str(row[answer_col]).strip():
            return {"messages": [{"role": "user", "content": str(row[col] or "")},
                                 {"role": "assistant", "content": str(row[answer_col])}], "text": ""}
        return {"messages": [], "text": str(row[col] or "")}

    ds = ds.map(convert, remove_columns=ds.column_names, desc=f"reading {Path(source).name}")
    ds = ds.filter(keep)
    if cap and len(ds) > cap:
        ds = ds.shuffle(seed=0).select(range(cap))
    return ds


def _concat(parts):
    from datasets import concatenate_datasets

    return concatenate_datasets(parts) if len(parts) > 1 else parts[0]


def split_off_eval(ds, fraction: float, max_eval: int | None = None):
    """-> (train, held out): the first ~`fraction` of the rows (at most `max_eval`, at least 1, never all) held out;
    `(ds, None)` when `fraction` is 0 or there is a single row."""
    if not fraction > 0 or len(ds) <= 1:
        return ds, None
    n_eval = min(max(1, int(round(fraction * len(ds)))), max_eval or len(ds), len(ds) - 1)
    return ds.select(range(n_eval, len(ds))), ds.select(range(n_eval))


def load_examples(cfg, seed: int, require_train: bool = True):
    """-> (train, eval) Datasets of {messages, text}; see the module docstring."""
    sources = [(expand_path(f), False) for f in cfg.train_file]
    if cfg.dataset_name:
        sources.append((cfg.dataset_name, True))
    if not sources:
        if require_train:
            raise DataError("no training data: give --train_file (json/jsonl/parquet/txt) and/or --dataset_name")
        ev = _concat([_load_one(expand_path(f), cfg) for f in cfg.eval_file]) if cfg.eval_file else None
        if ev is not None and cfg.max_eval_samples and len(ev) > cfg.max_eval_samples:
            ev = ev.select(range(cfg.max_eval_samples))
        return None, ev
    parts = [_load_one(s, cfg, hub=h) for s, h in sources]
    train = _concat(parts).shuffle(seed=seed)
    if len(train) == 0:
        raise DataError(f"the training data is empty (sources: {[s for s, _ in sources]})")
    if cfg.eval_file:
        ev = _concat([_load_one(expand_path(f), cfg) for f in cfg.eval_file])
    else:
        train, ev = split_off_eval(train, cfg.eval_fraction, cfg.max_eval_samples)
    if cfg.max_train_samples and len(train) > cfg.max_train_samples:
        train = train.select(range(cfg.max_train_samples))
    if ev is not None and cfg.max_eval_samples and len(ev) > cfg.max_eval_samples:
        ev = ev.select(range(cfg.max_eval_samples))
    return train, ev


def _load_plain_one(source: str, cfg):
    from datasets import load_dataset

    if not Path(source).exists():
        raise DataError(f"plain-text file {source} does not exist")
    ds = load_dataset(builder_for(source), data_files=source, split="train")
    cols = ds.column_names
    answer_col = getattr(cfg, "plain_text_answer_column", None)
    if cfg.messages_column in cols:
        col, kind = cfg.messages_column, "messages"
    elif cfg.text_column in cols:
        col, kind = cfg.text_column, ("pair" if answer_col and answer_col in cols else "text")
    elif "text" in cols:
        col, kind = "text", "text"
    else:
        raise DataError(
            f"plain-text file {source} has neither messages_column '{cfg.messages_column}' nor text_column "
            f"'{cfg.text_column}' (nor 'text'); its columns are {cols}. Set --messages_column or --text_column."
        )
    return _convert(ds, source, col, kind, getattr(cfg, "plain_text_max_samples_per_file", None),
                    keep=lambda r: any(m["content"].strip() for m in r["messages"]) or bool(r["text"].strip()),
                    answer_col=answer_col)


def load_plain_text(cfg, seed: int):
    """`cfg.plain_text_file` -> one shuffled Dataset of {messages, text} (see the module docstring); None if none."""
    files = list(getattr(cfg, "plain_text_file", None) or [])
    if not files:
        return None
    ds = _concat([_load_plain_one(expand_path(f), cfg) for f in files]).shuffle(seed=seed)
    if len(ds) == 0:
        raise DataError(f"the plain-text data is empty (files: {files})")
    return ds


def _first_user_text(row: dict) -> str:
    for m in row["messages"] or []:
        if m["role"] == "user":
            return " ".join(m["content"].lower().split())
    return " ".join((row["text"] or "").lower().split())


def drop_overlap(rows, held_out):
    """`rows` without those whose first user turn / text is a prompt of `held_out` (see the module docstring)."""
    if rows is None or held_out is None or len(held_out) == 0:
        return rows
    keys = {_first_user_text(r) for r in held_out}
    keys.discard("")
    return rows.filter(lambda r: _first_user_text(r) not in keys, desc="dropping held-out prompts")


def prompt_of(row: dict) -> list[dict]:
    """The chat the model answers in self-distillation: text -> one user turn; a final assistant turn dropped."""
    msgs = list(row["messages"]) if row["messages"] else [{"role": "user", "content": row["text"]}]
    while msgs and msgs[-1]["role"] == "assistant":
        msgs = msgs[:-1]
    return msgs


def prompt_id(messages: list[dict]) -> str:
    """Stable id of a prompt (resumable generation skips prompts whose id is already written)."""
    return hashlib.sha1(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def _plain_chat(messages: list[dict], add_generation_prompt: bool) -> str:
    """The layout of a chat for tokenizers without a chat template: 'role: content' lines."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Messages -> text with the tokenizer's chat template, or a plain layout when it has none."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return _plain_chat(messages, add_generation_prompt)


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, chat: bool = True) -> list[int]:
    """Token ids of a chat through the tokenizer's chat template; with `chat=False` or no template, the plain layout
    tokenized with the tokenizer's special tokens."""
    if chat and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            return_dict=False)
        out = out["input_ids"] if hasattr(out, "keys") else out
        out = out.tolist() if hasattr(out, "tolist") else out
        return list(out[0] if out and isinstance(out[0], list) else out)
    return list(tokenizer(_plain_chat(messages, add_generation_prompt))["input_ids"])


def assistant_loss_mask(rendered: str, messages: list[dict], offsets) -> list[bool]:
    """Loss positions of the assistant replies in a rendered chat (see `tokenize(loss_on="assistant")`).

    `offsets`: the `(start, end)` character span of each token of `rendered`. Every turn's content is located in
    order in the rendered text (so a reply equal to an earlier user turn is not mistaken for it); a turn that
    cannot be found (a template that rewrites content) gives an all-False mask, and the row is dropped.
    """
    spans, cursor = [], 0
    for m in messages:
        body = m["content"].strip()
        if not body:
            continue
        at = rendered.find(body, cursor)
        if at < 0:
            return [False] * len(offsets)
        if m["role"] == "assistant":
            spans.append((at, at + len(body)))
        cursor = at + len(body)
    mask = [False] * len(offsets)
    for a, b in spans:
        toks = [j for j, (s, e) in enumerate(offsets) if s < b and e > a]
        if not toks:
            continue
        for t in range(max(toks[0] - 1, 0), toks[-1] + 1):  # predict each reply token and the closing token
            mask[t] = True
    return mask


def tokenize(ds, tokenizer, max_seq_length: int, packing: bool = False, desc: str = "tokenizing",
             loss_on: str = "all"):
    """{messages, text} rows -> {input_ids, loss_mask} rows (truncated, or packed into max_seq_length blocks)."""
    if max_seq_length < 2:
        raise DataError(f"max_seq_length must be >= 2, got {max_seq_length}")
    if loss_on not in LOSS_ON:
        raise DataError(f"unknown loss_on '{loss_on}'; choose one of {', '.join(LOSS_ON)}")
    if loss_on == "assistant" and not getattr(tokenizer, "is_fast", False):
        raise DataError("loss on assistant turns only needs a fast tokenizer (character offsets); use loss_on all")
    eos = tokenizer.eos_token_id

    def encode(batch):
        ids, masks = [], []
        for msgs, text in zip(batch["messages"], batch["text"]):
            if msgs:
                rendered = render_chat(tokenizer, msgs)
                if loss_on == "assistant":
                    enc = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
                    ids.append(enc["input_ids"])
                    masks.append(assistant_loss_mask(rendered, msgs, enc["offset_mapping"]))
                    continue
                ids.append(tokenizer(rendered, add_special_tokens=False)["input_ids"])
            else:
                ids.append(tokenizer(text, add_special_tokens=True)["input_ids"])
            masks.append([True] * len(ids[-1]))
        if not packing:
            return {"input_ids": [x[:max_seq_length] for x in ids],
                    "loss_mask": [m[:max_seq_length] for m in masks]}
        flat, flat_mask = [], []
        for x, m in zip(ids, masks):
            extra = eos is not None and (not x or x[-1] != eos)
            flat.extend(x + ([eos] if extra else []))
            flat_mask.extend(m + ([loss_on == "all"] if extra else []))
        n = len(flat) // max_seq_length * max_seq_length
        return {"input_ids": [flat[i : i + max_seq_length] for i in range(0, n, max_seq_length)],
                "loss_mask": [flat_mask[i : i + max_seq_length] for i in range(0, n, max_seq_length)]}

    out = ds.map(encode, batched=True, batch_size=1000 if packing else 256, remove_columns=ds.column_names,
                 desc=desc)
    return out.filter(lambda r: len(r["input_ids"]) >= 2 and any(r["loss_mask"]))


@dataclass
class PadCollator:
    """Right padding: list of {input_ids[, loss_mask]} -> {input_ids [B, T], attention_mask [B, T]} (long
    tensors) and `loss_mask` [B, T] (bool, False on padding) when the rows carry one."""

    pad_id: int = 0

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        T = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        with_loss = "loss_mask" in rows[0]
        loss = torch.zeros((len(rows), T), dtype=torch.bool)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
            mask[i, :n] = 1
            if with_loss:
                loss[i, :n] = torch.as_tensor(r["loss_mask"], dtype=torch.bool)
        out = {"input_ids": ids, "attention_mask": mask}
        if with_loss:
            out["loss_mask"] = loss
        return out


class EpochSampler(Sampler[int]):
    """Random permutation of range(n) determined by (seed, epoch) only; `set_epoch` picks the epoch."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n
