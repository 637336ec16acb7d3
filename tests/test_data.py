"""Training data (train/data.py): file formats, chat layouts, column errors, splits, packing, epoch order."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from train.data import DataError, EpochSampler, PadCollator, load_examples, normalize_messages, prompt_of


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
    from train.data import tokenize

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
