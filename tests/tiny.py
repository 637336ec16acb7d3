"""Tiny random models of every supported family, built offline from configs (no downloads)."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
              max_position_embeddings=256)

FAMILIES = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=None)),
    "mistral-sliding": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=5)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    "qwen2-sliding": ("Qwen2Config", dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=5,
                                          max_window_layers=2)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=8)),
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=8, sliding_window=5,
                                    attn_implementation="eager")),
    "gemma3": ("Gemma3TextConfig", dict(num_key_value_heads=2, head_dim=8, sliding_window=5,
                                        sliding_window_pattern=2)),
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, pad_token_id=0)),
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.5, use_parallel_residual=True)),
    "opt": ("OPTConfig", dict(ffn_dim=64, word_embed_proj_dim=16, pad_token_id=1)),
    # Families whose *ForCausalLM.forward transforms the logits after lm_head in its own code (not Gemma2's
    # soft-capping): Cohere multiplies by logit_scale, Granite divides by logits_scaling and also scales the input
    # embeddings in its model's forward (embedding_multiplier), outside any public module.
    "cohere": ("CohereConfig", dict(num_key_value_heads=2, logit_scale=3.0, bos_token_id=1, eos_token_id=2)),
    "granite": ("GraniteConfig", dict(num_key_value_heads=2, logits_scaling=4.0, embedding_multiplier=3.0,
                                      residual_multiplier=0.5, attention_multiplier=0.2)),
}


def tiny_config(family: str):
    cls_name, extra = FAMILIES[family]
    kwargs = dict(COMMON, **extra)
    if cls_name == "OPTConfig":
        kwargs.pop("intermediate_size")
    attn = kwargs.pop("attn_implementation", "sdpa")
    config = getattr(transformers, cls_name)(**kwargs)
    config._attn_implementation = attn
    return config


def tiny_model(family: str, seed: int = 0, dtype=torch.float32):
    torch.manual_seed(seed)
    config = tiny_config(family)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
    # Random init of norms is all-ones/zeros; perturb everything so exits differ and bugs show.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.to(dtype).eval()


CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,:;!?'-()\n"
CHAT = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def five_token_llama(seed: int = 0):
    """A 4-layer llama over a 5-token vocabulary with large random weights: its sequence distributions are far from
    uniform and small enough to enumerate exactly (the chi-square tests of sampling)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=5, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    base = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(torch.randn_like(p) * 0.6)
    return base.eval()


def negate_exits(model):
    """Make every exit head of `model` (linear heads) negate its input (y + W y = -y): exits that never agree with the
    model, so every draft is rejected."""
    with torch.no_grad():
        for head in model.heads.values():
            head.adapter.weight.copy_(-2 * torch.eye(head.adapter.weight.shape[0]))
    return model


def assert_same_decoding_after_a_round_trip(model, folder, **generate):
    """Save `model`, load it back with `hispec.load`, and check the heads and a `hispec` decoding are the same."""
    import hispec

    model.save(folder)
    loaded = hispec.load(folder)
    for k, v in model.heads_state_dict().items():
        assert torch.equal(loaded.heads_state_dict()[k], v), k
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, :3] = 0  # a left-padded row
    ids[am == 0] = 0
    a = model.generate(ids, am, max_new_tokens=10, strategy="hispec", gamma=2, window=3, **generate)
    b = loaded.generate(ids, am, max_new_tokens=10, strategy="hispec", gamma=2, window=3, **generate)
    assert torch.equal(a.sequences, b.sequences) and a.stats.accepted_at_verify == b.stats.accepted_at_verify
    return loaded


def char_tokenizer():
    """A 52-symbol character-level tokenizer with <pad>/<s>/</s>/<unk> and a chat template (fits vocab 97)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3} | {c: 4 + i for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("<s>|."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT
    return fast


def save_tiny(folder, family: str = "llama"):
    """A tiny model of `family` with `char_tokenizer()` saved as a plain HF folder."""
    tiny_model(family).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder
