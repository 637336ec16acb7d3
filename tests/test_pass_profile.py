"""tools/pass_profile.py: one pass's time split by kind of work, and the weight-streaming floor."""

from __future__ import annotations

import json

import pytest

from conftest import load_tool
from tiny import char_tokenizer, tiny_model

import hispec


def test_profile_splits_every_pass_into_kinds_that_sum_to_its_wall_time():
    pp = load_tool("pass_profile")
    model = hispec.EarlyExitModel.from_base(tiny_model("llama"), 1, 2, "shared")
    rows = pp.profile_model(model, positions=[1, 4], context=16, repeats=3)
    assert [r["T"] for r in rows] == [1, 4]
    for r in rows:
        parts = [r[k] for k in pp.KINDS] + [r["python + dispatch"]]
        assert all(p >= 0 for p in parts) and r["gemm"] > 0 and r["attention"] > 0 and r["lm_head"] > 0
        assert r["cache"] > 0 and r["masks + rotary"] > 0
        assert sum(parts) >= r["wall"] * 0.999  # python + dispatch is what the operators leave of the wall time


@pytest.mark.skipif(not hispec.matvec.available(), reason="no AVX2 + FMA x86 CPU or no C compiler here")
def test_the_streamed_kernels_products_count_as_products():
    # (a C call through ctypes: torch's profiler sees no operator of its own for it)
    pp = load_tool("pass_profile")
    model = hispec.EarlyExitModel.from_base(tiny_model("llama"), 1, 2, "shared")
    hispec.packed.pack(model.base, (hispec.packed.STREAMED, hispec.packed.STREAMED))
    model.adapter.refresh_modules()
    calls = []
    real = hispec.matvec.matvec
    hispec.matvec.matvec = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        rows = pp.profile_model(model, positions=[1, 3], context=16, repeats=3)
    finally:
        hispec.matvec.matvec = real
    assert calls and all(r["gemm"] > 0 and r["lm_head"] > 0 for r in rows)
    assert hispec.matvec.matvec is real  # the tool's scope is gone afterwards


def test_weight_bytes_count_the_layers_and_the_output_projection_once():
    pp = load_tool("pass_profile")
    base = tiny_model("llama")
    model = hispec.EarlyExitModel.from_base(base, 1, 2, "shared")
    layers = sum(p.numel() * 4 for p in base.model.layers.parameters())
    head = base.lm_head.weight.numel() * 4
    norm = base.model.norm.weight.numel() * 4
    assert pp.weight_bytes(model) == layers + head + norm


def test_the_tool_prints_a_table_and_ends_with_one_json_line(tmp_path, capsys):
    pp = load_tool("pass_profile")
    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    assert pp.main(["--model", str(folder), "--positions", "1,2", "--repeats", "2", "--context", "8", "--bandwidth-mb", "16",
                    "--json-out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[1].startswith("| dtype | T | wall |")
    summary = json.loads(out[-1])
    assert summary["tool"] == "pass_profile" and [r["T"] for r in summary["rows"]] == [1, 2]
    assert all(r["floor"] > 0 and r["wall_over_floor"] > 0 for r in summary["rows"])
    assert json.loads((tmp_path / "p.json").read_text())["rows"] == summary["rows"]


def test_the_merged_products_are_the_default_and_separate_turns_them_off(tmp_path, capsys):
    pp = load_tool("pass_profile")
    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    labels = []
    for extra in ([], ["--separate"]):
        assert pp.main(["--model", str(folder), "--positions", "1", "--repeats", "2", "--context", "8",
                        "--bandwidth-mb", "16", "--kernels", "packed", *extra]) == 0
        labels.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"][0]["linear"])
    assert labels[0].endswith("standard layers unwrapped, QKV and gate/up merged")
    assert labels[1].endswith("standard layers unwrapped")


def test_the_kernel_table_times_the_linears_through_every_kernel_offered(tmp_path, capsys):
    pp = load_tool("pass_profile")
    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    assert pp.main(["--model", str(folder), "--positions", "1", "--repeats", "2", "--context", "8",
                    "--bandwidth-mb", "16", "--kernel-rows", "1,3"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    kernels = json.loads(out[-1])["kernels"]
    offered = {hispec.packed.STOCK, hispec.packed.PACKED, hispec.packed.TRANSPOSED}
    offered |= {hispec.packed.STREAMED} if hispec.matvec.available() else set()
    assert [r["rows"] for r in kernels] == [1, 3] and all(set(r["ms"]) == offered for r in kernels)
    assert all(v > 0 for r in kernels for v in r["ms"].values()) and kernels[0]["bytes"] > 0
    assert any(line.startswith("| dtype | rows | stock |") for line in out)
