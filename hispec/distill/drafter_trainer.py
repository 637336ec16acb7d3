"""`train/heads.py --head_type eagle3`: an EAGLE-3 drafter (`hispec.drafters.eagle3`) trained by the distillation core.

Contract: the run goes through the same pipeline as exit heads -- checks, self-written prompts, self-distilled
answers, plain text, the feature cache (which then stores the drafter's aux layers and the final layer's top-k),
accelerate (CPU, CPU processes, DDP, DeepSpeed), checkpoints every `checkpointing_steps`, exact resume -- and differs
only in what trains:
- the settings are checked before any model is loaded (`hispec.distill.drafter.validate_drafter_args`); a drafter
  trains from a feature cache only (its training-time test unrolls several steps over whole sequences of cached
  states; running the backbone per step would cost more than the drafter);
- `DrafterTrainer(model, data, ...)`: a `Trainer` whose trained module is a `DrafterForTraining` (the drafter + the
  target's frozen embedding), whose step is `ttt_loss` over `eagle3_ttt_steps` draft steps, and whose evaluation
  is per draft step top-1 agreement with the target, the chained agreement and the expected accepted drafts per
  round on the held-out cache. The draft vocabulary is the `eagle3_draft_vocab_size` most frequent teacher top-1
  tokens of the training cache; the lm_head starts from the target's rows, the norm from its final norm --
  or, with `eagle3_init_from DIR`, everything (weights and draft vocabulary) from an earlier drafter of the same
  shape, to train it on with new data (checked before training; recorded in the run, so resume refuses another
  starting point); a larger `eagle3_draft_vocab_size` than that drafter's widens its draft vocabulary by the most
  frequent teacher top-1 tokens it lacks (`Eagle3Drafter.widened`). `save()`
  writes `hispec_drafter.safetensors` + `hispec_drafter.json` (`hispec.drafters.eagle3.save_drafter`) and `metrics.json`;
  `hispec-export RUN --format speculators` turns that into a vLLM / SGLang drafter.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from hispec.distill.args import ConfigError
from hispec.distill.drafter import drafter_aux_layers
from hispec.distill.trainer import Trainer


def _make_drafter(model, m, train_cache):
    """A fresh drafter for `model`'s base: its shape, the draft vocabulary counted on the training cache, the
    lm_head rows and final norm of the target. With `eagle3_init_from`, that drafter instead (`_init_drafter`)."""
    from hispec.distill.drafter import draft_vocab_from_cache
    from hispec.drafters.eagle3 import Eagle3Config, Eagle3Drafter

    adapter = model.adapter
    V = adapter.vocab_size
    size = m.eagle3_draft_vocab_size if 0 < m.eagle3_draft_vocab_size < V else V
    cfg = Eagle3Config.for_target(model.base.config, aux_layers=drafter_aux_layers(m, adapter.num_layers),
                                  draft_vocab_size=size, intermediate_size=m.eagle3_intermediate_size or None)
    head = model.base.get_output_embeddings().weight.detach().float()
    norm = getattr(adapter.final_norm, "weight", None)
    norm = None if norm is None or norm.shape != (cfg.hidden_size,) else norm.detach().float()
    if m.eagle3_init_from:
        drafter = _init_drafter(m.eagle3_init_from, cfg, model)
        if drafter.config.draft_vocab_size < size:  # widened: the trained rows kept, new ones from the target's
            from hispec.distill.drafter import teacher_top1_ranking

            drafter = drafter.widened(size, teacher_top1_ranking(train_cache, V), head, norm)
        return drafter
    drafter = Eagle3Drafter(cfg)
    if size < V:
        drafter.set_draft_vocab(draft_vocab_from_cache(train_cache, size, V))
    drafter.init_from_target(head, norm)
    return drafter.float()


def _init_drafter(folder, cfg, model):
    """The drafter saved in `folder` (weights and draft vocabulary, which is kept: the rows its lm_head learned
    belong to those tokens), after checking it has exactly the shape `cfg` this run asks for -- except a draft
    vocabulary smaller than the run's, which `_make_drafter` then widens -- and was trained for a target of this
    model's type (`ConfigError` naming every difference)."""
    from hispec.drafters.eagle3 import load_drafter

    drafter, meta = load_drafter(Path(folder).expanduser())
    have, want = drafter.config.to_dict(), cfg.to_dict()
    widens = (drafter.d2t is not None
              and have.get("draft_vocab_size", 0) < want.get("draft_vocab_size", 0) < want.get("vocab_size", 0))
    diff = [f"{k}: {have.get(k)!r} there, {want.get(k)!r} here" for k in sorted(set(have) | set(want))
            if have.get(k) != want.get(k) and not (k == "draft_vocab_size" and widens)]
    base = meta.get("base") or {}
    if base.get("model_type") not in (None, model.base.config.model_type):
        diff.append(f"target model_type: {base.get('model_type')!r} there, {model.base.config.model_type!r} here")
    if diff:
        raise ConfigError(f"eagle3_init_from {folder}: that drafter does not have the shape this run asks for ("
                          + "; ".join(diff) + "); set eagle3_aux_layers / eagle3_draft_vocab_size / "
                          "eagle3_intermediate_size to its values, or train from scratch")
    return drafter.float().train()


