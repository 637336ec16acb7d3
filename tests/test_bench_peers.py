"""Other engines in hispec-bench (hispec.bench.peers): their rows join the table, and a missing or failing engine is a
skipped / FAILED row with its reason, never a crash.

No real engine runs here. llama.cpp is a fake `llama_cpp` module (and a fake converter script, run as a subprocess
like llama.cpp's own, whose output is cached); vLLM is the real worker script (hispec/bench/peers/vllm_worker.py)
run as a subprocess by the real launcher, under a stand-in "environment" whose Python finds a fake `vllm` package.
Both fakes answer each prompt with transformers' own greedy tokens (computed here first), so the identity check sees
what a faithful engine gives; the quantised llama.cpp row answers something else, and must not break `lossless`.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
import types

import pytest
import torch

import hispec
from hispec import bench
from hispec.bench import peers
from hispec.bench.peers import llamacpp
from hispec.cli.bench import main
from hispec.model import EarlyExitModel
from tiny import char_tokenizer, tiny_model

PROMPTS = [
    {"prompt": "write a poem about the sea.", "category": "writing"},
    {"prompt": "what is 12 times 7?", "category": "math"},
    {"prompt": "name three colours.", "category": "writing"},
]
TOKENS = 10

FAKE_VLLM = textwrap.dedent('''
    """A stand-in for vLLM's Python API as hispec's worker uses it: answers from $FAKE_VLLM_ANSWERS."""
    import json, os
    __version__ = "0.0.fake"
    _state = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": None}

    class SamplingParams:
        def __init__(self, **kw):
            self.__dict__.update(kw)

    class _Metric:
        def __init__(self, name, value=None, values=None):
            self.name, self.value, self.values = name, value, values

    class _Completion:
        def __init__(self, token_ids, finish):
            self.token_ids, self.finish_reason, self.stop_reason = token_ids, finish, None

    class _Output:
        def __init__(self, completion):
            self.outputs = [completion]

    class LLM:
        def __init__(self, **kw):
            if os.environ.get("FAKE_VLLM_FAIL"):
                raise RuntimeError("fake engine failed to start: " + os.environ["FAKE_VLLM_FAIL"])
            assert os.path.isfile(os.path.join(kw["model"], "config.json")), kw["model"]
            assert not os.path.exists(os.path.join(kw["model"], "hispec_heads.safetensors")), "hispec files leaked"
            self.k = (kw.get("speculative_config") or {}).get("num_speculative_tokens")
            with open(os.environ["FAKE_VLLM_ANSWERS"]) as f:
                self.answers = json.load(f)
            _state["per_pos"] = [0] * (self.k or 0)

        def generate(self, prompts, params, use_tqdm=False):
            outs = []
            for p in prompts:
                toks = self.answers.get(",".join(map(str, p["prompt_token_ids"])), [7, 7, 7])[: params.max_tokens]
                stop = set(params.stop_token_ids or [])
                cut = next((i + 1 for i, t in enumerate(toks) if t in stop), len(toks))
                toks = toks[:cut]
                if self.k:  # one draft step per two tokens, the first draft accepted
                    steps = max(1, len(toks) // 2)
                    _state["drafts"] += steps
                    _state["draft_tokens"] += steps * self.k
                    _state["accepted"] += steps
                    _state["per_pos"][0] += steps
                outs.append(_Output(_Completion(toks, "stop" if cut < params.max_tokens else "length")))
            return outs

        def get_metrics(self):
            if not self.k:
                return []
            return [_Metric("vllm:spec_decode_num_drafts", _state["drafts"]),
                    _Metric("vllm:spec_decode_num_draft_tokens", _state["draft_tokens"]),
                    _Metric("vllm:spec_decode_num_accepted_tokens", _state["accepted"]),
                    _Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=list(_state["per_pos"]))]
''')

FAKE_CONVERTER = textwrap.dedent('''
    """Stands in for llama.cpp's convert_hf_to_gguf.py: writes what it was asked to convert."""
    import argparse, json, os
    p = argparse.ArgumentParser()
    p.add_argument("model"); p.add_argument("--outtype"); p.add_argument("--outfile")
    a = p.parse_args()
    with open(os.environ["FAKE_CONVERTER_LOG"], "a") as f:
        f.write(a.outtype + "\\n")
    with open(a.outfile, "w") as f:
        json.dump({"folder": a.model, "outtype": a.outtype}, f)
