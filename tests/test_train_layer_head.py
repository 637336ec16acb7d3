"""`layer` heads through the whole pipeline on a tiny model: train (fully or with LoRA) -> export -> decode."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import _argv, _heads, env, fresh_accelerate_state  # noqa: F401  (fixtures)

import hispec


def _teacher_forced_draft_logits(model, ids):
    ad = model.adapter
    mask = torch.ones_like(ids)
    from hispec.layers import positions_from_mask

    with torch.no_grad():
        _, saved = ad.forward_all(ids, positions_from_mask(mask), ad.new_cache(ids.shape[0]),
                                  exits=(model.draft_layer, model.verify_layer))
        head = model.heads["draft"]
        return model.exit_logits("draft", saved[model.draft_layer], run_layer=head.run_layer_fresh(ad, mask))


@pytest.mark.parametrize("lora", [0, 4])
def test_layer_heads_train_export_and_decode_losslessly(env, tmp_path, lora):  # noqa: F811
    from hispec.cli.export import main as export_main
    from train.heads import main

    out = tmp_path / "run"
    extra = ["--head_lora_rank", str(lora), "--lora_alpha", "8"] if lora else []
    assert main(_argv(env, out, "--max_steps", "12", "--learning_rate", "2e-3", "--head_type", "layer",
                      "--draft_layer", "2", "--verify_layer", "4", *extra)) == 0
    state = _heads(out)
    lora_keys = [k for k in state if "lora_A" in k]
    assert bool(lora_keys) == bool(lora)
    metrics = json.loads((out / "metrics.json").read_text())
    first, last = metrics["history"][0], metrics["final"]
    for k in ("draft", "verify"):
        assert last[k]["kl"] < first[k]["kl"]  # the loss went down on held-out text

    ck = tmp_path / "ck"
    assert export_main([str(out), "--output-dir", str(ck)]) == 0
    model = hispec.load(ck)
    assert model.hispec_config.head_type == "layer"
    assert not any("lora" in k for k in model.heads_state_dict())  # merged into plain layer weights
    if lora:  # frozen copy + B @ A * alpha / r == the merged weight: the exported head computes what was trained
        name = next(k for k in lora_keys if k.startswith("draft."))
        module = name.split(".lora_A")[0]
        a, b = state[name], state[name.replace("lora_A", "lora_B")]
        merged = state[f"{module}.base_layer.weight"] + (b @ a) * (8 / lora)
        torch.testing.assert_close(model.heads_state_dict()[f"{module}.weight"], merged)
        assert torch.count_nonzero(b) > 0  # LoRA actually trained
    ids = torch.tensor([[5, 17, 33, 8, 41, 9, 12]])
    ref = model.base.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=1)
    for strategy in ("self-spec", "hispec"):
        got = model.generate(ids, max_new_tokens=12, strategy=strategy, eos_token_id=[])
        assert torch.equal(got.sequences, ref), strategy
    assert _teacher_forced_draft_logits(model, ids).isfinite().all()


def test_lora_needs_layer_heads(env, tmp_path):  # noqa: F811
    from train.heads import ConfigError, main

    with pytest.raises(ConfigError, match="LoRA applies to 'layer' heads only"):
        main(_argv(env, tmp_path / "b", "--head_type", "linear", "--head_lora_rank", "4"))
    assert not (tmp_path / "b").exists()


def test_left_padded_rebuilds_whole_sequences_in_loss_order():
    from hispec.distill.training import _left_padded

    lengths = [3, 1, 4]
    offsets = torch.tensor([0, 3, 4, 8])
    flat = torch.arange(8, dtype=torch.float32)[:, None].expand(8, 2) + 1
    sel = torch.tensor([True, False, True, True, False, True, True, True])
    states, mask, idx = _left_padded(flat, offsets, sel)
    assert states.shape == (3, 4, 2) and mask.sum(1).tolist() == lengths
    for j, (a, n) in enumerate(zip(offsets[:-1].tolist(), lengths)):
        assert torch.equal(states[j, 4 - n:], flat[a:a + n]) and not mask[j, :4 - n].any()  # left padding
        assert (states[j, :4 - n] == 0).all()
    assert torch.equal(states.reshape(-1, 2)[idx], flat[sel])  # same tokens, same order as the flat batch
