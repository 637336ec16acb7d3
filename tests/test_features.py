"""Feature cache (hispec/distill/features.py) on a tiny random model: shard contents equal the backbone's own exit states
and final-layer top-k, batching does not change them, resume after a kill equals a straight build, a cache made
for other data / missing layers is refused (one holding more layers is reused, also while resuming), the manifest
comes last, the reader / collator rebuild the sequences, and the final layer's raw residual (what context heads
read) is stored as hidden.<num_layers>."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from tiny import tiny_model
from hispec.distill.features import (
    MANIFEST,
    PLAN,
    CachedCollator,
    CachedSequences,
    FeatureCacheError,
    build_feature_cache,
    check_cache_layers,
    model_identity,
    open_feature_cache,
)


@pytest.fixture(scope="module")
def adapter():
    from hispec.layers import DecoderAdapter

    return DecoderAdapter(tiny_model("llama"))


def _sequences(n=7, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        L = rng.randint(3, 12)
        ids = [rng.randrange(2, 97) for _ in range(L)]
        mask = [rng.random() < 0.7 for _ in range(L)]
        mask[0] = True
        out.append({"input_ids": ids, "loss_mask": mask})
    return out


def _shards(folder):
    return sorted(p.name for p in folder.glob("shard-*.safetensors"))


def test_shards_hold_exit_states_and_teacher_topk(adapter, tmp_path):
    seqs = _sequences()
    man = build_feature_cache(adapter, seqs, tmp_path / "c", layers=(2, 4), k=5, shard_tokens=20, batch_tokens=24,
                              show_progress=False, extra={"note": "x"})
    assert man == open_feature_cache(tmp_path / "c")
    assert man["layers"] == [2, 4] and man["k"] == 5 and man["hidden_dtype"] == "bfloat16"
    assert man["num_sequences"] == 7 and man["num_tokens"] == sum(len(s["input_ids"]) for s in seqs)
    assert man["num_loss_tokens"] == sum(sum(s["loss_mask"]) for s in seqs) and man["extra"] == {"note": "x"}
    assert len(man["shards"]) > 1 and _shards(tmp_path / "c") == [s["file"] for s in man["shards"]]
    assert man["model"]["num_hidden_layers"] == 6 and man["model"]["weights"]

    model = adapter.model
    j = 0
    for shard in man["shards"]:
        t = load_file(str(tmp_path / "c" / shard["file"]))
        assert t["input_ids"].dtype == torch.int32 and t["offsets"].dtype == torch.int64
        assert t["loss_mask"].dtype == torch.bool and t["hidden.2"].dtype == torch.bfloat16
        assert t["teacher_topk_ids"].dtype == torch.int32 and t["teacher_topk_logprobs"].dtype == torch.float32
        off = t["offsets"].tolist()
        for a, b in zip(off[:-1], off[1:]):
            s = seqs[j]
            j += 1
            ids = torch.tensor([s["input_ids"]])
            assert t["input_ids"][a:b].tolist() == s["input_ids"] and t["loss_mask"][a:b].tolist() == s["loss_mask"]
            with torch.no_grad():
                out = model(ids, output_hidden_states=True)
            for layer in (2, 4):  # hs[l]: the residual after l layers, the convention of the exits
                torch.testing.assert_close(t[f"hidden.{layer}"][a:b].float(),
                                           out.hidden_states[layer][0].bfloat16().float(), rtol=0, atol=1e-2)
            ref_lp, ref_ids = torch.log_softmax(out.logits[0].float(), -1).topk(5, -1)
            assert torch.equal(t["teacher_topk_ids"][a:b].long(), ref_ids)
            torch.testing.assert_close(t["teacher_topk_logprobs"][a:b], ref_lp, rtol=1e-4, atol=1e-5)
    assert j == 7


def test_batching_does_not_change_the_features(adapter, tmp_path):
    seqs = _sequences(5, seed=1)
    kw = dict(layers=(3,), k=4, hidden_dtype="fp32", show_progress=False)
    one = build_feature_cache(adapter, seqs, tmp_path / "one", batch_tokens=1, **kw)  # one sequence per pass
    many = build_feature_cache(adapter, seqs, tmp_path / "many", batch_tokens=1000, **kw)  # padded together
    a = load_file(str(tmp_path / "one" / one["shards"][0]["file"]))
    b = load_file(str(tmp_path / "many" / many["shards"][0]["file"]))
    torch.testing.assert_close(a["hidden.3"], b["hidden.3"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a["teacher_topk_logprobs"], b["teacher_topk_logprobs"], rtol=1e-5, atol=1e-5)


class _Killed(Exception):
    pass


def test_resume_after_kill_equals_straight_build(adapter, tmp_path, monkeypatch):
    import hispec.distill.features as tf

    seqs = _sequences(9, seed=2)
    kw = dict(layers=(2, 4), k=3, shard_tokens=16, show_progress=False)
    straight = build_feature_cache(adapter, seqs, tmp_path / "straight", **kw)
    assert len(straight["shards"]) >= 3

    def kill_after_1(i):
        if i == 1:
            raise _Killed

    monkeypatch.setattr(tf, "_shard_hook", kill_after_1)
    with pytest.raises(_Killed):
        build_feature_cache(adapter, seqs, tmp_path / "killed", **kw)
    monkeypatch.undo()
    killed = tmp_path / "killed"
    assert (killed / PLAN).is_file() and not (killed / MANIFEST).exists()
    assert _shards(killed) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    with pytest.raises(FeatureCacheError, match="no manifest.json"):
        CachedSequences(killed)
    first = (killed / "shard-00000.safetensors").stat().st_mtime_ns
    (killed / "shard-00001.safetensors").write_bytes(b"torn")  # a damaged shard is rebuilt
    (killed / ".shard-00002.safetensors.tmp-99999").write_bytes(b"half")  # a killed write's leftover is removed
    resumed = build_feature_cache(adapter, seqs, killed, **kw)
    assert (killed / "shard-00000.safetensors").stat().st_mtime_ns == first  # kept, not rebuilt
    assert resumed["fingerprint"] == straight["fingerprint"] and _shards(killed) == _shards(tmp_path / "straight")
    for name in _shards(killed):
        x, y = load_file(str(killed / name)), load_file(str(tmp_path / "straight" / name))
        assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)
    assert not list(killed.glob(".*tmp*"))


def test_cache_for_other_data_or_settings_is_refused_and_a_match_reused(adapter, tmp_path):
    seqs = _sequences(4, seed=3)
    folder = tmp_path / "c"
    kw = dict(k=3, show_progress=False)
    man = build_feature_cache(adapter, seqs, folder, layers=(2, 4), **kw)
    stamp = (folder / MANIFEST).stat().st_mtime_ns
    assert build_feature_cache(adapter, seqs, folder, layers=(2, 4), **kw) == man  # reused as is
    assert (folder / MANIFEST).stat().st_mtime_ns == stamp
    other = [dict(s) for s in seqs]
    other[0] = {"input_ids": other[0]["input_ids"][:-1], "loss_mask": other[0]["loss_mask"][:-1]}
    with pytest.raises(FeatureCacheError, match="sequences differ"):
        build_feature_cache(adapter, other, folder, layers=(2, 4), **kw)
    with pytest.raises(FeatureCacheError, match="layers"):
        build_feature_cache(adapter, seqs, folder, layers=(1, 4), **kw)
    ident = dict(model_identity(adapter.model), weights="0" * 16)
    with pytest.raises(FeatureCacheError, match="model weights"):
        build_feature_cache(adapter, seqs, folder, layers=(2, 4), identity=ident, **kw)
    with pytest.raises(FeatureCacheError, match="caches layers"):
        CachedSequences(folder, layers=(3,))
    for bad, msg in ((dict(layers=(7,)), "must be in 1..6"), (dict(layers=(2,), k=98), "k must be in"),
                     (dict(layers=(2,), hidden_dtype="int8"), "unknown hidden dtype")):
        with pytest.raises(FeatureCacheError, match=msg):
            build_feature_cache(adapter, seqs, tmp_path / "bad", **{"k": 3, "show_progress": False, **bad})
    with pytest.raises(FeatureCacheError, match="no sequences"):
        build_feature_cache(adapter, [], tmp_path / "bad", layers=(2,), show_progress=False)


def test_a_cache_with_more_layers_serves_fewer_and_the_final_residual_is_stored(adapter, tmp_path):
    """Layers (2, 4, 6 = num_layers) once: a run asking for (2, 4) reuses it as is; hidden.6 is the raw residual
    after the last layer (before the final norm), as `exit_states` saves it."""
    from hispec.distill.losses import exit_states

    seqs = _sequences(5, seed=5)
    folder = tmp_path / "c"
    man = build_feature_cache(adapter, seqs, folder, layers=(2, 4, 6), k=3, show_progress=False)
    stamp = (folder / MANIFEST).stat().st_mtime_ns
    assert build_feature_cache(adapter, seqs, folder, layers=(2, 4), k=3, show_progress=False) == man
    assert (folder / MANIFEST).stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert check_cache_layers(folder, (2, 4)) == [2, 4, 6] and check_cache_layers(tmp_path / "none", (2,)) is None
    ds = CachedSequences(folder, layers=(2, 6))
    item = ds[0]
    ids = torch.tensor([seqs[0]["input_ids"]])
    with torch.no_grad():
        saved, final = exit_states(adapter, ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids).bool(), (6,))
    torch.testing.assert_close(item["hidden.6"].float(), saved[6][0], rtol=1e-2, atol=1e-2)  # bf16
    assert not torch.allclose(saved[6], final)  # the raw residual, not the normed features
    with pytest.raises(FeatureCacheError, match=r"not hidden\.5 \(who\); rebuild it"):
        check_cache_layers(folder, (2, 5), need="who")


def test_resuming_a_partly_built_cache_of_more_layers_builds_all_of_them(adapter, tmp_path, monkeypatch):
    import hispec.distill.features as tf

    seqs = _sequences(9, seed=6)
    kw = dict(k=3, shard_tokens=16, show_progress=False)

    def kill_after_0(i):
        if i == 0:
            raise _Killed

    monkeypatch.setattr(tf, "_shard_hook", kill_after_0)
    with pytest.raises(_Killed):
        build_feature_cache(adapter, seqs, tmp_path / "c", layers=(2, 4, 6), **kw)
    monkeypatch.undo()
    assert check_cache_layers(tmp_path / "c", (2, 6)) == [2, 4, 6]  # a partly built cache is checked too
    with pytest.raises(FeatureCacheError, match=r"not hidden\.3"):
        check_cache_layers(tmp_path / "c", (2, 3))
    man = build_feature_cache(adapter, seqs, tmp_path / "c", layers=(2, 4), **kw)  # a linear run resumes it
    assert man["layers"] == [2, 4, 6]
    straight = build_feature_cache(adapter, seqs, tmp_path / "s", layers=(2, 4, 6), **kw)
    assert man["fingerprint"] == straight["fingerprint"]
    for name in _shards(tmp_path / "s"):
        x, y = load_file(str(tmp_path / "c" / name)), load_file(str(tmp_path / "s" / name))
        assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def test_reader_and_collator_rebuild_sequences(adapter, tmp_path):
    seqs = _sequences(6, seed=4)
    build_feature_cache(adapter, seqs, tmp_path / "c", layers=(2, 4), k=3, shard_tokens=15, show_progress=False)
    ds = CachedSequences(tmp_path / "c", layers=(4,))
    assert len(ds) == 6
    item = ds[5]
    assert item["input_ids"].tolist() == seqs[5]["input_ids"] and "hidden.2" not in item
    assert item["hidden.4"].shape == (len(seqs[5]["input_ids"]), 32) and item["teacher_topk_ids"].shape[1] == 3
    batch = CachedCollator()([ds[1], ds[3]])
    n1, n3 = len(seqs[1]["input_ids"]), len(seqs[3]["input_ids"])
    assert batch["offsets"].tolist() == [0, n1, n1 + n3]
    assert batch["row"].tolist() == [0] * n1 + [1] * n3
    assert batch["labels"].tolist() == seqs[1]["input_ids"][1:] + [-100] + seqs[3]["input_ids"][1:] + [-100]
    assert batch["loss_mask"].tolist() == seqs[1]["loss_mask"] + seqs[3]["loss_mask"]
    man = json.loads((tmp_path / "c" / MANIFEST).read_text())
    assert sum(s["sequences"] for s in man["shards"]) == 6


@pytest.mark.real_model
def test_smollm2_cache_matches_the_models_own_hidden_states(demo_model_dir, tmp_path):
    """On the real model: cached exits 4 and 8 are HF's hidden_states[4] / [8] and the teacher is its logits."""
    from hispec.layers import DecoderAdapter
    from hispec.model import load_base_model, load_tokenizer

    model = load_base_model(str(demo_model_dir))
    tok = load_tokenizer(str(demo_model_dir))
    texts = ["The capital of France is Paris.", "def add(a, b):\n    return a + b"]
    seqs = [{"input_ids": tok(t)["input_ids"], "loss_mask": [True] * len(tok(t)["input_ids"])} for t in texts]
    man = build_feature_cache(DecoderAdapter(model), seqs, tmp_path / "c", layers=(4, 8), k=64,
                              identity=model_identity(model, "smollm2"), show_progress=False)
    assert man["model"]["num_hidden_layers"] == 30 and man["model"]["vocab_size"] == 49152
    t = load_file(str(tmp_path / "c" / man["shards"][0]["file"]))
    off = t["offsets"].tolist()
    for j, s in enumerate(seqs):
        with torch.no_grad():
            out = model(torch.tensor([s["input_ids"]]), output_hidden_states=True)
        a, b = off[j], off[j + 1]
        for layer in (4, 8):
            ref = out.hidden_states[layer][0]
            err = (t[f"hidden.{layer}"][a:b].float() - ref).abs().max() / ref.abs().max()
            assert err < 1e-2  # bf16 storage
        assert torch.equal(t["teacher_topk_ids"][a:b, 0].long(), out.logits[0].argmax(-1))