def _init_info(folder) -> dict | None:
    """What a run records about the drafter it started from: its folder and a hash of its weights file."""
    if not folder:
        return None
    from hispec.drafters.eagle3 import DRAFTER_FILE

    h = hashlib.sha256()
    with open(Path(folder).expanduser() / DRAFTER_FILE, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return {"folder": str(folder), "sha256": h.hexdigest()[:16]}


class DrafterTrainer(Trainer):
    """See the module docstring. Reuses `Trainer.loop` and `Trainer.save_checkpoint`; the trained module is kept
    under `self.heads`, the name the loop uses."""

    progress_name = "training eagle3 drafter"

    def __init__(self, model, data, m, d, g, t, accelerate_kwargs: dict, resume_dir=None):
        from hispec.distill.drafter import DrafterCollator, DrafterForTraining
        from hispec.distill.trainer import logger, output_dir_of

        if not data.cached:
            raise ConfigError("an eagle3 drafter trains from a feature cache: set feature_cache: DIR")
        self.model, self.data, self.t, self.m, self.adapter = model, data, t, m, model.adapter
        self.output_dir = output_dir_of(t)
        self.steps = m.eagle3_ttt_steps
        self.drafter = _make_drafter(model, m, data.train)
        self._prepare(DrafterForTraining(self.drafter, model.base.get_input_embeddings()),
                      DrafterCollator(self.drafter.config.aux_layers, self.steps), accelerate_kwargs)
        self.ranges = None
        c = self.drafter.config
        ids = self.drafter.draft_token_ids()
        self.run_info = {"head_type": "eagle3", "aux_layers": c.aux_layers, "ttt_steps": self.steps,
                         "step_decay": m.eagle3_step_decay, "draft_vocab_size": c.draft_vocab_size,
                         "draft_vocab_ids_sum": None if ids is None else int(ids.sum()),
                         "init_from": _init_info(m.eagle3_init_from), **self._data_info()}
        self._resume(resume_dir, ("head_type", "aux_layers", "ttt_steps", "step_decay", "draft_vocab_size",
                                  "draft_vocab_ids_sum", "init_from"))
        self._start_trackers("hispec-eagle3", m, d, g, t)
        logger.info("training an eagle3 drafter%s: aux layers %s, %d draft steps, draft vocabulary %d, %d sequences, "
                    "%d steps", f" from {m.eagle3_init_from}" if m.eagle3_init_from else "", c.aux_layers, self.steps,
                    c.draft_vocab_size, len(data.train), self.total_steps)

    def step_loss(self, batch, micro: int):
        from hispec.distill.drafter import ttt_loss

        out = ttt_loss(self.heads, batch, self.steps, self.m.eagle3_step_decay)
        stats = {"loss": out.loss.item(), **{f"top1/step{s}": v for s, v in enumerate(out.top1)},
                 **{f"chain/step{s}": v for s, v in enumerate(out.chain)}}
        return out.loss, stats

    @staticmethod
    def postfix(logs: dict) -> dict:
        return {"loss": f"{logs['loss']:.3f}", "top1": f"{logs['top1/step0']:.2f}",
                "chain": "/".join(f"{logs[k]:.2f}" for k in sorted(logs) if k.startswith("chain/"))}

    def evaluate(self, step: int, final: bool = False) -> dict | None:
        """Held-out per-step agreement summed exactly over batches and processes (`summarize`)."""
        from hispec.distill.drafter import summarize, ttt_loss

        if self.eval_dl is None:
            return None
        acc = self.accelerator
        keys, totals = None, None
        self.heads.eval()
        with torch.no_grad():
            for batch in self.eval_dl:
                sums = ttt_loss(self.heads, batch, self.steps, self.m.eagle3_step_decay).sums
                keys = keys or sorted(sums)
                row = torch.tensor([[sums.get(k, 0.0) for k in keys]], dtype=torch.float64,
                                   device=acc.device)
                g = acc.gather_for_metrics(row).sum(0).cpu()
                totals = g if totals is None else totals + g
        self.heads.train()
        res = summarize(dict(zip(keys or [], (totals.tolist() if totals is not None else []))), self.steps)
        res["step"] = step
        self.history.append(res)
        acc.log({"eval/top1_step0": res["top1"][0], "eval/accepted_per_round": res["accepted_per_round"]}, step=step)
        from hispec.distill.trainer import logger

        logger.info("eval @%d: top-1 by step %s, chained %s, accepted per round %.3f", step, res["top1"],
                    res["chain"], res["accepted_per_round"])
        return res

    def save(self) -> None:
        """Final evaluation, then the drafter (`hispec_drafter.*`), `metrics.json` and one JSON line."""
        from hispec.distill.trainer import METRICS_FILE
        from hispec.drafters.eagle3 import save_drafter
        from hispec.io import write_json

        acc = self.accelerator
        train_seconds = round(self.prior_seconds + time.time() - self.t_train, 1)
        final = self.evaluate(self.completed, final=True)
        state = acc.get_state_dict(self.heads)
        if acc.is_main_process:
            self.drafter.load_state_dict({k.removeprefix("drafter."): v for k, v in state.items()}, strict=False)
            base = dict(self.model.hispec_config.base)
            save_drafter(self.drafter.float(), self.output_dir, base=base,
                         extra={"ttt_steps": self.steps, "steps": self.completed, "train_seconds": train_seconds,
                                "metrics": None if final is None else {
                                    "held_out_top1_step0": final["top1"][0],
                                    "held_out_accepted_per_round": final["accepted_per_round"]},
                                "data": self.run_info, "args": self.config_dump})
            write_json(self.output_dir / METRICS_FILE, {"final": final, "history": self.history,
                                                        "steps": self.completed, "train_seconds": train_seconds})
            line = {"steps": self.completed, "train_seconds": train_seconds, "head_type": "eagle3"}
            if final is not None:
                line.update({"top1_by_step": final["top1"], "chain_by_step": final["chain"],
                             "accepted_per_round": final["accepted_per_round"]})
            print(json.dumps(line))
        acc.wait_for_everyone()
        acc.end_training()
