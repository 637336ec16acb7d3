"""The decoding round waits for the device a bounded number of times: every `.item()` / `.tolist()` / `int()` /
`bool()` / `.nonzero()` of a tensor is a device-to-host copy that stalls a GPU's queue, so the round reads the device
only where the host must decide something (a pass's width, whether a level gathers more, the tokens to hand over),
batched into one copy where it can. Counted here on a tiny model (every such call on any tensor counts: on the CPU they are all
alike); the bounds fail as soon as someone adds a per-token or per-row read back."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model

import hispec

READS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__", "nonzero")  # (nonzero: its size)
# per call, besides the rounds: the prompts' checks and rows (3 + one per row), the run's buffers and EOS ids (2),
# prefill (1), spare (2)
PER_CALL = 8


def _model():
    base = tiny_model("llama")
    base.generation_config.pad_token_id = 0
    return hispec.EarlyExitModel.from_base(base, draft_layer=2, verify_layer=4, head_type="shared")


def _prompts(rows: int) -> torch.Tensor:
    return torch.randint(3, 97, (rows, 8), generator=torch.Generator().manual_seed(0))


def _eos_never_drawn(model, ids, n: int) -> int:
    """An EOS id none of the rows produces in n tokens (so rows run their full length, and the EOS scan runs)."""
    model.base.generation_config.eos_token_id = None
    free = model.generate(ids, max_new_tokens=n, strategy="ar").new_tokens
    return next(t for t in range(3, 97) if all(t not in row for row in free))


def _counted(fn):
    """fn()'s result and how many tensor -> host reads it made."""
    n = [0]
    with pytest.MonkeyPatch.context() as mp:
        for name in READS:
            orig = getattr(torch.Tensor, name)

            def counting(self, *a, _orig=orig, **k):
                n[0] += 1
                return _orig(self, *a, **k)

            mp.setattr(torch.Tensor, name, counting)
        out = fn()
    return out, n[0]


@pytest.mark.parametrize("rows", [1, 4])
def test_plain_decoding_reads_the_device_three_times_a_token(rows):
    """`ar`: a pass's width, the sdpa mask choice of a one-position pass, and one copy at the commit (which rows
    finished, how far, their ids, their new tokens and the round's counters) -- whatever the batch size (it was 10 a
    token, and 2 more per row)."""
    model, ids = _model(), _prompts(rows)
    model.base.generation_config.eos_token_id = _eos_never_drawn(model, ids, 48)
    out, reads = _counted(lambda: model.generate(ids, max_new_tokens=48, strategy="ar"))
    rounds = out.stats.levels[-1].passes - 1  # (the prefill is a pass of the full model too)
    assert out.stats.new_tokens == 48 * rows and rounds == 47
    assert reads <= 3 * rounds + PER_CALL + rows, reads


@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("rows", [1, 4])
def test_self_speculation_reads_the_device_a_bounded_number_of_times_a_round(gamma, rows):
    """`self-spec` with gamma g, per round: g + 1 checks whether the draft goes on (each also reading the next draft
    pass's width), g sdpa mask choices of one-position draft passes, two verification pass widths, one read of what
    the verification may take and how far, one rollback (every range's new length at once), one commit: 2g + 6
    (+1 spare). It was ~47 a round at g = 4 (42 a generated token here), half of them counters and per-row reads."""
    model, ids = _model(), _prompts(rows)
    model.base.generation_config.eos_token_id = _eos_never_drawn(model, ids, 48)
    out, reads = _counted(lambda: model.generate(ids, max_new_tokens=48, strategy="self-spec", gamma=gamma))
    rounds = out.stats.levels[-1].passes - 1
    assert out.stats.new_tokens == 48 * rows
    assert reads <= (2 * gamma + 7) * rounds + PER_CALL + rows, (reads, rounds)
    assert reads / out.stats.new_tokens <= 2 * gamma + 8  # per generated token, whatever the acceptance


def test_counters_read_at_the_commit_equal_the_ones_counted_pass_by_pass():
    """The round's counters are read from the device once per commit; they add up as before: every verified token
    counted once, every draft counted, layer evaluations as positions x layers."""
    model, ids = _model(), _prompts(2)
    model.base.generation_config.eos_token_id = None
    out = model.generate(ids, max_new_tokens=20, strategy="hispec", gamma=2, window=2)
    st = out.stats
    draft, verify, full = st.levels
    assert st.new_tokens == 40 and draft.proposed == draft.row_passes  # one token a row and draft step
    assert verify.accepted <= verify.proposed and full.accepted <= full.proposed
    assert all(isinstance(getattr(lv, f), int) for lv in st.levels for f in ("accepted", "proposed", "row_passes",
                                                                            "layer_evals", "rejections"))
    # every position a range advanced over is counted once per layer (KV reuse: nothing twice)
    assert st.layer_evals >= 40 * 6 and draft.layer_evals % 2 == 0 and verify.layer_evals % 2 == 0
