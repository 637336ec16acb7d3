"""tools/research/batch_speed.py: tokens/s per batch size, every output checked against plain decoding, one JSON line."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import load_tool
from test_auto import _calibrated, _self_spec_only
from test_bench import PROMPTS, char_tokenizer
from test_decoding import _oracle, _wrap
from tiny import tiny_model


def test_batch_speed_times_every_strategy_per_batch_size_and_auto_goes_plain_in_a_compute_bound_batch(tmp_path,
                                                                                                     capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    model = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", tokenizer=char_tokenizer())
    cal = _calibrated(model, _self_spec_only, 0.0, realistic=True)
    shape = {T: max(1.0, T / 4) for T in cal.costs["layer"]}  # flat up to 4 positions, then compute-bound
    cal = dataclasses.replace(cal, costs={**cal.costs, "layer": {T: 1e-3 * c for T, c in shape.items()},
                                          "final": {T: 2e-3 * c for T, c in shape.items()}})
    model.hispec_config.calibration = cal.to_dict()
    folder = model.save(tmp_path / "ck")
    tool = load_tool("batch_speed")
    assert tool.main(["--model", str(folder), "--prompts", str(prompts), "--num-prompts", "4", "--batch-sizes",
                      "1,4", "--max-new-tokens", "12", "--dtype", "fp32", "--no-pack"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[1].split()[:2] == ["batch", "strategy"]
    res = {(r["batch_size"], r["strategy"]): r for r in json.loads(out[-1])["results"]}
    assert set(res) == {(b, s) for b in (1, 4) for s in tool.STRATEGIES}
    for r in res.values():
        assert r["rows"] == 4 and r["new_tokens"] > 0 and r["tokens_per_s"] > 0
        assert 0 < r["prefill_seconds"] < r["seconds"]  # hf's from its first logits call, hispec's from its stats
        assert r["decode_tokens_per_s"] > 0
        assert r["identical_to_ar"] == 4  # fp32: every strategy decodes exactly what plain decoding does
    assert res[(1, "auto")]["plain_row_share"] < 0.5  # alone, the always-right drafts pay
    assert res[(4, "auto")]["plain_row_share"] == pytest.approx(1.0)  # in the batch they do not: plain
    assert res[(4, "auto-batch-blind")]["plain_row_share"] < 0.5  # the row-alone rule speculated anyway


def test_batch_speed_refuses_batch_sizes_that_do_not_divide_the_prompts(capsys):
    tool = load_tool("batch_speed")
    with pytest.raises(SystemExit):
        tool.main(["--model", "unused", "--num-prompts", "6", "--batch-sizes", "4"])
    assert "divide" in capsys.readouterr().err


def test_batch_speed_runs_fixed_hierarchies_and_refuses_a_drafter_the_checkpoint_lacks(tmp_path, capsys):
    """`--strategies` takes any named hierarchy (`ngram`, `self-spec`, ...: the sources of a batch's speed), each
    checked against plain decoding; `eagle` on a checkpoint without a drafter is refused before any timing."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    model = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", tokenizer=char_tokenizer())
    folder = model.save(tmp_path / "ck")  # no calibration: fine without `auto`
    tool = load_tool("batch_speed")
    assert tool.main(["--model", str(folder), "--prompts", str(prompts), "--num-prompts", "4", "--batch-sizes", "2",
                      "--max-new-tokens", "10", "--dtype", "fp32", "--no-pack",
                      "--strategies", "ar,ngram,self-spec"]) == 0
    res = {r["strategy"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]}
    assert set(res) == {"ar", "ngram", "self-spec"}
    assert all(r["identical_to_ar"] == 4 and r["new_tokens"] > 0 for r in res.values())
    assert res["self-spec"]["plan"] == "L2>full" and res["ngram"]["plan"] == "ngram>full"  # (the hierarchy run)
    with pytest.raises(SystemExit):
        tool.main(["--model", str(folder), "--prompts", str(prompts), "--num-prompts", "4", "--batch-sizes", "2",
                   "--strategies", "ar,eagle"])
    assert "need an EAGLE-3 drafter" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main(["--model", str(folder), "--strategies", "ar,nonsense"])
    assert "unknown strategies ['nonsense']" in capsys.readouterr().err
