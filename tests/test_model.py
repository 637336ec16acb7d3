"""`hispec.EarlyExitModel` and the checkpoint format (design.md §5) on tiny random models of every family.

Heads start as the model's own final norm; layers and head types are validated; `save()` -> `hispec.load()`
round-trips exactly, writes atomically and produces a folder stock transformers loads as the base; checkpoints
that do not fit their base, are corrupt, or are not hispec checkpoints at all are refused with `CheckpointError`.
Only the `real_model` tests need the demo model.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hispec
import hispec.model
from hispec import CheckpointError, EarlyExitModel, packed
from hispec.drafters.heads import HEAD_TYPES
from hispec.model import HEADS_FILE, default_exits
from tiny import FAMILIES, tiny_config, tiny_model

RANK = 8  # lowrank heads: the tiny models have hidden size 32


def _wrap(family="llama", head_type="linear", draft=2, verify=4, **kwargs) -> EarlyExitModel:
    rank = RANK if head_type == "lowrank" else None
    return EarlyExitModel.from_base(tiny_model(family), draft, verify, head_type=head_type, head_rank=rank, **kwargs)


def _perturb_heads(model: EarlyExitModel, seed: int = 0) -> None:
    """Give every head tensor a random value, so a round trip that drops or swaps one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.1)


