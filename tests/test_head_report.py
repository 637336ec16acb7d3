"""tools/research/head_report.py: eval-heads results of several runs -> one table, per-category table, curves, JSON line."""

from __future__ import annotations

import json

import pytest
from conftest import load_tool


def _eval(path, top1, eval_tokens=100, head="linear", cats=None):
    cats = cats or {"math": [0.5, 0.6], "translation": [0.0, 0.1]}
    path.write_text(json.dumps({
        "mode": "eval-heads", "layers": [4, 8], "head_types": [head, head], "vocab_sizes": [49152, 8192],
        "top1": top1, "top5": [t + 0.2 for t in top1], "tokens_per_pass": [1 + top1[0], 1 + top1[1]], "gamma": 4,
        "verify_agrees_draft": 0.5, "sizes": {"eval_tokens": eval_tokens},
        "categories": {c: {"tokens": 50, "top1": v} for c, v in cats.items()}}))
    return path


def _train_dir(path, tokens, head="linear", lora=0):
    path.mkdir()
    (path / "hispec_train.json").write_text(json.dumps({
        "steps": 300, "train_seconds": 1350.0, "args": {"head_lora_rank": lora},
        "data": {"head_type": head, "feature_cache": {"train_loss_tokens": tokens}, "sources": {"answers": 3}}}))
    return path


def test_report_tables_plot_and_json_line(tmp_path, capsys):
    hr = load_tool("head_report")
    a = _eval(tmp_path / "a.json", [0.2, 0.25])
    b = _eval(tmp_path / "b.json", [0.3, 0.35], head="layer", cats={"math": [0.7, 0.8]})
    z = _eval(tmp_path / "z.json", [0.05, 0.04])
    ta, tb = _train_dir(tmp_path / "ta", 1000), _train_dir(tmp_path / "tb", 5000, head="layer", lora=16)
    assert hr.main(["--run", "small", str(a), str(ta), "--run", "big layer", str(b), str(tb),
                    "--run", "zero-shot", str(z), "--plot", str(tmp_path / "p.png"),
                    "--json-out", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    table = "\n".join(out)
    assert "| small | linear | 1,000 | 300 | 22.5 | 49,152 / 8,192 | 0.200 | 0.250 |" in table
    assert "| big layer | layer + LoRA r16 | 5,000 |" in table
    assert "| zero-shot | linear | - | - | - |" in table
    assert "| translation | 50 | 0.000 / 0.100 | - | 0.000 / 0.100 |" in table  # a category one run lacks
    assert (tmp_path / "p.png").stat().st_size > 10_000
    summary = json.loads(out[-1])
    assert [r["train_tokens"] for r in summary["runs"]] == [1000, 5000, None]
    assert summary["runs"][1] == {"label": "big layer", "head_type": "layer", "train_tokens": 5000,
                                  "draft_top1": 0.3, "verify_top1": 0.35, "tokens_per_pass": 1.3}
    assert json.loads((tmp_path / "r.json").read_text())["runs"][0]["train"]["sources"] == {"answers": 3}


def test_report_refuses_incomparable_or_bad_input(tmp_path, capsys):
    hr = load_tool("head_report")
    a = _eval(tmp_path / "a.json", [0.2, 0.25])
    other = _eval(tmp_path / "o.json", [0.2, 0.25], eval_tokens=99)
    (tmp_path / "probe.json").write_text(json.dumps({"mode": "probe"}))
    cases = [
        (["--run", "a", str(a), "--run", "o", str(other)], "different held-out answers"),
        (["--run", "p", str(tmp_path / "probe.json")], "neither an `hispec-probe --eval-heads"),
        (["--run", "m", str(tmp_path / "missing.json")], "does not exist"),
        (["--run", "a", str(a), str(tmp_path / "no-train-dir")], "training record"),
        (["--run", "a", str(a), "--train-tokens", "a", "5"], "no --run with that label and a TRAIN_DIR"),
        (["--run", "a"], "LABEL EVAL_JSON"),
    ]
    for argv, msg in cases:
        with pytest.raises(SystemExit) as e:
            hr.main(argv)
        assert e.value.code == 2
        assert msg in capsys.readouterr().err


def test_train_tokens_override_for_old_records(tmp_path, capsys):
    hr = load_tool("head_report")
    a = _eval(tmp_path / "a.json", [0.2, 0.25])
    t = tmp_path / "old"
    t.mkdir()
    (t / "hispec_train.json").write_text(json.dumps({"steps": 100, "train_seconds": 600, "data": {}}))
    assert hr.main(["--run", "old", str(a), str(t), "--train-tokens", "old", "30000"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"][0]["train_tokens"] == 30000
