"""Training data (hispec/distill/data.py): file formats, chat layouts, column errors, splits, packing, epoch order, plain-text
sources and loss masks; the filters, dedup and template handling of self-written prompts (hispec/distill/self_prompts.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from hispec.distill.data import DataError, EpochSampler, PadCollator, load_examples, normalize_messages, prompt_of


def _cfg(files, **kw):
    base = dict(train_file=[str(f) for f in files], dataset_name=None, dataset_config_name=None, dataset_split="train",
                text_column="text", messages_column="messages", max_samples_per_file=None, max_train_samples=None,
                eval_file=[], eval_fraction=0.0, max_eval_samples=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_normalize_messages_sharegpt_and_openai_layouts():
    sharegpt = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    assert normalize_messages(sharegpt) == [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}]
    assert normalize_messages([{"role": "system", "content": "s"}])[0]["role"] == "system"
    assert normalize_messages(["q", "a"])[1] == {"role": "assistant", "content": "a"}
    with pytest.raises(DataError, match="no usable role/content"):
        normalize_messages([{"speaker": "x", "text": "y"}], where="f.json")


def test_prompt_drops_final_answer_and_wraps_text():
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "text": ""}
    assert prompt_of(row) == [{"role": "user", "content": "q"}]
    assert prompt_of({"messages": [], "text": "t"}) == [{"role": "user", "content": "t"}]


def test_files_of_different_layouts_mix(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(6)))
    (tmp_path / "b.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": f"c{i}"}]}
                                                 for i in range(4)]))
    (tmp_path / "c.txt").write_text("line one\n\nline two\n")
    cfg = _cfg([tmp_path / "a.jsonl", tmp_path / "b.json", tmp_path / "c.txt"], text_column="question",
               messages_column="conversations", eval_fraction=0.2)
    with pytest.raises(DataError, match="neither messages_column 'conversations' nor text_column 'question'"):
        load_examples(cfg, seed=0)  # c.txt has only a 'text' column
    cfg.train_file = cfg.train_file[:2]
    train, ev = load_examples(cfg, seed=0)
    assert len(train) + len(ev) == 10 and len(ev) == 2
    assert sum(bool(r["messages"]) for r in list(train) + list(ev)) == 4


def test_empty_and_missing_files_fail(tmp_path):
    (tmp_path / "empty.jsonl").write_text(json.dumps({"text": "   "}) + "\n")
    with pytest.raises(DataError, match="empty"):
        load_examples(_cfg([tmp_path / "empty.jsonl"]), seed=0)
    with pytest.raises(DataError, match="does not exist"):
        load_examples(_cfg([tmp_path / "nope.jsonl"]), seed=0)
    with pytest.raises(DataError, match="no training data"):
        load_examples(_cfg([]), seed=0)


def test_tokenize_pads_or_packs(tmp_path):
    from datasets import Dataset

    from test_train import char_tokenizer
    from hispec.distill.data import tokenize

    tok = char_tokenizer()
    ds = Dataset.from_list([{"messages": [], "text": "abcdefghij"}, {"messages": [{"role": "user", "content": "xy"}],
                                                                    "text": ""}])
    plain = tokenize(ds, tok, max_seq_length=6)
    assert [len(r["input_ids"]) for r in plain] == [6, 6]  # "abcdef" and "<user>xy\n" truncated
    packed = tokenize(ds, tok, max_seq_length=4, packing=True)
    assert all(len(r["input_ids"]) == 4 for r in packed) and len(packed) == (10 + 1 + 9 + 1) // 4
    batch = PadCollator(pad_id=1)([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_epoch_sampler_order_depends_only_on_seed_and_epoch():
    a, b = EpochSampler(20, seed=3), EpochSampler(20, seed=3)
    first = list(a)
    assert first == list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == list(range(20))
    b.set_epoch(1)
    assert list(a) == list(b)


# ---------------------------------------------------------------------------------------------------- plain text
def test_plain_text_sources_keep_whole_chats_pairs_and_text(tmp_path):
    from hispec.distill.data import load_plain_text

    (tmp_path / "gsm.jsonl").write_text("".join(json.dumps({"question": f"q{i}?", "answer": f"a{i}"}) + "\n"
                                                for i in range(5)))
    chats = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                                {"from": "human", "value": "more"}, {"from": "gpt", "value": "sure"}]}]
    (tmp_path / "chat.json").write_text(json.dumps(chats))
    (tmp_path / "notes.txt").write_text("first line\n\nsecond line\n")
    cfg = _cfg([], plain_text_file=[str(tmp_path / f) for f in ("gsm.jsonl", "chat.json", "notes.txt")],
               text_column="question", messages_column="conversations", plain_text_answer_column="answer",
               plain_text_max_samples_per_file=3)
    ds = load_plain_text(cfg, seed=0)
    rows = list(ds)
    assert len(rows) == 3 + 1 + 2
    pairs = [r["messages"] for r in rows if len(r["messages"]) == 2]
    assert len(pairs) == 3 and all(p[0]["role"] == "user" and p[1]["role"] == "assistant" for p in pairs)
    assert [len(r["messages"]) for r in rows].count(4) == 1  # every turn of the conversation is kept
    assert sorted(r["text"] for r in rows if not r["messages"]) == ["first line", "second line"]
    assert load_plain_text(_cfg([]), seed=0) is None
    (tmp_path / "odd.jsonl").write_text(json.dumps({"x": 1}) + "\n")
    with pytest.raises(DataError, match="plain-text file .*odd.jsonl has neither"):
        load_plain_text(_cfg([], plain_text_file=[str(tmp_path / "odd.jsonl")]), seed=0)


def test_loss_on_assistant_masks_exactly_the_reply_predictions():
    from datasets import Dataset

    from test_train import char_tokenizer
    from hispec.distill.data import tokenize

    tok = char_tokenizer()
    msgs = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"},
            {"role": "user", "content": "cd"}, {"role": "assistant", "content": "e"}]
    ds = Dataset.from_list([{"messages": msgs, "text": ""}, {"messages": [], "text": "plain"},
                            {"messages": msgs[:1], "text": ""}])
    rendered = "<user>ab\n<assistant>cd\n<user>cd\n<assistant>e\n"
    out = tokenize(ds, tok, max_seq_length=64, loss_on="assistant")
    assert len(out) == 2  # the user-only chat has no loss position and is dropped
    ids, mask = out[0]["input_ids"], out[0]["loss_mask"]
    assert len(ids) == len(rendered)
    on = [i for i, m in enumerate(mask) if m]
    c = rendered.index("cd")  # the reply, not the user's later "cd"
    e = rendered.rindex("e\n")
    assert on == [c - 1, c, c + 1, e - 1, e]  # predict each reply token and the token closing it
    assert all(out[1]["loss_mask"])  # plain text keeps every position
    full = tokenize(ds, tok, max_seq_length=64)
    assert all(all(r["loss_mask"]) for r in full) and len(full) == 3
    packed = tokenize(ds, tok, max_seq_length=8, packing=True, loss_on="assistant")
    assert all(len(r["loss_mask"]) == 8 for r in packed)
    with pytest.raises(DataError, match="unknown loss_on"):
        tokenize(ds, tok, max_seq_length=8, loss_on="user")


def test_pad_collator_pads_the_loss_mask():
    batch = PadCollator(pad_id=0)([{"input_ids": [5, 6, 7], "loss_mask": [False, True, True]},
                                   {"input_ids": [8], "loss_mask": [True]}])
    assert batch["loss_mask"].dtype == torch.bool
    assert batch["loss_mask"].tolist() == [[False, True, True], [True, False, False]]


# ---------------------------------------------------------------------------------------------------- self prompts
def test_self_prompt_filters_and_dedup():
    from hispec.distill.self_prompts import TASK_CUES, DedupIndex, normalize_text, reject_reason

    assert len(TASK_CUES) >= 50 and len(set(TASK_CUES)) == len(TASK_CUES)
    ok = "Write a Python function that reverses a linked list in place."
    assert reject_reason(ok, True, 9) is None
    assert reject_reason(ok, False, 9) == "unfinished"
    assert reject_reason("Explain it.", True, 1) == "too short"
    assert reject_reason("Tell me more more more more more more more more more more more", True, 12) == "repetition"
    assert reject_reason("1234 5678 9999 0000 1111 2222 ++++", True, 7) == "not text"
    assert reject_reason(ok, True, 9, special=True) == "special token"
    d = DedupIndex()
    assert d.check_and_add(ok) is None
    assert d.check_and_add("write a python function that REVERSES a linked list, in place!") == "duplicate"
    assert d.check_and_add("Write a Python function that reverses a linked list in place using recursion.") \
        == "near duplicate"
    assert d.check_and_add("Write a Python function that parses a CSV file and sums the second column.") is None
    assert normalize_text("  Hello,   World! ") == "hello world"


def test_chat_prefix_and_stop_tokens():
    from test_train import char_tokenizer
    from hispec.distill.self_prompts import chat_prefix, stop_token_ids

    tok = char_tokenizer()
    assert chat_prefix(tok) == "<user>"
    assert chat_prefix(tok, system="Be brief.") == "<system>Be brief.\n<user>"
    assert stop_token_ids(tok) == [tok.eos_token_id]


def test_held_out_prompts_are_dropped_from_plain_text():
    from datasets import Dataset

    from hispec.distill.data import drop_overlap

    plain = Dataset.from_list([
        {"messages": [{"role": "user", "content": "What is  2+2?"}, {"role": "assistant", "content": "4"}], "text": ""},
        {"messages": [], "text": "Name a colour."},
        {"messages": [{"role": "user", "content": "Keep me"}], "text": ""}])
    held = Dataset.from_list([{"messages": [{"role": "user", "content": "what is 2+2?"}], "text": ""},
                              {"messages": [], "text": "name a  colour."}])
    kept = drop_overlap(plain, held)
    assert [r["messages"][0]["content"] for r in kept] == ["Keep me"]
    assert drop_overlap(plain, None) is plain