def _ids(model: EarlyExitModel, t: int = 9) -> torch.Tensor:
    return torch.randint(2, model.adapter.vocab_size, (2, t), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _exit_and_base_logits(model: EarlyExitModel, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits of both heads (at their exits) and of the base model itself for `ids` `[B, T]`."""
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    ad = model.adapter
    _, saved = ad.forward_all(ids, pos, ad.new_cache(ids.shape[0]),
                              exits=(model.draft_layer, model.verify_layer, model.num_layers))
    def run(name):  # `layer` heads attend over the sequence: run them over it with a fresh cache
        head = model.heads[name]
        return head.run_layer_fresh(ad) if head.stateful else None

    def ctx(name):  # `context` heads read earlier positions' deeper states: the full model verified up to t - 1
        head = model.heads[name]
        return head.sequence_context(saved, 1, 2) if head.needs_context else None

    return {
        "draft": model.exit_logits("draft", saved[model.draft_layer], run_layer=run("draft"), context=ctx("draft")),
        "verify": model.exit_logits("verify", saved[model.verify_layer], run_layer=run("verify"),
                                    context=ctx("verify")),
        "base": model.base(input_ids=ids).logits,
    }


def _assert_same_heads(a: EarlyExitModel, b: EarlyExitModel) -> None:
    sa, sb = a.heads_state_dict(), b.heads_state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k


def _leftovers(parent: pathlib.Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


# ---------------------------------------------------------------- heads

@pytest.mark.parametrize("family", list(FAMILIES))
def test_untrained_heads_of_every_type_start_exactly_as_the_shared_final_norm(family):
    base = tiny_model(family)
    ids = torch.randint(2, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    shared = EarlyExitModel.from_base(base, 2, 4, head_type="shared")
    want = _exit_and_base_logits(shared, ids)
    assert not torch.equal(want["draft"], want["verify"])
    for head_type in ("norm", "linear", "lowrank"):
        model = EarlyExitModel.from_base(base, 2, 4, head_type=head_type,
                                         head_rank=RANK if head_type == "lowrank" else None)
        got = _exit_and_base_logits(model, ids)
        for name in ("draft", "verify"):
            assert torch.equal(got[name], want[name]), (family, head_type, name)
        # the heads are really in the path: changing them changes the exit logits, never the base logits
        _perturb_heads(model)
        moved = _exit_and_base_logits(model, ids)
        assert not torch.allclose(moved["draft"], want["draft"])
        assert torch.equal(moved["base"], want["base"])


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_heads_never_hold_a_vocab_sized_tensor_and_only_heads_train(head_type):
    model = _wrap("opt", head_type)  # opt: hidden 32, projected to 16 before a 97-token lm_head
    vocab, hidden = model.adapter.vocab_size, model.adapter.hidden_size
    state = model.heads_state_dict()
    inter = max(hidden, getattr(model.adapter.config, "ffn_dim", 0) or getattr(model.adapter.config,
                                                                                "intermediate_size", 0) or 0)
    for name, tensor in list(state.items()) + [(n, b) for n, b in model.heads.named_buffers()]:
        assert vocab not in tensor.shape, name
        wide = {"layer": inter, "context": 2 * hidden}.get(head_type, hidden)  # a layer's / the context MLP's width
        assert tensor.numel() <= hidden * wide, name
    lm_head = model.base.get_output_embeddings().weight
    assert all(p.data_ptr() != lm_head.data_ptr() for p in model.heads.parameters())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"heads.{k}" for k in state}
    assert not any(p.requires_grad for p in model.base.parameters())
    expected = {
        "shared": set(),
        "norm": {"norm.weight", "norm.bias"},
        "linear": {"norm.weight", "norm.bias", "adapter.weight"},
        "lowrank": {"norm.weight", "norm.bias", "adapter.0.weight", "adapter.1.weight"},
        "layer": {"norm.weight", "norm.bias", "adapter.weight"}
        | {f"layer.{n}" for n, _ in model.adapter.parts.layers[0].named_parameters()},
        "context": {"norm.weight", "norm.bias", "ctx_kind", "ctx_rel", "ctx_q.weight", "ctx_k.weight", "ctx_v.weight",
                    "ctx_o.weight", "ctx_up.weight", "ctx_down.weight", "ctx_front.weight", "ctx_dist"}
        | {f"ctx_norms.{i}.{n}" for i in range(2) for n in ("weight", "bias")},
    }[head_type]
    for exit_name in ("draft", "verify"):
        assert {k.partition(".")[2] for k in state if k.startswith(exit_name + ".")} == expected
    if head_type == "lowrank":
        assert state["draft.adapter.0.weight"].shape == (RANK, hidden)
        assert torch.count_nonzero(state["draft.adapter.1.weight"]) == 0  # up-projection starts at zero
    if head_type == "linear":
        assert torch.count_nonzero(state["draft.adapter.weight"]) == 0


def test_shared_heads_have_nothing_to_save_and_follow_the_model_norm():
    model = _wrap("qwen3", "shared")
    assert model.heads_state_dict() == {}
    assert list(model.heads.parameters()) == []
    ids = _ids(model)
    before = _exit_and_base_logits(model, ids)["draft"]
    with torch.no_grad():
        model.adapter.final_norm.weight.mul_(2.0)  # a reference to the model's own norm, not a copy
    assert not torch.allclose(_exit_and_base_logits(model, ids)["draft"], before)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize(
    ("draft", "verify", "message"),
    [
        (0, 3, r"draft_layer 0 is out of range for a 6-layer model; choose 1\.\.5"),
        (3, 6, r"verify_layer 6 is out of range for a 6-layer model; choose 1\.\.5"),
        (2, 9, r"verify_layer 9 is out of range for a 6-layer model; choose 1\.\.5"),
        (-1, 3, r"draft_layer -1 is out of range for a 6-layer model; choose 1\.\.5"),
        (3, 3, r"draft_layer \(3\) must be below verify_layer \(3\): 1 <= L_d < L_i < 6"),
        (4, 2, r"draft_layer \(4\) must be below verify_layer \(2\): 1 <= L_d < L_i < 6"),
    ],
    ids=["zero", "verify-at-depth", "verify-past-depth", "negative", "equal", "reversed"],
)
def test_exit_layers_outside_1_le_draft_lt_verify_lt_depth_are_refused(draft, verify, message):
    with pytest.raises(ValueError, match=message):
        EarlyExitModel.from_base(tiny_model("llama"), draft, verify)


def test_unknown_head_type_and_bad_rank_are_refused():
    with pytest.raises(ValueError, match=r"unknown head type 'mlp'; choose one of shared, norm, linear, lowrank"):
        EarlyExitModel.from_base(tiny_model("llama"), 2, 4, head_type="mlp")
    with pytest.raises(ValueError, match=r"lowrank head rank 33 must be in 1\.\.32"):
        EarlyExitModel.from_base(tiny_model("llama"), 2, 4, head_type="lowrank", head_rank=33)


def test_default_exits_are_an_eighth_and_a_quarter_of_the_depth():
    assert default_exits(30) == (4, 8)
    assert default_exits(32) == (4, 8)
    assert default_exits(6) == (1, 2)
    assert default_exits(2) == (1, 2)  # verify == depth: from_base then refuses a 2-layer model clearly
    model = EarlyExitModel.from_base(tiny_model("gemma3"))
    assert (model.draft_layer, model.verify_layer) == (1, 2) and model.hispec_config.head_type == "linear"


# ---------------------------------------------------------------- save / load

@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_then_load_round_trips_exactly_and_stock_transformers_loads_the_base(family, tmp_path):
    model = _wrap(family, "linear", draft=1, verify=3, gamma=6, window=3)
    _perturb_heads(model)
    ids = _ids(model)
    want = _exit_and_base_logits(model, ids)
    out = model.save(tmp_path / "ckpt")
    assert out == tmp_path / "ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left behind

    loaded = hispec.load(out)
    assert (loaded.draft_layer, loaded.verify_layer) == (1, 3)
    assert loaded.hispec_config.gamma == 6 and loaded.hispec_config.window == 3
    assert loaded.dtype == torch.float32 and not loaded.base.training
    _assert_same_heads(model, loaded)
    got = _exit_and_base_logits(loaded, ids)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=0, msg=lambda m: f"{family} {k}: {m}")

    stock = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(stock) is type(model.base)
    with torch.no_grad():
        torch.testing.assert_close(stock(input_ids=ids).logits, want["base"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("head_type", HEAD_TYPES)
def test_every_head_type_round_trips(head_type, tmp_path):
    model = _wrap("mistral-sliding", head_type)
    _perturb_heads(model, seed=3)
    model.save(tmp_path / "ckpt")
    loaded = hispec.load(tmp_path / "ckpt")
    assert loaded.hispec_config.head_type == head_type
    assert loaded.hispec_config.head_rank == (RANK if head_type == "lowrank" else None)
    _assert_same_heads(model, loaded)
    ids = _ids(model)
    want, got = _exit_and_base_logits(model, ids), _exit_and_base_logits(loaded, ids)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=0)


def test_a_format_1_checkpoint_still_loads_and_decodes_the_same(tmp_path):
    """Format 1 wrote exits as {"draft": L, "verify": L} and vocabulary sizes at the top level."""
    model = _wrap("llama", "linear", draft=2, verify=4)
    model.save(tmp_path / "v2")
    cfg_path = tmp_path / "v2" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["hispec"].update(version=1, exits={"draft": 2, "verify": 4}, draft_vocab_size=None, verify_vocab_size=None)
    cfg_path.write_text(json.dumps(cfg))
    loaded = hispec.load(tmp_path / "v2")
    assert (loaded.draft_layer, loaded.verify_layer, loaded.hispec_config.version) == (2, 4, 1)
    ids = _ids(model)
    a = model.generate(ids, max_new_tokens=8, strategy="hispec")
    b = loaded.generate(ids, max_new_tokens=8, strategy="hispec")
    assert torch.equal(a.sequences, b.sequences)
    loaded.save(tmp_path / "again")  # re-saved in the current format
    assert json.loads((tmp_path / "again" / "config.json").read_text())["hispec"]["version"] == 2


def test_a_checkpoint_with_exits_this_version_cannot_load_is_refused_clearly(tmp_path):
    model = _wrap("llama", "linear", draft=2, verify=4)
    model.save(tmp_path / "c")
    cfg_path = tmp_path / "c" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["hispec"]["exits"].append({"name": "third", "layer": 5})
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(hispec.CheckpointError, match="loads exactly the exits"):
        hispec.load(tmp_path / "c")
    cfg["hispec"]["version"] = 99
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(hispec.CheckpointError, match="newer than this hispec"):
        hispec.load(tmp_path / "c")


def test_config_json_carries_one_hispec_key_with_exits_head_decoding_and_base(tmp_path):
    model = _wrap("qwen2", "lowrank", draft=2, verify=5, gamma=3, window=5)
    model.save(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["num_hidden_layers"] == 6  # still a plain HF config
    h = cfg["hispec"]
    assert h["version"] == hispec.model.FORMAT_VERSION
    assert h["exits"] == [{"name": "draft", "layer": 2, "vocab_size": None},
                          {"name": "verify", "layer": 5, "vocab_size": None}]
    assert h["head"]["type"] == "lowrank" and h["head"]["rank"] == RANK
    assert h["decoding"] == {"gamma": 3, "window": 5}
    assert h["heads_only"] is False
    base = h["base"]
    assert base["architectures"] == ["Qwen2ForCausalLM"]
    assert (base["num_hidden_layers"], base["hidden_size"], base["vocab_size"]) == (6, 32, 97)
    assert {"name_or_path", "revision", "model_type"} <= set(base)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert HEADS_FILE in names and "model.safetensors" in names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth"))]  # safetensors only
    heads = load_file(str(tmp_path / "ckpt" / HEADS_FILE))
    assert sorted(heads) == sorted(model.heads_state_dict())


def test_a_failing_save_leaves_no_folder_and_no_temporary_folder(tmp_path, monkeypatch):
    model = _wrap("llama")

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(hispec.model, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        model.save(tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []

    # overwriting: a failed save leaves the previous checkpoint untouched
    monkeypatch.undo()
    model.save(tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    monkeypatch.setattr(hispec.model, "save_file", disk_full)
    _perturb_heads(model)
    with pytest.raises(OSError, match="No space left"):
        model.save(tmp_path / "ckpt", overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    assert _leftovers(tmp_path, "ckpt") == []


def test_an_existing_folder_is_refused_unless_overwrite(tmp_path):
    model = _wrap("phi3")
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"ckpt already exists; pass overwrite=True"):
        model.save(target)
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]
    _perturb_heads(model)
    model.save(target, overwrite=True)
    assert not (target / "notes.txt").exists()  # replaced as a whole, not merged
    assert _leftovers(tmp_path, "ckpt") == []
    _assert_same_heads(model, hispec.load(target))


def test_heads_only_checkpoint_round_trips_onto_its_local_base_folder(tmp_path):
    base_dir = tmp_path / "base"
    tiny_model("llama").save_pretrained(base_dir)  # a local base folder (no tokenizer files)
    model = EarlyExitModel.from_base(str(base_dir), 2, 4, head_type="norm")
    assert model.hispec_config.base["name_or_path"] == str(base_dir)
    _perturb_heads(model)
    model.save(tmp_path / "heads", heads_only=True)
    assert sorted(p.name for p in (tmp_path / "heads").iterdir()) == ["config.json", HEADS_FILE]
    cfg = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert cfg["hispec"]["heads_only"] is True and cfg["hispec"]["base"]["name_or_path"] == str(base_dir)

    loaded = hispec.load(tmp_path / "heads")
    _assert_same_heads(model, loaded)
    ids = _ids(model)
    want, got = _exit_and_base_logits(model, ids), _exit_and_base_logits(loaded, ids)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=0)


# ---------------------------------------------------------------- refused checkpoints

@pytest.mark.parametrize(("field", "value"), [("num_hidden_layers", 8), ("hidden_size", 64), ("vocab_size", 128),
                                              ("architectures", ["MistralForCausalLM"])])
def test_heads_recorded_for_another_base_are_refused_naming_the_field(field, value, tmp_path):
    _wrap("llama").save(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["hispec"]["base"][field] = value
    path.write_text(json.dumps(cfg))
    expect = re.escape(f"{field}: heads expect {value!r}, model has ")
    with pytest.raises(CheckpointError, match=rf"were trained for base .* and do not fit this model .*{expect}"):
        hispec.load(tmp_path / "ckpt")


def test_heads_only_checkpoint_pointing_at_a_shallower_base_is_refused(tmp_path):
    model = _wrap("llama")
    model.hispec_config.base["name_or_path"] = "to-be-replaced"
    model.save(tmp_path / "heads", heads_only=True)
    config = tiny_config("llama")
    config.num_hidden_layers = 5
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other")
    path = tmp_path / "heads" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["hispec"]["base"]["name_or_path"] = str(tmp_path / "other")
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"num_hidden_layers: heads expect 6, model has 5"):
        hispec.load(tmp_path / "heads")


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_heads_file_is_refused_naming_the_file(damage, tmp_path):
    _wrap("qwen2-sliding").save(tmp_path / "ckpt")
    heads = tmp_path / "ckpt" / HEADS_FILE
    data = heads.read_bytes()
    heads.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x07not a safetensors file" * 10,
                       "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=rf"could not read heads file .*{HEADS_FILE}"):
        hispec.load(tmp_path / "ckpt")


def test_heads_file_that_does_not_fit_the_recorded_head_type_is_refused(tmp_path):
    _wrap("llama", "linear").save(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["hispec"]["head"]["type"] = "norm"
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"(?s)heads file .*{HEADS_FILE} does not fit these heads.*adapter"):
        hispec.load(tmp_path / "ckpt")


def test_plain_model_folder_and_gguf_file_are_not_hispec_checkpoints(tmp_path):
    tiny_model("opt").save_pretrained(tmp_path / "plain")
    with pytest.raises(CheckpointError, match=r"no 'hispec' entry in config.json: it is a plain model.*from_base"):
        hispec.load(tmp_path / "plain")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty is not a model folder: .*config.json does not exist"):
        hispec.load(tmp_path / "empty")
    with pytest.raises(CheckpointError, match=r"is a GGUF base model, not a hispec checkpoint; use .*from_base"):
        hispec.load(tmp_path / "model.gguf")


def test_newer_or_malformed_hispec_entry_is_refused(tmp_path):
    _wrap("llama").save(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["hispec"]["version"] = hispec.model.FORMAT_VERSION + 1
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"newer than this hispec.*upgrade"):
        hispec.load(tmp_path / "ckpt")
    del cfg["hispec"]["exits"]
    cfg["hispec"]["version"] = hispec.model.FORMAT_VERSION
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"malformed 'hispec' config entry"):
        hispec.load(tmp_path / "ckpt")


# ---------------------------------------------------------------- dtype

def test_dtype_is_selectable_at_wrap_and_at_load(tmp_path):
    model = _wrap("gemma2", "lowrank", dtype="bf16")
    assert model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.base.parameters())
    assert all(t.dtype == torch.bfloat16 for t in model.heads_state_dict().values())
    ids = _ids(model)
    assert _exit_and_base_logits(model, ids)["draft"].dtype == torch.bfloat16

    fp32 = _wrap("gemma2", "lowrank")
    _perturb_heads(fp32)
    fp32.save(tmp_path / "ckpt")
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), (torch.bfloat16, torch.bfloat16)):
        loaded = hispec.load(tmp_path / "ckpt", dtype=name)
        assert loaded.dtype == dtype and loaded.base.dtype == dtype
        state = loaded.heads_state_dict()
        assert all(t.dtype == dtype for t in state.values())
        for k, t in fp32.heads_state_dict().items():
            assert torch.equal(state[k], t.to(dtype)), k
        assert _exit_and_base_logits(loaded, ids)["verify"].dtype == dtype
    assert hispec.load(tmp_path / "ckpt").dtype == torch.float32  # saved in fp32, loaded as saved
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'; choose one of fp32, bf16, fp16"):
        hispec.load(tmp_path / "ckpt", dtype="int8")


# ---------------------------------------------------------------- the real demo model

@pytest.mark.real_model
def test_demo_model_from_base_save_load_round_trips_exactly(demo_model_dir, tmp_path):
    model = EarlyExitModel.from_base(demo_model_dir, head_type="linear")
    assert model.num_layers == 30 and (model.draft_layer, model.verify_layer) == default_exits(30) == (4, 8)
    assert model.dtype == torch.float32 and model.tokenizer is not None
    _perturb_heads(model)
    model.save(tmp_path / "ckpt")
    loaded = hispec.load(tmp_path / "ckpt", pack=False)  # stock kernels: bit for bit
    assert loaded.tokenizer is not None and loaded.tokenizer.chat_template == model.tokenizer.chat_template
    _assert_same_heads(model, loaded)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                              add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    want, got = _exit_and_base_logits(model, ids), _exit_and_base_logits(loaded, ids)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    if packed.available():  # the default load packs the linears (hispec.packed): the same logits up to rounding
        fast = _exit_and_base_logits(hispec.load(tmp_path / "ckpt"), ids)
        for k in want:
            torch.testing.assert_close(fast[k], want[k], atol=2e-3, rtol=1e-4)


@pytest.mark.real_model
@pytest.mark.slow
def test_demo_gguf_file_wraps_like_the_converted_folder(demo_model_dir):
    gguf_files = sorted((demo_model_dir.parent / "_downloads").glob(f"{demo_model_dir.name}*.gguf"))
    if not gguf_files:
        pytest.skip("no .gguf file in the demo model's _downloads folder")
    pytest.importorskip("gguf")
    model = EarlyExitModel.from_base(str(gguf_files[0]), head_type="norm")
    assert model.num_layers == 30 and (model.draft_layer, model.verify_layer) == (4, 8)
    assert model.hispec_config.base["name_or_path"] == str(gguf_files[0])
    assert model.tokenizer is not None
    folder = EarlyExitModel.from_base(demo_model_dir, head_type="norm")
    ids = folder.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    assert model.tokenizer("The capital of France is", return_tensors="pt")["input_ids"].tolist() == ids.tolist()
    want, got = _exit_and_base_logits(folder, ids), _exit_and_base_logits(model, ids)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0)


def test_heads_only_save_without_a_base_reference_is_refused_before_writing(tmp_path):
    model = _wrap("llama")
    model.hispec_config.base["name_or_path"] = ""
    with pytest.raises(CheckpointError, match="must reference its base"):
        model.save(tmp_path / "heads", heads_only=True)
    assert not (tmp_path / "heads").exists()


def test_missing_heads_file_and_bad_paths_give_checkpoint_errors(tmp_path):
    _wrap("llama").save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / HEADS_FILE).unlink()
    with pytest.raises(CheckpointError, match=HEADS_FILE):
        hispec.load(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="not a model folder"):
        hispec.load(tmp_path / "no" / "such" / "dir")


def test_lowrank_default_rank_fits_small_models():
    model = hispec.EarlyExitModel.from_base(tiny_model("llama"), draft_layer=1, verify_layer=2, head_type="lowrank")
    assert model.hispec_config.head_rank == 32
