"""tools/cost_model.py: unit costs are measured and the analytic speculation model behaves sensibly."""

from __future__ import annotations

import json

from conftest import load_tool
from tiny import tiny_model

import hispec


def _costs(layer=1.0, proj=4.0, proj_k=0.3):
    rows = (1, 2, 3, 4, 5, 6, 8)
    return {"layer": {t: layer for t in rows}, "proj_full": {t: proj for t in rows},
            "proj": {8192: {t: proj_k for t in rows}}, "head_body": {t: 0.05 for t in rows}}


def test_self_spec_model_matches_the_closed_form():
    cm = load_tool("cost_model")
    c = _costs()
    L, Ld = 30, 4
    # a = 0: one token per pass, each pass pays gamma drafts on top of a full step -> slower than plain
    s0 = cm.self_spec(c, L, Ld, 0.0, 3, None)
    assert s0["tokens_per_pass"] == 1.0 and s0["speedup"] < 1
    s = cm.self_spec(c, L, Ld, 0.5, 2, 8192)
    draft = Ld * 1.0 + 0.05 + 0.3
    verify = Ld * 1.0 + (L - Ld) * 1.0 + 4.0
    assert abs(s["tokens_per_pass"] - 1.75) < 1e-9
    assert abs(s["speedup"] - (L + 4.0) / ((2 * draft + verify) / 1.75)) < 1e-9
    # a cheaper draft projection lowers the break-even agreement; perfect drafts beat plain decoding
    assert cm.break_even(c, L, Ld, 3, 8192) < cm.break_even(c, L, Ld, 3, None)
    assert cm.self_spec(c, L, Ld, 0.99, 3, 8192)["speedup"] > 2


def test_hierarchy_simulation_tokens_per_pass_grows_with_agreement():
    cm = load_tool("cost_model")
    c = _costs()
    lo = cm.hierarchy(c, 30, 4, 8, 0.2, 0.2, 3, 4, 8192, 8192, tokens=3000)
    hi = cm.hierarchy(c, 30, 4, 8, 0.9, 0.9, 3, 4, 8192, 8192, tokens=3000)
    assert 1 <= lo["tokens_per_pass"] < hi["tokens_per_pass"] <= 8
    assert hi["speedup"] > lo["speedup"]


def test_cost_model_runs_on_a_checkpoint_and_ends_with_one_json_line(tmp_path, capsys):
    cm = load_tool("cost_model")
    model = hispec.EarlyExitModel.from_base(tiny_model("llama"), 2, 4, "linear")
    model.save(tmp_path / "ck")
    assert cm.main(["--model", str(tmp_path / "ck"), "--dtype", "fp32", "--repeats", "2", "--context", "16",
                    "--vocab-sizes", "32", "--gammas", "1,2", "--agreement", "0.5,0.6",
                    "--json-out", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert "decoder layer" in "\n".join(out)
    assert set(result["unit_costs_ms"]) == {"layer", "proj_full", "proj", "head_body"}
    assert len(result["predicted"]["rows"]) == 4
    assert json.loads((tmp_path / "c.json").read_text())["layers"] == model.num_layers
