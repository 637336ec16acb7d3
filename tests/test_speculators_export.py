"""hispec-trained EAGLE-3 drafters in the `speculators` format: the folder loads with `speculators`' own model class
and computes the same logits as hispec's drafter (fp32, CPU), for one and several draft steps."""

from __future__ import annotations

import json

import pytest
import torch

from hispec.cli.export import main as export_main
from hispec.drafters.eagle3 import Eagle3Config, Eagle3Drafter, save_drafter
from hispec.model import base_identity
from hispec.export.speculators import SpeculatorsExportError, export_speculators
from tiny import tiny_model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny Llama target saved as a plain HF folder and a drafter run for it (reduced draft vocabulary)."""
    root = tmp_path_factory.mktemp("spec")
    target = tiny_model("llama")
    target.save_pretrained(root / "target")
    torch.manual_seed(0)
    d = Eagle3Drafter(Eagle3Config.for_target(target.config, draft_vocab_size=40)).eval()
    d.set_draft_vocab(torch.randperm(97, generator=torch.Generator().manual_seed(0))[:40])
    d.init_from_target(target.lm_head.weight, target.model.norm.weight)
    with torch.no_grad():
        for p in d.layers[0].parameters():  # norms are all-ones at init: perturb everything so bugs show
            p.add_(torch.randn_like(p) * 0.05)
    save_drafter(d, root / "run", base={**base_identity(target), "name_or_path": str(root / "target")},
                 extra={"ttt_steps": 3})
    return root, target, d


def _load_with_speculators(folder):
    from speculators import SpeculatorModel, SpeculatorModelConfig

    cfg = SpeculatorModelConfig.from_pretrained(str(folder))
    cfg.transformer_layer_config._attn_implementation = "eager"  # flex attention needs 128-multiple lengths
    model = SpeculatorModel.from_pretrained(str(folder), config=cfg).eval()
    # speculators 0.9 marks embed_tokens for loading from the verifier, but on transformers > 5.19 post_init
    # re-initialises it first; its own loader with overwrite puts the verifier's embedding back
    model._load_verifier_weights(overwrite_embed_tokens=True)
    return model


@pytest.mark.parametrize("steps", [1, 3])
def test_exported_drafter_loads_in_speculators_and_gives_the_same_logits(run, tmp_path, steps):
    root, target, d = run
    out = export_speculators(root / "run", tmp_path / "spec")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == d.config.aux_layers
    assert cfg["draft_vocab_size"] == 40 and cfg["target_hidden_size"] == 32
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(root / "target")
    assert "LlamaForCausalLM" in cfg["speculators_config"]["verifier"]["architectures"]
    assert "drafts for" in (out / "README.md").read_text().lower()
    model = _load_with_speculators(out)
    assert type(model).__name__ == "Eagle3DraftModel"
    assert torch.equal(model.d2t, d.d2t) and torch.equal(model.t2d, d.t2d)
    T = 11
    ids = torch.randint(0, 97, (1, T + 1), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hs = target(ids[:, :T], output_hidden_states=True).hidden_states
    aux = torch.cat([hs[i] for i in d.config.aux_layers], -1)
    caught = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, o: caught.append(o.detach()))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids[:, 1:], document_ids=torch.zeros(1, T, dtype=torch.long),
              ttt_steps=steps)
        mine = d.ttt_logits(aux, target.get_input_embeddings(), ids[:, 1:], steps)
    hook.remove()
    assert len(caught) == steps
    for s in range(steps):
        torch.testing.assert_close(caught[s], mine[s], rtol=1e-5, atol=1e-5)


def test_cli_exports_and_refuses_hispec_only_flags(run, tmp_path, capsys):
    root, _, _ = run
    assert export_main([str(root / "run"), "--format", "speculators", "--output-dir", str(tmp_path / "o"),
                        "--dtype", "bf16", "--speculative-tokens", "4"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["format"] == "speculators" and line["files"] == 4  # + config.py, speculators' auto_map source
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    from safetensors import safe_open

    with safe_open(str(tmp_path / "o" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16 and f.get_tensor("d2t").dtype == torch.long
        assert "embed_tokens.weight" not in f.keys()
    with pytest.raises(SystemExit):
        export_main([str(root / "run"), "--format", "speculators", "--output-dir", str(tmp_path / "p"),
                     "--calibrate"])
    assert "only apply to hispec checkpoints" in capsys.readouterr().err
    assert export_main([str(root / "run"), "--output-dir", str(tmp_path / "q")]) == 1
    assert "export it with --format speculators" in capsys.readouterr().err


def test_exit_head_runs_are_refused_naming_the_types_that_export(tmp_path):
    run = tmp_path / "linear-run"
    run.mkdir()
    (run / "hispec_train.json").write_text(json.dumps({"hispec": {"head": {"type": "linear"}}}))
    with pytest.raises(SpeculatorsExportError, match=r"its heads are 'linear'.*only `eagle3` drafters"):
        export_speculators(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_drafter_without_aux_layers_is_refused(run, tmp_path):
    root, _, _ = run
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(root / "run", bad)
    meta = json.loads((bad / "hispec_drafter.json").read_text())
    meta["config"]["aux_layers"] = []
    (bad / "hispec_drafter.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="aux_layers must be distinct layer ids"):
        export_speculators(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_without_speculators_the_export_says_how_to_install_it(run, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_speculators(name, *a, **k):
        if name.startswith("speculators"):
            raise ImportError("No module named 'speculators'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_speculators)
    with pytest.raises(SpeculatorsExportError, match=r"pip install 'hispec\[speculators\]'"):
        export_speculators(run[0] / "run", tmp_path / "out")


@pytest.mark.real_model
def test_the_shipped_smollm2_drafter_loads_in_speculators_and_matches_hispecs(demo_model_dir):
    """recipes/artifacts/smollm2-135m/eagle3-speculators (what vLLM / SGLang would serve) against the hispec drafter
    shipped beside it, on SmolLM2's own states (the verifier pointed at the local demo model: no Hub)."""
    from pathlib import Path

    from speculators import SpeculatorModel, SpeculatorModelConfig

    from hispec.drafters.eagle3 import load_drafter
    from hispec.model import load_base_model

    art = Path(__file__).resolve().parents[1] / "recipes" / "artifacts" / "smollm2-135m"
    cfg = SpeculatorModelConfig.from_pretrained(str(art / "eagle3-speculators"))
    assert cfg.speculators_config.verifier.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    cfg.speculators_config.verifier.name_or_path = str(demo_model_dir)
    cfg.transformer_layer_config._attn_implementation = "eager"
    spec = SpeculatorModel.from_pretrained(str(art / "eagle3-speculators"), config=cfg).float().eval()
    spec._load_verifier_weights(overwrite_embed_tokens=True)
    drafter, meta = load_drafter(art / "eagle3")
    assert meta["config"]["aux_layers"] == cfg.eagle_aux_hidden_state_layer_ids == [2, 15, 27]
    target = load_base_model(str(demo_model_dir), dtype="fp32")
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 28, 7018, 411, 253, 2379]])
    T = ids.shape[1] - 1
    with torch.no_grad():
        hs = target(ids[:, :T], output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in drafter.config.aux_layers], -1)
        caught = []
        spec.lm_head.register_forward_hook(lambda mod, inp, o: caught.append(o.detach()))
        spec(hidden_states=aux, input_ids=ids[:, 1:], document_ids=torch.zeros(1, T, dtype=torch.long), ttt_steps=2)
        mine = drafter.ttt_logits(aux, target.get_input_embeddings(), ids[:, 1:], 2)
    for s in range(2):
        torch.testing.assert_close(caught[s], mine[s], rtol=1e-4, atol=1e-4)
