"""Growing a feature cache (hispec/distill/feature_reuse.py): a new cache built with `reuse=[earlier caches]` copies
the sequences they already hold (same tokens AND loss mask) and runs the backbone over the rest only; the result
equals a cache built from scratch; a cache of another model, dtype, fewer layers or fewer teacher tokens is refused
by name; a killed build with reuse resumes to the same shards; the training run's settings are checked before work."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from test_train import env, fresh_accelerate_state, pairs_file  # noqa: F401
from tiny import tiny_model
from hispec.distill.features import FeatureCacheError, build_feature_cache, model_identity


@pytest.fixture(scope="module")
def adapter():
    from hispec.layers import DecoderAdapter

    return DecoderAdapter(tiny_model("llama"))


def _sequences(n, seed):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        L = rng.randint(3, 12)
        mask = [rng.random() < 0.7 for _ in range(L)]
        mask[0] = True
        out.append({"input_ids": [rng.randrange(2, 97) for _ in range(L)], "loss_mask": mask})
    return out


def _by_sequence(folder):
    """{(ids, mask): {tensor name: rows}} over every shard of a complete cache."""
    man = json.loads((folder / "manifest.json").read_text())
    out = {}
    for s in man["shards"]:
        t = load_file(str(folder / s["file"]))
        off = t["offsets"].tolist()
        for a, b in zip(off[:-1], off[1:]):
            key = (tuple(t["input_ids"][a:b].tolist()), tuple(t["loss_mask"][a:b].tolist()))
            out[key] = {k: v[a:b] for k, v in t.items() if k not in ("offsets", "input_ids", "loss_mask")}
    return out


def _counting(monkeypatch):
    """Record every sequence the backbone runs over (the cache builder's frozen pass)."""
    import hispec.distill.features as tf

    seen, real = [], tf.frozen_batches

    def counting(adapter, rows, *a, **kw):
        seen.extend(tuple(r) for r in rows)
        yield from real(adapter, rows, *a, **kw)

    monkeypatch.setattr(tf, "frozen_batches", counting)
    return seen


def test_a_grown_cache_copies_what_the_earlier_one_holds_and_equals_a_fresh_build(adapter, tmp_path, monkeypatch):
    old_seqs, new_seqs = _sequences(6, seed=0), _sequences(5, seed=1)
    changed = dict(old_seqs[2], loss_mask=[True] + [not m for m in old_seqs[2]["loss_mask"][1:]])  # same tokens
    grown = old_seqs[3:] + new_seqs[:2] + [changed] + old_seqs[:2] + new_seqs[2:]  # a new order, new shard cuts
    old = build_feature_cache(adapter, old_seqs, tmp_path / "old", layers=(2, 4, 6), k=6, hidden_dtype="fp32",
                              shard_tokens=20, show_progress=False)
    fresh = build_feature_cache(adapter, grown, tmp_path / "fresh", layers=(2, 4), k=4, hidden_dtype="fp32",
                                shard_tokens=25, show_progress=False)
    assert fresh["reused_tokens"] == 0

    seen = _counting(monkeypatch)
    man = build_feature_cache(adapter, grown, tmp_path / "grown", layers=(2, 4), k=4, hidden_dtype="fp32",
                              shard_tokens=25, show_progress=False, reuse=[tmp_path / "old"])
    copied = old_seqs[3:] + old_seqs[:2]
    assert sorted(seen) == sorted(tuple(s["input_ids"]) for s in new_seqs + [changed])  # only the new ones ran
    assert man["reused_tokens"] == sum(len(s["input_ids"]) for s in copied) > 0
    assert sum(s["reused_tokens"] for s in man["shards"]) == man["reused_tokens"]
    assert man["fingerprint"] == fresh["fingerprint"] and man["num_tokens"] == fresh["num_tokens"]
    assert man["layers"] == [2, 4] and man["k"] == 4 and old["k"] == 6

    got, want, src = _by_sequence(tmp_path / "grown"), _by_sequence(tmp_path / "fresh"), _by_sequence(tmp_path / "old")
    assert got.keys() == want.keys() and len(got) == len(grown)
    for key, rows in got.items():
        assert sorted(rows) == sorted(want[key])
        for name, t in rows.items():  # fp32 states: a different batch changes nothing beyond float noise
            torch.testing.assert_close(t, want[key][name], rtol=1e-5, atol=1e-5)
        if key in src:  # copied rows are the earlier cache's, bit for bit (its top-6 cut to the top-4)
            assert torch.equal(rows["hidden.2"], src[key]["hidden.2"])
            assert torch.equal(rows["teacher_topk_ids"], src[key]["teacher_topk_ids"][:, :4])
            assert torch.equal(rows["teacher_topk_logprobs"], src[key]["teacher_topk_logprobs"][:, :4])


class _Killed(Exception):
    pass


def test_a_killed_build_with_reuse_resumes_to_the_same_shards(adapter, tmp_path, monkeypatch):
    import hispec.distill.features as tf

    seqs = _sequences(10, seed=3)
    kw = dict(layers=(2, 4), k=3, shard_tokens=16, show_progress=False)
    build_feature_cache(adapter, seqs[:6], tmp_path / "old", **kw)
    straight = build_feature_cache(adapter, seqs, tmp_path / "straight", reuse=[tmp_path / "old"], **kw)

    def kill_after_1(i):
        if i == 1:
            raise _Killed

    monkeypatch.setattr(tf, "_shard_hook", kill_after_1)
    with pytest.raises(_Killed):
        build_feature_cache(adapter, seqs, tmp_path / "killed", reuse=[tmp_path / "old"], **kw)
    monkeypatch.undo()
    resumed = build_feature_cache(adapter, seqs, tmp_path / "killed", reuse=[tmp_path / "old"], **kw)
    assert resumed["shards"] == straight["shards"] and resumed["reused_tokens"] == straight["reused_tokens"] > 0
    for s in straight["shards"]:
        x, y = load_file(str(tmp_path / "killed" / s["file"])), load_file(str(tmp_path / "straight" / s["file"]))
        assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def test_a_cache_that_cannot_serve_is_refused_by_name(adapter, tmp_path):
    seqs = _sequences(4, seed=4)
    kw = dict(shard_tokens=64, show_progress=False)
    build_feature_cache(adapter, seqs, tmp_path / "old", layers=(2, 4), k=3, **kw)
    other = dict(model_identity(adapter.model), weights="0" * 16)
    build_feature_cache(adapter, seqs, tmp_path / "other_model", layers=(2, 4), k=3, identity=other, **kw)
    (tmp_path / "empty").mkdir()
    cases = [
        (dict(layers=(2, 4), k=3, reuse=[tmp_path / "other_model"]), "weights"),
        (dict(layers=(2, 5), k=3, reuse=[tmp_path / "old"]), r"lack \[5\]"),
        (dict(layers=(2, 4), k=5, reuse=[tmp_path / "old"]), "k 3 != 5"),
        (dict(layers=(2, 4), k=3, hidden_dtype="fp32", reuse=[tmp_path / "old"]), "hidden_dtype"),
        (dict(layers=(2, 4), k=3, reuse=[tmp_path / "empty"]), "no complete feature cache"),
    ]
    for i, (args, message) in enumerate(cases):
        with pytest.raises(FeatureCacheError, match=message):
            build_feature_cache(adapter, seqs, tmp_path / f"new{i}", **kw, **args)
        assert not list((tmp_path / f"new{i}").glob("shard-*"))  # refused before any shard


def test_reuse_settings_are_checked_before_any_work(tmp_path):
    from hispec.distill.args import ConfigError, DataArguments, ModelArguments, TrainArguments
    from hispec.distill.feature_reuse import ReuseError, check_reusable
    from hispec.distill.run_cache import check_feature_cache, validate_cache_args

    t = TrainArguments()
    with pytest.raises(ConfigError, match="set feature_cache too"):
        validate_cache_args(DataArguments(feature_cache_reuse=[str(tmp_path)]), t)
    with pytest.raises(ConfigError, match="is not a folder"):
        validate_cache_args(DataArguments(feature_cache=str(tmp_path / "c"), feature_cache_reuse=["/nonexistent/x"]), t)
    (tmp_path / "c" / "train").mkdir(parents=True)
    with pytest.raises(ConfigError, match="inside"):
        validate_cache_args(DataArguments(feature_cache=str(tmp_path / "c"),
                                          feature_cache_reuse=[str(tmp_path / "c" / "train")]), t)
    old = tmp_path / "old" / "train"
    old.mkdir(parents=True)
    (old / "manifest.json").write_text(json.dumps({"layers": [2, 4], "k": 8, "hidden_dtype": "bfloat16"}))
    check_reusable([tmp_path / "old"], [2, 4], 8, "bfloat16")
    with pytest.raises(ReuseError, match="top-8, fewer than k=16"):
        check_reusable([tmp_path / "old"], [2, 4], 16, "bfloat16")
    d = DataArguments(feature_cache=str(tmp_path / "new"), feature_cache_reuse=[str(tmp_path / "old")],
                      feature_cache_k=8)
    m = ModelArguments(model_name_or_path="x")
    check_feature_cache(m, d, (2, 4), 6)
    with pytest.raises(ConfigError, match=r"lacks layers \[3\]"):
        check_feature_cache(m, d, (2, 3), 6)


def test_the_data_job_grows_into_a_new_cache_reusing_the_old(env, pairs_file, tmp_path, capsys):  # noqa: F811
    """train/heads.py --data_only: 4 teacher-forced pairs cached, then all 10 into a new folder with
    --feature_cache_reuse: the sequences of the first cache are copied, the new cache equals a fresh build."""
    from test_train import _cache_argv, _run

    old, new, fresh, out = (tmp_path / x for x in ("old", "new", "fresh", "run"))
    assert _run(_cache_argv(env, out, old, pairs_file, "--data_only", "true",
                            "--plain_text_max_samples_per_file", "4")) == 0
    assert _run(_cache_argv(env, out, fresh, pairs_file, "--data_only", "true")) == 0
    capsys.readouterr()
    assert _run(_cache_argv(env, out, new, pairs_file, "--data_only", "true", "--feature_cache_reuse",
                            str(old))) == 0
    kept = {**_by_sequence(old / "train"), **_by_sequence(old / "eval")}
    for split in ("train", "eval"):
        man = json.loads((new / split / "manifest.json").read_text())
        got, want = _by_sequence(new / split), _by_sequence(fresh / split)
        assert got.keys() == want.keys()
        assert man["reused_tokens"] == sum(len(key[0]) for key in got if key in kept)
        for key, rows in got.items():
            for name, t in rows.items():
                torch.testing.assert_close(t.float(), want[key][name].float(), rtol=0, atol=2e-2)
    reused = sum(json.loads((new / s / "manifest.json").read_text())["reused_tokens"] for s in ("train", "eval"))
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["feature_cache"]  # the data job's summary
    assert info["train_reused_tokens"] + info["eval_reused_tokens"] == reused and info["reused_from"] == [str(old)]
    assert reused >= sum(len(key[0]) for key in kept) * 0.9 > 0  # (nearly) all of the old cache was copied
    (tmp_path / "nothing").mkdir()
    for folder, message in ((tmp_path / "nothing", "holds no complete feature cache"),
                            (tmp_path / "nowhere", "is not a folder"), (new / "train", "inside")):
        with pytest.raises(ValueError, match=message):  # refused before the model loads
            _run(_cache_argv(env, out, new, pairs_file, "--data_only", "true", "--feature_cache_reuse", str(folder)))
