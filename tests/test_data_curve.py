"""tools/research/data_curve.py: drafters on growing data, ordered by training tokens, checked to be scored alike, plotted."""

from __future__ import annotations

import json

import pytest
from conftest import load_tool


def _point(root, name, tokens, top1, same=None):
    run = root / name
    run.mkdir()
    (run / "hispec_drafter.json").write_text(json.dumps({
        "steps": 400, "train_seconds": 100.0, "args": {"per_device_train_batch_size": 8},
        "data": {"train_examples": 1000, "world_size": 1, "feature_cache": {"train_tokens": tokens}}}))
    ev = {"prompts": "p.jsonl", "num_prompts": 40, "max_new_tokens": 128, "dtype": "bf16", **(same or {}),
          "overall": {"tokens": 50, "top1": [top1, top1 / 2], "chain": [top1, top1 / 4],
                      "accepted_per_round": top1 * 1.25},
          "by_category": {"math": {"top1": [top1 + 0.1, 0.0]}, "writing": {"top1": [top1 - 0.1, 0.0]}}}
    path = root / f"{name}.json"
    path.write_text(json.dumps(ev))
    return [str(path), str(run)]


def test_points_are_ordered_checked_and_plotted(tmp_path, capsys):
    tool = load_tool("data_curve")
    big, small = _point(tmp_path, "big", 1_000_000, 0.4), _point(tmp_path, "small", 100_000, 0.2)
    png = tmp_path / "curve.png"
    assert tool.main(["--point", *big, "--point", *small, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    line = json.loads(out.strip().splitlines()[-1])
    assert [p["train_tokens"] for p in line["points"]] == [100_000, 1_000_000]
    assert line["points"][0]["epochs"] == 3.2 and line["points"][1]["by_category"]["math"] == pytest.approx(0.5)
    assert "100,000" in out and "top-1 at step 0 by category" in out
    assert png.stat().st_size > 1000
    other = _point(tmp_path, "other", 50_000, 0.1, same={"max_new_tokens": 64})
    assert tool.main(["--point", *big, "--point", *other]) == 2
    assert "other held-out answers" in capsys.readouterr().err
    assert tool.main([]) == 2
