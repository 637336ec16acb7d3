"""tools/research/head_agreement.py: exit-head agreement with the final layer on real prompts, by frontier distance."""

from __future__ import annotations

import json

from conftest import load_tool
from test_bench import PROMPTS, char_tokenizer
from test_context_head import _perturb
from test_decoding import _oracle, _wrap
from tiny import tiny_model


def _run(capsys, folders, prompts, *extra):
    tool = load_tool("head_agreement")
    assert tool.main(["--model", *map(str, folders), "--prompts", str(prompts), "--max-new-tokens", "10",
                      "--dtype", "fp32", "--no-progress", *extra]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("checkpoint") and "top-1" in out[0]
    return json.loads(out[-1])


def test_oracle_exits_agree_everywhere_and_context_heads_report_each_distance(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    oracle = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", tokenizer=char_tokenizer())
    ctx = _perturb(_wrap(tiny_model("llama"), head_type="context", tokenizer=char_tokenizer(),
                         context={"window": 4, "heads": 2, "head_dim": 8}))
    folders = [oracle.save(tmp_path / "oracle"), ctx.save(tmp_path / "ctx")]
    res = _run(capsys, folders, prompts, "--distances", "3")
    a = res["checkpoints"][str(folders[0])]
    assert a["head_type"] == "shared" and a["positions"] > 20
    assert a["agreement"]["draft"]["0"] == {"top1": 1.0, "top5": 1.0}  # layers from 2 on are identities
    assert a["agreement"]["verify"]["0"] == {"top1": 1.0, "top5": 1.0}
    c = res["checkpoints"][str(folders[1])]
    assert c["head_type"] == "context (frontier 1)"
    for name in ("draft", "verify"):
        assert list(c["agreement"][name]) == ["1", "2", "3"]
        for r in c["agreement"][name].values():
            assert 0.0 <= r["top1"] <= r["top5"] <= 1.0
    # the perturbed context head reads the final states: its agreement depends on the distance
    d = c["agreement"]["draft"]
    assert len({(r["top1"], r["top5"]) for r in d.values()}) > 1


def test_answers_are_reused_across_checkpoints_of_one_backbone_and_redone_for_another(tmp_path, capsys,
                                                                                      monkeypatch):
    from hispec.model import EarlyExitModel

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    lin = _wrap(tiny_model("llama"), head_type="linear", tokenizer=char_tokenizer())
    ctx = _perturb(_wrap(tiny_model("llama"), head_type="context", tokenizer=char_tokenizer(),
                         context={"window": 4, "heads": 2, "head_dim": 8}))
    other = _wrap(_oracle(tiny_model("llama"), 2), head_type="shared", tokenizer=char_tokenizer())
    folders = [lin.save(tmp_path / "lin"), ctx.save(tmp_path / "ctx"), other.save(tmp_path / "other")]
    calls = []
    real = EarlyExitModel.generate
    monkeypatch.setattr(EarlyExitModel, "generate", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    res = _run(capsys, folders[:2], prompts)
    assert len(calls) == len(PROMPTS)  # the context checkpoint shares the linear one's backbone: answered once
    first = res["checkpoints"][str(folders[0])]["positions"]
    assert res["checkpoints"][str(folders[1])]["positions"] == first
    calls.clear()
    res = _run(capsys, [folders[0], folders[2]], prompts)
    assert len(calls) == 2 * len(PROMPTS)  # another backbone does not reproduce the answers: answered afresh
    assert res["checkpoints"][str(folders[2])]["agreement"]["draft"]["0"] == {"top1": 1.0, "top5": 1.0}