''')


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = EarlyExitModel.from_base(tiny_model("llama"), draft_layer=2, verify_layer=4, head_type="linear",
                                     gamma=3, window=2, tokenizer=char_tokenizer())
    return model.save(tmp_path_factory.mktemp("ckpt") / "tiny-hispec")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def answers(checkpoint):
    """transformers' greedy tokens for each prompt, keyed by the prompt's token ids joined with commas."""
    from hispec.prompts import Prompt

    model = hispec.load(checkpoint, dtype="fp32")
    config = bench.BenchConfig(strategies=("hf",), max_new_tokens=TOKENS)
    runner = bench.Runner(model, config)
    encoded = bench.encode(model, [Prompt(p["prompt"], p["category"]) for p in PROMPTS])
    out = {",".join(map(str, ids[0][mask[0].bool()].tolist())): runner.run("hf", ids, mask, 0).tokens
           for ids, mask in encoded}
    runner.close()
    return out


@pytest.fixture
def engines(tmp_path, monkeypatch, answers):
    """Fake llama.cpp (module + converter) and a fake vLLM environment; the cache in tmp_path."""
    monkeypatch.setenv("HISPEC_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "answers.json").write_text(json.dumps(answers))
    # vLLM: a package `vllm` and a "Python of vLLM's environment" that finds it (the launcher drops PYTHONPATH)
    pkg = tmp_path / "fake_site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': "
                                   "prompt_token_ids}\n")
    python = tmp_path / "venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "fake_site"}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FAKE_VLLM_ANSWERS", str(tmp_path / "answers.json"))
    monkeypatch.setenv("HISPEC_VLLM_PYTHON", str(python))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    # llama.cpp: the converter script and the bindings
    converter = tmp_path / "llama.cpp" / "convert_hf_to_gguf.py"
    converter.parent.mkdir()
    converter.write_text(FAKE_CONVERTER)
    monkeypatch.setenv(llamacpp.CONVERTER_ENV, str(converter))
    monkeypatch.setenv("FAKE_CONVERTER_LOG", str(tmp_path / "conversions.txt"))
    loaded = []

    class Llama:
        def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, **kw):
            self.gguf = json.loads(open(model_path).read())
            assert not os.path.exists(os.path.join(self.gguf["folder"], "hispec_heads.safetensors"))
            loaded.append((self.gguf["outtype"], n_threads, n_threads_batch))
            self.fresh = False

        def reset(self):
            self.fresh = True

        def generate(self, tokens, temp, top_k, **kw):
            assert self.fresh and temp == 0.0 and top_k == 1  # greedy, no cached prefix reused
            self.fresh = False
            answer = answers[",".join(map(str, tokens))]
            if self.gguf["outtype"] == "q8_0":  # a quantised model: other tokens
                answer = [(t + 1) % 50 for t in answer]
            yield from answer + [5] * 100

        def close(self):
            pass

    fake = types.SimpleNamespace(__version__="0.0.fake", Llama=Llama,
                                 llama_print_system_info=lambda: b"CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 | FMA = 1 |")
    monkeypatch.setattr(llamacpp, "import_llama_cpp", lambda: fake)
    return types.SimpleNamespace(drafter=drafter, loaded=loaded, conversions=tmp_path / "conversions.txt",
                                 python=python)


def run_cli(capsys, *argv):
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    return rc, out, json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None


def common(model, prompts_file):
    return ["--model", model, "--prompts", prompts_file, "--dtype", "fp32", "--max-new-tokens", TOKENS,
            "--warmup", 1, "--threads", 1, "--no-progress"]


def test_peer_rows_join_one_table_with_identity_ratios_and_engine_info(checkpoint, prompts_file, engines, capsys):
    rc, out, summary = run_cli(capsys, *common(checkpoint, prompts_file), "--strategies",
                               "hf,ar,llama.cpp,llama.cpp:q8_0,vllm,vllm-batch,vllm-eagle3:2",
                               "--peer-drafter", engines.drafter)
    assert rc == 0, out.err
    assert summary["failed"] == {} and summary["skipped"] == {}
    s = summary["strategies"]
    assert set(s) == {"hf", "ar", "llama.cpp", "llama.cpp:q8_0", "vllm", "vllm-batch", "vllm-eagle3:2"}
    for name in ("ar", "llama.cpp", "vllm", "vllm-batch", "vllm-eagle3:2"):
        assert s[name]["identical"] == 1.0, name
        assert s[name]["speedup_vs_hf"] > 0 and s[name]["tokens_per_s"] > 0
    # a quantised GGUF is its own labelled row: never "identical", and it does not make the run lossy
    assert s["llama.cpp:q8_0"]["lossy"] is True and s["llama.cpp:q8_0"]["identical"] is None
    assert summary["lossless"] is True
    # what ran: llama.cpp's GGUF at the bench dtype (f32) and q8_0, converted once each, one thread
    assert engines.conversions.read_text().split() == ["f32", "q8_0"]
    assert {x[0] for x in engines.loaded} == {"f32", "q8_0"} and all(x[1:] == (1, 1) for x in engines.loaded)
    assert s["llama.cpp"]["engine"]["gguf_type"] == "f32"
    assert s["llama.cpp"]["engine"]["cpu_features"] == "SSE3 AVX2 FMA"
    assert s["llama.cpp"]["tokens_per_target_pass"] == 1.0 and s["llama.cpp"]["layer_evals_per_token"] == 6.0
    e = s["vllm-eagle3:2"]["engine"]
    assert e["version"] == "vLLM 0.0.fake (CPU build)" and e["speculative"]["num_speculative_tokens"] == 2
    assert e["acceptance_by_position"] == [1.0, 0.0] and e["mean_acceptance_length"] == 2.0
    assert s["vllm-eagle3:2"]["target_acceptance"] == 0.5 and s["vllm-eagle3:2"]["tokens_per_target_pass"] > 1
    assert s["vllm-batch"]["engine"]["mode"] == "batch of 3"
    table = out.out.splitlines()
    for name in s:
        assert any(line.startswith(name + " ") for line in table), name
    assert any(line.startswith("other engines") for line in table)
    assert any(line.startswith("llama.cpp:q8_0") and "quantised: identity not claimed" in line for line in table)
    assert any(line.startswith("vllm-eagle3:2") and "acceptance by position 1.00 / 0.00" in line for line in table)
    # a second run reuses the cached GGUFs
    rc, out, _ = run_cli(capsys, *common(checkpoint, prompts_file), "--strategies", "hf,llama.cpp")
    assert rc == 0 and engines.conversions.read_text().split() == ["f32", "q8_0"]


def test_a_batch_row_reports_the_batch_throughput_for_every_prompt():
    from hispec.bench.peers import PeerJob, PeerSpec, vllm_peer

    job = PeerJob(prompts=[[1], [2], [3]], max_new_tokens=8, eos=[0], dtype="fp32", model_dir="m", num_layers=4)
    result = {"vllm": "x", "batch": [{"seconds": 2.0, "outputs": [{"tokens": [5] * 8}, {"tokens": [6, 0]},
                                                                  {"tokens": [7] * 6}]}], "batch_totals": {}}
    o = vllm_peer._outcome(PeerSpec("vllm-batch", "vllm", batch=True), result, job, log="log")
    rates = [len(r[0].tokens) / r[0].seconds for r in o.runs]
    assert rates == pytest.approx([8.0, 8.0, 8.0])  # 16 tokens / 2 s, for every prompt
    assert sum(r[0].seconds for r in o.runs) == pytest.approx(2.0)


def test_missing_and_failing_engines_are_reported_and_the_others_run_on(checkpoint, prompts_file, engines, capsys,
                                                                        monkeypatch):
    def missing():
        raise peers.PeerMissing("llama-cpp-python is not installed (No module named 'llama_cpp'); "
                                + llamacpp.INSTALL)

    monkeypatch.setattr(llamacpp, "import_llama_cpp", missing)
    monkeypatch.setenv("FAKE_VLLM_FAIL", "no AVX512 here")
    rc, out, summary = run_cli(capsys, *common(checkpoint, prompts_file), "--strategies",
                               "hf,ar,llama.cpp,vllm,vllm-eagle3")
    assert rc == 0, out.err
    assert set(summary["strategies"]) == {"hf", "ar"} and summary["lossless"] is True
    assert summary["skipped"]["llama.cpp"].startswith("llama-cpp-python is not installed")
    assert "fake engine failed to start: no AVX512 here" in summary["failed"]["vllm"]
    assert "log:" in summary["failed"]["vllm"]  # the full engine output is kept
    assert "no EAGLE-3 drafter" in summary["failed"]["vllm-eagle3"]  # the tiny checkpoint holds none
    table = out.out.splitlines()
    assert any(line.startswith("llama.cpp ") and "skipped (not installed)" in line for line in table)
    assert any(line.startswith("vllm ") and "FAILED (not timed)" in line for line in table)
    assert "vllm was skipped" not in out.err and "llama.cpp was skipped" in out.err
    # no vLLM environment at all: skipped, saying how to build it
    monkeypatch.setenv("HISPEC_VLLM_PYTHON", str(engines.python.parent / "missing-python"))
    rc, out, summary = run_cli(capsys, *common(checkpoint, prompts_file), "--strategies", "hf,vllm")
    assert rc == 0 and "make vllm" in summary["skipped"]["vllm"]


@pytest.mark.parametrize("name, match", [("vllm:2", "vLLM rows are"), ("llama.cpp:q3_k", "quantised GGUF types"),
                                         ("vllm-eagle3:0", "K must be")])
def test_malformed_peer_names_are_refused_before_any_work(checkpoint, prompts_file, capsys, name, match):
    with pytest.raises(ValueError, match=match):
        bench.BenchConfig(strategies=("hf", name))
    rc, out, _ = run_cli(capsys, *common(checkpoint, prompts_file), "--strategies", f"hf,{name}")
    assert rc == 2 and match in out.err


def test_a_hispec_checkpoint_is_shown_to_engines_without_its_own_files(checkpoint, tmp_path, monkeypatch):
    from hispec.bench.peers.folders import base_folder

    monkeypatch.setenv("HISPEC_CACHE_DIR", str(tmp_path))
    view = base_folder(checkpoint)
    assert view != checkpoint and (view / "config.json").is_file() and (view / "model.safetensors").is_file()
    assert not any(p.name.startswith("hispec_") for p in view.iterdir())
    assert base_folder(checkpoint) == view  # made once
    with pytest.raises(peers.PeerError, match="--peer-model"):
        base_folder(tmp_path / "model.gguf")


# ---------------------------------------------------------------------------------------------- tools around vLLM
def test_check_vllm_passes_only_when_the_drafter_loaded_and_outputs_match(tmp_path, capsys):
    from conftest import load_tool

    check = load_tool("check_vllm")
    args = check.build_parser().parse_args(["--num-prompts", "2", "--dtype", "fp32", "--spec-tokens", "2"])
    ids = [[1, 2], [3, 4]]

    def result(single, batch, counters):
        return {"vllm": "0.0.fake", "torch": "t", "cpu_capability": "AVX2", "start_seconds": 1.0,
                "single": [[{"tokens": t, "seconds": 1.0}] for t in single],
                "batch": [{"seconds": 1.0, "outputs": [{"tokens": t} for t in batch]}], "totals": counters}

    plain = result([[5, 6], [7, 8]], [[5, 6], [7, 8]], {})
    accepted = {"drafts": 2, "draft_tokens": 4, "accepted": 1, "accepted_per_pos": [1, 0]}
    spec = result([[5, 6], [7, 8]], [[5, 6], [7, 8]], accepted)
    base, export = tmp_path / "base", check.REPO / "x"
    assert check.report(args, base, export, 0.1, ids, plain, spec, {}) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["check_vllm"] is True and summary["same"]["one at a time"] == 2
    assert summary["acceptance"]["acceptance_by_position"] == [0.5, 0.0]
    assert "acceptance by position (vLLM's metrics, one at a time): 0.50 / 0.00" in out
    # fp32: one differing token fails the check, and so does a run without speculative counters (no drafter)
    wrong = result([[5, 6], [7, 9]], [[5, 6], [7, 8]], accepted)
    assert check.report(args, base, export, 0.1, ids, plain, wrong, {}) == 1
    assert "prompt 1 left plain at new token 1" in capsys.readouterr().out
    assert check.report(args, base, export, 0.1, ids, plain, result([[5, 6], [7, 8]], [[5, 6], [7, 8]], {}), {}) == 1


def test_load_test_starts_vllm_from_its_environment_with_the_drafter_and_bound_threads(tmp_path, monkeypatch,
                                                                                          checkpoint):
    from conftest import load_tool

    lt = load_tool("load_test")
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv("HISPEC_CACHE_DIR", str(tmp_path / "cache"))
    args = lt.build_parser().parse_args(["--model", str(checkpoint), "--servers", "vllm-eagle3", "--threads", "1",
                                         "--taskset", "3-5", "--vllm-python", str(python), "--vllm-drafter", "D",
                                         "--vllm-spec-tokens", "2"])
    cmd, env, name = lt.vllm_command("vllm-eagle3", args)
    assert cmd[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"] and name == "vllm-eagle3"
    model = cmd[cmd.index("--model") + 1]
    assert model != str(checkpoint) and not any(p.startswith("hispec_") for p in os.listdir(model))
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {"method": "eagle3", "model": "D",
                                                                     "num_speculative_tokens": 2}
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "3" and env["OMP_NUM_THREADS"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    args.vllm_drafter = None
    with pytest.raises(SystemExit, match="--vllm-drafter"):
        lt.vllm_command("vllm-eagle3", args)
    text = ('vllm:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
            'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 8.0\n# HELP x\n')
    counts = lt.prometheus_counts(text)
    assert lt.spec_acceptance(counts, {}) == 1.8 and lt.spec_acceptance(counts, counts) is None
