"""Training an EAGLE-3 drafter (`hispec.drafters.eagle3`) by distillation, from the feature cache.

Contract:
- `DrafterCollator(aux_layers, steps)`: items of `hispec.distill.features.CachedSequences` (built with the aux
  layers) -> one right-padded batch `[B, T]` in `speculators`' alignment (its `shift_batch`): entry j holds the aux
  states of position j (`aux` `[B, T, A*H]`, layers concatenated in `aux_layers` order), the token x_{j+1}
  (`input_ids`), and for each draft step s < `steps` the teacher at position j+1+s (the final layer's top-k
  next-token distribution predicting x_{j+2+s}: `topk_ids` / `topk_logprobs` `[B, T, steps, k]`) and whether it
  is trained (`loss_mask` `[B, T, steps]`: inside the sequence and inside the run's loss mask); `valid` `[B, T]`.
- `DrafterForTraining(drafter, embed)`: what accelerate prepares; `ttt_loss(model, batch, steps, decay)` ->
  `DrafterLoss`: the drafter unrolled over `steps` draft steps
  ("training-time test", `Eagle3Drafter.ttt_logits`), each against the teacher restricted to the draft vocabulary
  and renormalised (soft cross-entropy, fp32 softmax; equal to the KL up to the teacher's entropy, as in EAGLE-3),
  step s weighted by decay**s; with per-step top-1 agreement in the *target* vocabulary (a draft outside it never
  matches) and the chained agreement (steps 0..s all right), whose sum is the expected accepted drafts per round;
  and, for each confidence gate g of `GATES`, what a chain that stops drafting at the first draft whose own
  probability is below g would propose and get accepted per round (`summarize`'s `gated`: the price of every
  draft is its verification, so a gate that drops drafts which rarely pass saves verify work for few tokens).
- `validate_drafter_args(m, d, t)`: the run's eagle3 settings, before any model is loaded (`ConfigError`);
  `drafter_aux_layers(m, num_layers)`: its aux layer ids (`eagle3_aux_layers`, else `default_aux_layers`);
- `sequence_items(adapter, seqs, layers)`: the same items for token sequences in memory (one frozen pass; the loss
  on each sequence's answer), for evaluations and tests without a cache folder;
- `draft_vocab_from_cache(cache_dir, size)`: the `size` most frequent next tokens of the teacher (top-1) over a
  cache: the draft vocabulary (`speculators` counts token frequencies the same way).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from hispec.distill.args import ConfigError


class DrafterCollator:
    """See the module docstring; `steps` >= 1 draft steps per position."""

    def __init__(self, aux_layers: list[int], steps: int):
        if steps < 1:
            raise ValueError(f"a drafter trains over >= 1 draft steps, got {steps}")
        self.aux_layers, self.steps = list(aux_layers), steps

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        S = self.steps
        lens = [max(0, len(it["input_ids"]) - 1) for it in items]
        B, T = len(items), max(1, max(lens))
        first = items[0]
        H = first[f"hidden.{self.aux_layers[0]}"].shape[-1]
        k = first["teacher_topk_ids"].shape[-1]
        aux = torch.zeros(B, T, len(self.aux_layers) * H, dtype=first[f"hidden.{self.aux_layers[0]}"].dtype)
        ids = torch.zeros(B, T, dtype=torch.long)
        tk_ids = torch.zeros(B, T, S, k, dtype=torch.long)
        tk_logp = torch.full((B, T, S, k), float("-inf"))
        mask = torch.zeros(B, T, S, dtype=torch.bool)
        valid = torch.zeros(B, T, dtype=torch.bool)
        for b, (it, n) in enumerate(zip(items, lens)):
            if n == 0:
                continue
            aux[b, :n] = torch.cat([it[f"hidden.{layer}"][:n] for layer in self.aux_layers], -1)
            ids[b, :n] = it["input_ids"][1:]
            valid[b, :n] = True
            for s in range(S):
                m = n - s  # entries j with j + 1 + s inside the sequence
                if m <= 0:
                    break
                tk_ids[b, :m, s] = it["teacher_topk_ids"][1 + s:]
                tk_logp[b, :m, s] = it["teacher_topk_logprobs"][1 + s:].float()
                mask[b, :m, s] = it["loss_mask"][1 + s:].bool()
        return {"aux": aux, "input_ids": ids, "topk_ids": tk_ids, "topk_logprobs": tk_logp, "loss_mask": mask,
                "valid": valid}


@dataclass
class DrafterLoss:
    """`loss` (scalar, differentiable); per step: `ce` soft cross-entropy, `top1` agreement with the teacher's
    argmax, `chain` agreement of steps 0..s together; `tokens` trained positions of step 0."""

    loss: torch.Tensor
    ce: list[float] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    chain: list[float] = field(default_factory=list)
    tokens: int = 0
    sums: dict = field(default_factory=dict)  # raw sums for exact aggregation over batches and processes


class DrafterForTraining(torch.nn.Module):
    """The one module `accelerate.prepare` sees: the drafter, with the target's frozen token embedding held by
    reference (not a parameter: it is neither trained, synchronised nor saved)."""

    def __init__(self, drafter, embed: torch.nn.Module):
        super().__init__()
        self.drafter = drafter
        self._embed = [embed]

    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor, steps: int,
                select: torch.Tensor | None = None):
        dtype = self.drafter.fc.weight.dtype

        def embed(x):
            with torch.no_grad():  # the target's embedding is frozen
                return self._embed[0](x).to(dtype)

        return self.drafter.ttt_logits(aux.to(dtype), embed, input_ids, steps, valid, select=select)


def _draft_index(drafter) -> torch.Tensor | None:
    """`[V]` draft index of each target token (-1 outside the draft vocabulary); None for a full vocabulary."""
    ids = drafter.draft_token_ids()
    if ids is None:
        return None
    index = torch.full((drafter.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
    index[ids] = torch.arange(ids.numel(), device=ids.device)
    return index


GATES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)  # drafter-confidence gates `ttt_loss` prices (0: the plain chain)


def ttt_loss(model, batch: dict, steps: int, decay: float = 1.0) -> DrafterLoss:
    """See the module docstring. `model`: a `DrafterForTraining`, possibly wrapped (DDP) by accelerate."""
    core = getattr(model, "module", model).drafter
    dev = core.fc.weight.device
    b = {k: v.to(dev) for k, v in batch.items()}
    # the drafter's logits only where some step trains ([N] entries of the batch, row-major): the rest of the
    # padded batch (prompts, padding) still runs its decoder layer, whose states later steps and entries read
    sel = b["loss_mask"].any(-1)
    logits = model(b["aux"], b["input_ids"], b["valid"], steps, sel)
    mask, topk_ids, topk_logp = b["loss_mask"][sel], b["topk_ids"][sel], b["topk_logprobs"][sel]  # [N, steps(, k)]
    index = _draft_index(core)
    loss = torch.zeros((), device=dev)
    sums = {"tokens": 0.0}
    chain_ok = None
    gates = torch.tensor(GATES, device=dev)
    gate_on = None  # [N, gates]: every draft so far confident enough to be proposed under each gate
    for s, lg in enumerate(logits):
        m = mask[:, s]
        tk, lp = topk_ids[:, s], topk_logp[:, s]
        didx = tk if index is None else index[tk]
        p = lp.exp() * (didx >= 0)
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
        lsm = F.log_softmax(lg.float(), -1)
        logq = lsm.gather(-1, didx.clamp_min(0))
        ce_tok = -(p * logq).sum(-1)  # [N]
        n = m.sum().clamp_min(1)
        loss = loss + decay ** s * (ce_tok * m).sum() / n
        with torch.no_grad():
            ok = core.to_target(lg.argmax(-1)) == tk[..., 0]
            # the chain: entry j at step s continues entry j's steps 0..s-1 (the same position's draft sequence)
            chain_ok = ok if chain_ok is None else chain_ok & ok
            sums[f"n{s}"] = float(m.sum())
            sums[f"ce{s}"] = float((ce_tok * m).sum())
            sums[f"top1_{s}"] = float((ok & m).sum())
            sums[f"in_vocab{s}"] = float(((didx[..., 0] >= 0) & m).sum())  # the target's token is draftable at all
            sums[f"chain{s}"] = float((chain_ok & mask[:, 0] & m).sum())
            sums[f"chain_n{s}"] = float((mask[:, 0] & m).sum())
            conf = lsm.max(-1).values.exp()  # the drafter's probability of its own draft
            above = conf[:, None] >= gates
            gate_on = above if gate_on is None else gate_on & above
            live = (mask[:, 0] & m)[:, None]
            counts = torch.stack([(gate_on & live).sum(0), (gate_on & (chain_ok & mask[:, 0] & m)[:, None]).sum(0)])
            for g, (drafted, accepted) in enumerate(zip(*counts.tolist())):  # (one read from the device)
                sums[f"gate{g}_drafted{s}"] = float(drafted)
                sums[f"gate{g}_accepted{s}"] = float(accepted)
    out = DrafterLoss(loss=loss, tokens=int(sums.get("n0", 0)), sums=sums)
    _fill_rates(out, sums, len(logits))
    return out


def _fill_rates(out: DrafterLoss, sums: dict, steps: int) -> None:
    for s in range(steps):
        n, cn = max(sums.get(f"n{s}", 0.0), 1.0), max(sums.get(f"chain_n{s}", 0.0), 1.0)
        out.ce.append(sums.get(f"ce{s}", 0.0) / n)
        out.top1.append(sums.get(f"top1_{s}", 0.0) / n)
        out.chain.append(sums.get(f"chain{s}", 0.0) / cn)


def summarize(sums: dict, steps: int) -> dict:
    """Summed `DrafterLoss.sums` (over batches, processes) -> the metrics a run records: per step `ce`, `top1`,
    `chain`, and `accepted_per_round` = sum of the chained agreements (expected drafts accepted per round of
    `steps` greedy drafts, the first one included); `in_vocab`: the share of step-0 targets (the target's argmax)
    inside the draft vocabulary, the ceiling of `top1[0]`; `gated`: per gate of `GATES`, drafts `drafted` and `accepted`
    per round when drafting stops at the first draft whose probability is below the gate (gate 0: the plain
    chain, `drafted` = `steps`, `accepted` = `accepted_per_round`)."""
    out = DrafterLoss(loss=torch.zeros(()))
    _fill_rates(out, sums, steps)
    gated = []
    for g, gate in enumerate(GATES):
        per_round = {}
        for what in ("drafted", "accepted"):
            per_round[what] = round(sum(sums.get(f"gate{g}_{what}{s}", 0.0) / max(sums.get(f"chain_n{s}", 0.0), 1.0)
                                        for s in range(steps)), 4)
        gated.append({"gate": gate, **per_round})
    return {"tokens": int(sums.get("n0", 0)), "ce": [round(x, 4) for x in out.ce],
            "top1": [round(x, 4) for x in out.top1], "chain": [round(x, 4) for x in out.chain],
            "accepted_per_round": round(sum(out.chain), 4),
            "in_vocab": round(sums.get("in_vocab0", 0.0) / max(sums.get("n0", 0.0), 1.0), 4), "gated": gated}


@torch.no_grad()
def sequence_items(adapter, seqs, layers, k: int = 64) -> list[dict]:
    """`(token ids, index of the first answer token)` per sequence -> `CachedSequences`-like items: the aux states
    `hidden.<layer>` (fp32), the target's top-k, and the loss on positions whose next token is an answer token."""
    from hispec.distill.features import _project_topk, frozen_batches

    items = [None] * len(seqs)
    for batch, _, states, final in frozen_batches(adapter, [s for s, _ in seqs], layers, batch_tokens=2048):
        for r, j in enumerate(batch):
            seq, start = seqs[j]
            n = len(seq)
            ids, logp = _project_topk(adapter, final[r, :n], min(k, adapter.vocab_size))
            mask = torch.zeros(n, dtype=torch.bool)
            mask[max(start - 1, 0): n - 1] = True
            items[j] = {"input_ids": torch.tensor(seq), "loss_mask": mask, "teacher_topk_ids": ids.long().cpu(),
                        "teacher_topk_logprobs": logp.cpu(),
                        **{f"hidden.{L}": states[L][r, :n].float().cpu() for L in layers}}
    return items


def teacher_top1_ranking(dataset, vocab_size: int) -> list[int]:
    """Every target token id, most frequent teacher top-1 over a `CachedSequences` (or a list of its items) first
    (ties: lower id first)."""
    if hasattr(dataset, "teacher_top1_counts"):
        counts = dataset.teacher_top1_counts(vocab_size)
    else:
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for i in range(len(dataset)):
            counts += torch.bincount(dataset[i]["teacher_topk_ids"][:, 0], minlength=vocab_size)
    order = torch.argsort(-counts, stable=True)  # most frequent first, ties by id
    return order.tolist()


def draft_vocab_from_cache(dataset, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent teacher top-1 tokens over a `CachedSequences` (ties: lower id first), sorted; token
    ids fill up in id order when fewer than `size` distinct tokens occur."""
    return torch.tensor(sorted(teacher_top1_ranking(dataset, vocab_size)[:size]), dtype=torch.long)


def validate_drafter_args(m, d, t) -> None:
    """eagle3 settings that need no model (`ConfigError`); nothing for other head types."""
    if m.head_type != "eagle3":
        if m.eagle3_aux_layers or m.eagle3_intermediate_size or m.eagle3_init_from:
            raise ConfigError("eagle3_aux_layers, eagle3_intermediate_size and eagle3_init_from apply to head_type "
                              "eagle3 only")
        return
    if m.eagle3_init_from:
        from hispec.drafters.eagle3 import is_drafter_run

        if not is_drafter_run(Path(m.eagle3_init_from).expanduser()):
            raise ConfigError(f"eagle3_init_from {m.eagle3_init_from} holds no EAGLE-3 drafter (hispec_drafter.json "
                              "is missing): name a finished eagle3 run's output_dir or recipes/artifacts/<model>/eagle3")
    if not d.feature_cache:
        raise ConfigError("an eagle3 drafter trains from a feature cache (its aux layers' states and the final "
                          "layer's top-k over whole sequences): set feature_cache: DIR")
    if m.eagle3_ttt_steps < 1:
        raise ConfigError(f"eagle3_ttt_steps must be >= 1, got {m.eagle3_ttt_steps}")
    if not 0.0 < m.eagle3_step_decay <= 1.0:
        raise ConfigError(f"eagle3_step_decay must be in (0, 1], got {m.eagle3_step_decay}")
    if m.eagle3_draft_vocab_size < 0:
        raise ConfigError(f"eagle3_draft_vocab_size must be >= 0 (0 = full vocabulary), got "
                          f"{m.eagle3_draft_vocab_size}")
    if m.eagle3_intermediate_size < 0:
        raise ConfigError(f"eagle3_intermediate_size must be >= 0 (0 = the target's), got {m.eagle3_intermediate_size}")
    if t.train_vocab_size:
        raise ConfigError("train_vocab_size is for exit heads; an eagle3 drafter sets eagle3_draft_vocab_size")
    if m.head_lora_rank:
        raise ConfigError("head_lora_rank applies to 'layer' heads, not to an eagle3 drafter")
    if len(set(m.eagle3_aux_layers)) != len(m.eagle3_aux_layers):
        raise ConfigError(f"eagle3_aux_layers must be distinct, got {m.eagle3_aux_layers}")


def drafter_aux_layers(m, num_layers: int) -> list[int]:
    """The aux layer ids of this run, checked against the target's depth (`ConfigError`)."""
    from hispec.drafters.eagle3 import default_aux_layers

    layers = list(m.eagle3_aux_layers) or default_aux_layers(num_layers)
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad:
        raise ConfigError(f"eagle3_aux_layers {bad} are out of range for a {num_layers}-layer model; choose ids in "
                          f"0..{num_layers} (id i = the residual stream after i layers)")
    return layers
