"""The EAGLE-3 drafter (Li et al., arXiv 2503.01840), laid out exactly as the `speculators` library defines it.

Contract: the drafter knows nothing of the target model beyond tensors it is handed. It reads the target's residual
stream at a few *aux* layers of tokens the target has already seen, fuses them (`fc` over their concatenation), and
drafts autoregressively with ONE decoder layer of its own, feeding its own output state into the next step:

    step 0 (context position p, whose aux states g_p the target computed while verifying x_{p+1}):
        h = fc([g_p^{a1}; g_p^{a2}; g_p^{a3}])                                      # [B, T, H]
    every step (token x at position p + 1, state h that "predicted" it):
        e, s   = input_layernorm(embed(x)), hidden_norm(h)
        z      = h + attn([e; s])              q/k/v read 2H features, rotary at position p + 1
        z      = z + mlp(post_attention_layernorm(z))
        logits = lm_head(norm(z))              over the draft vocabulary; target id = d + d2t[d]
        the next step reads (its own drafted token, z)

Aux layer ids follow `speculators`/vLLM (`eagle_aux_hidden_state_layer_ids`): id i is the residual stream after i
decoder layers (the input of layer i; `hispec.layers.DecoderAdapter.run_layers` hands the same tensor to an exit at
layer i and the feature cache stores it as `hidden.<i>`); id = num_layers is the final layer's raw residual.

Parameter names equal `speculators`' `Eagle3DraftModel` (`fc`, `layers.0.self_attn.q_proj`, ..., `layers.0.hidden_norm`,
`norm`, `lm_head`, buffers `d2t` / `t2d`), so `hispec.export.speculators` saves the state dict as it is. The token
embedding is not owned: the target's is passed in (the export adds it for engines that want it in the folder).

Why not transformers' `LlamaDecoderLayer` with patched projections (what `speculators` does): its forward is tied to
transformers' attention interface and cache classes, which change between releases, while hispec needs one pure
function `step(embeds, hidden, positions, past, mask)` whose past keys/values the decoder stores and rolls back per
row. The pieces that are the same are reused: `LlamaRMSNorm`, `LlamaMLP`, `LlamaRotaryEmbedding`,
`apply_rotary_pos_emb`, and torch's `scaled_dot_product_attention`. `tests/test_eagle3.py` checks the logits
against `speculators`' own model.

Training ("training-time test", `ttt_logits`): every position drafts `steps` tokens in one pass per step; step s
reads the teacher-forced token x_{p+1+s} and its own previous output state, and attends to the step-0 keys of
positions <= p plus its own keys of steps 1..s (the same pattern as decoding, where a drafted token sees the
verified context and the tokens drafted before it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb,
)

from ..io import atomic_write, read_json, write_json

FORMAT_VERSION = 1


@dataclass
class Eagle3Config:
    """Shape of one drafter. `vocab_size` is the target's; `draft_vocab_size` <= it (a mapping is stored when less).
    `aux_layers`: the target layer ids read (see the module docstring). The attention/MLP shape defaults to the
    target's own layer (`for_target`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layers: list[int]
    target_num_layers: int
    rms_norm_eps: float = 1e-6
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False
    version: int = FORMAT_VERSION

    def __post_init__(self):
        self.aux_layers = [int(i) for i in self.aux_layers]
        if not self.aux_layers or len(set(self.aux_layers)) != len(self.aux_layers):
            raise ValueError(f"aux_layers must be distinct layer ids, got {self.aux_layers}")
        bad = [i for i in self.aux_layers if not 0 <= i <= self.target_num_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} are out of range for a {self.target_num_layers}-layer target; "
                             f"choose ids in 0..{self.target_num_layers} (id i = the residual after i layers)")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..{self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def for_target(cls, config, aux_layers=None, draft_vocab_size: int | None = None,
                   intermediate_size: int | None = None) -> Eagle3Config:
        """The drafter shape for a transformers decoder config (the text config of multimodal models): the target's
        hidden size (required: the drafter reads and shares its states and embedding), its attention heads and MLP
        width where it has them (else hidden / 64 heads and 4 x hidden; `intermediate_size` sets the MLP width). Rotary: plain RoPE at the target's
        rope_theta (10000 without one): the drafter's positions need no long-context scaling, and training,
        `speculators` and the engines all build the drafter's rotary from this config alone."""
        config = getattr(config, "text_config", None) or config
        missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if getattr(config, k, None) is None]
        if missing:
            raise ValueError(f"{type(config).__name__} has no {', '.join(missing)}: an EAGLE-3 drafter reads the "
                             "target's hidden states and needs its depth and vocabulary")
        n, H = int(config.num_hidden_layers), int(config.hidden_size)
        emb = getattr(config, "word_embed_proj_dim", None) or getattr(config, "embedding_size", None) or H
        if int(emb) != H:
            raise ValueError(f"{type(config).__name__} embeds tokens in {emb} dimensions, not its hidden size {H} "
                             "(a projection sits between them): an EAGLE-3 drafter concatenates the target's token "
                             "embedding with hidden states of the same width, so this target cannot have one")
        heads = int(getattr(config, "num_attention_heads", None) or max(1, H // 64))
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        inter = (intermediate_size or getattr(config, "intermediate_size", None) or getattr(config, "ffn_dim", None)
                 or 4 * H)
        rope = getattr(config, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)
        return cls(hidden_size=H, intermediate_size=int(inter), num_attention_heads=heads,
                   num_key_value_heads=kv if heads % kv == 0 else heads,
                   head_dim=int(getattr(config, "head_dim", None) or H // heads), vocab_size=int(config.vocab_size),
                   draft_vocab_size=int(draft_vocab_size or config.vocab_size),
                   aux_layers=list(aux_layers) if aux_layers is not None else default_aux_layers(n),
                   target_num_layers=n, rms_norm_eps=float(getattr(config, "rms_norm_eps", None) or 1e-6),
                   rope_parameters={"rope_type": "default", "rope_theta": theta},
                   max_position_embeddings=int(getattr(config, "max_position_embeddings", None) or 4096))

    def llama_config(self):
        """The one-layer `LlamaConfig` that describes the drafter's decoder layer (speculators'
        `transformer_layer_config`; vLLM and SGLang build the layer from it)."""
        return LlamaConfig(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, num_hidden_layers=1, vocab_size=self.vocab_size,
                           rms_norm_eps=self.rms_norm_eps, rope_parameters=dict(self.rope_parameters),
                           max_position_embeddings=self.max_position_embeddings, hidden_act="silu",
                           attention_bias=False, mlp_bias=False, tie_word_embeddings=False)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        d = dict(d)
        if int(d.get("version", 1)) > FORMAT_VERSION:
            raise ValueError(f"this eagle3 drafter was written by a newer hispec (format {d['version']}, this "
                             f"hispec reads <= {FORMAT_VERSION}); upgrade hispec")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown eagle3 drafter settings {sorted(unknown)}")
        return cls(**d)


def default_aux_layers(num_layers: int) -> list[int]:
    """`speculators`' and vLLM's default: a low, a middle and a late layer (2, n // 2, n - 3); for targets of
    fewer than 8 layers (tiny test models) 1, n // 2, n - 1."""
    n = num_layers
    return [2, n // 2, n - 3] if n >= 8 else sorted({min(1, n), max(1, n // 2) if n > 1 else 0, max(n - 1, 0)})


@dataclass
class DraftStep:
    """One drafter step over T new positions: `hidden` `[B, T, H]` its output state (the next step's input),
    `logits` `[B, T, draft_vocab_size]` (`[N, draft_vocab_size]` for the N positions a `select` kept), `key` /
    `value` `[B, kv_heads, T, head_dim]` for the caller's cache."""

    hidden: torch.Tensor
    logits: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


@dataclass
class KVBuffer:
    """A decoder's store of drafter keys/values by position: `k`, `v` `[B, kv_heads, P + 1 (+ N), head_dim]` (the
    last slot is scratch for padding queries; N spare slots past the positions hold a drafter tree's nodes,
    `hispec.decoding.eagle_tree`) and `pos` `[B, T]`, where this step's T new positions go. With a `KVBuffer` as
    `past`, `step` writes its keys there and its `mask` `[B, T, S]` covers buffer slots 0..S-1 (the new ones
    included)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        idx = self.pos[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
        self.k.scatter_(2, idx, k.to(self.k.dtype))
        self.v.scatter_(2, idx, v.to(self.v.dtype))


class _Attention(nn.Module):
    """Grouped-query attention whose projections read the 2H features [embedding; state]."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * H, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * H, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * H, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, H, bias=False)

    def forward(self, x, cos, sin, past=None, mask=None):
        """x `[B, T, 2H]`; past (key, value) `[B, kv, S, d]` or None, or a `KVBuffer`; mask `[B, T, S + T]` bool
        (True = attend; `[B, T, S]` over a buffer) or None (causal over the T new positions, no past) -> (out
        `[B, T, H]`, key, value of the new positions)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if isinstance(past, KVBuffer):  # decoding: write the new keys in place, attend over the buffer's first S
            past.write(k, v)
            keys, values = past.k[:, :, : mask.shape[-1]], past.v[:, :, : mask.shape[-1]]
        else:
            keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        attn_mask = None if mask is None else mask[:, None]
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, is_causal=mask is None,
                                           enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1)), k, v


class Eagle3Layer(nn.Module):
    """The drafter's decoder layer (speculators' `Eagle3FirstLayerMixin` on a Llama layer)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.self_attn = _Attention(cfg)
        self.mlp = LlamaMLP(cfg.llama_config())
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)

    def forward(self, embeds, hidden, cos, sin, past=None, mask=None):
        e, s = self.input_layernorm(embeds), self.hidden_norm(hidden)
        residual = s if self.norm_before_residual else hidden
        a, k, v = self.self_attn(torch.cat([e, s], -1), cos, sin, past, mask)
        z = residual + a
        return z + self.mlp(self.post_attention_layernorm(z)), k, v


class Eagle3Drafter(nn.Module):
    """fc + one Eagle-3 layer + norm + draft-vocabulary lm_head; see the module docstring."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.aux_layers) * H, H, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(cfg)])
        self.norm = LlamaRMSNorm(H, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg.llama_config())
        if cfg.draft_vocab_size < cfg.vocab_size:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)

    # -- vocabulary ------------------------------------------------------------------------------------------------
    def set_draft_vocab(self, token_ids) -> None:
        """The draft vocabulary: `draft_vocab_size` distinct target token ids (stored sorted, as offsets d2t)."""
        if self.d2t is None:
            raise ValueError("this drafter drafts over the full target vocabulary; it has no draft vocabulary to set")
        ids = torch.unique(torch.as_tensor(token_ids, dtype=torch.long).flatten())
        n = self.config.draft_vocab_size
        if ids.numel() != n or int(ids[0]) < 0 or int(ids[-1]) >= self.config.vocab_size:
            raise ValueError(f"a draft vocabulary needs {n} distinct ids in 0..{self.config.vocab_size - 1}, "
                             f"got {ids.numel()} distinct")
        ids = ids.to(self.d2t.device)
        self.d2t.copy_(ids - torch.arange(n, device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_token_ids(self) -> torch.Tensor | None:
        """`[draft_vocab_size]` target ids of the draft vocabulary (None: the full vocabulary)."""
        if self.d2t is None:
            return None
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices -> target token ids."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def init_from_target(self, lm_head_weight: torch.Tensor, final_norm_weight: torch.Tensor | None = None) -> None:
        """Start the output from the target's: lm_head rows of the draft vocabulary and the final norm's scale."""
        ids = self.draft_token_ids()
        with torch.no_grad():
            w = lm_head_weight if ids is None else lm_head_weight[ids.to(lm_head_weight.device)]
            self.lm_head.weight.copy_(w.to(self.lm_head.weight))
            if final_norm_weight is not None:
                self.norm.weight.copy_(final_norm_weight.to(self.norm.weight))

    def widened(self, size: int, ranking, lm_head_weight: torch.Tensor,
                final_norm_weight: torch.Tensor | None = None) -> "Eagle3Drafter":
        """A copy of this drafter drafting over `size` tokens: its own draft vocabulary plus the first target ids of
        `ranking` (most wanted first) it lacks. Every trained weight is kept, the lm_head rows with their tokens; a
        new token's row is the target's lm_head row rescaled from the target's final norm to this drafter's
        (`w_t * n_t / n_d` per feature), so the new logit starts as the target's head would score the drafter's
        output state. Lets a drafter trained on a small draft vocabulary go on training over a larger one when
        its measured coverage (`tools/drafter_eval.py`, in-vocab) caps its agreement."""
        old = self.draft_token_ids()
        n_old = self.config.draft_vocab_size
        if old is None or not n_old < size < self.config.vocab_size:
            raise ValueError(f"a draft vocabulary widens from {n_old} to more tokens, fewer than the target's "
                             f"{self.config.vocab_size} (asked: {size})")
        have = set(old.tolist())
        extra = [t for t in ranking if t not in have][: size - n_old]
        if len(extra) < size - n_old:
            raise ValueError(f"ranking offers {len(extra)} new tokens; widening to {size} needs {size - n_old}")
        wide = Eagle3Drafter(Eagle3Config.from_dict({**self.config.to_dict(), "draft_vocab_size": size}))
        state = {k: v for k, v in self.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
        wide.load_state_dict(state, strict=False)
        wide.to(self.lm_head.weight)
        ids = torch.cat([old.cpu(), torch.tensor(extra, dtype=torch.long)])
        order = torch.argsort(ids)
        wide.set_draft_vocab(ids)
        target_rows = lm_head_weight[torch.tensor(extra, dtype=torch.long).to(lm_head_weight.device)].float().cpu()
        if final_norm_weight is not None:
            n_d = self.norm.weight.detach().float().cpu()
            scale = final_norm_weight.detach().float().cpu() / torch.where(n_d.abs() < 1e-6, torch.ones_like(n_d), n_d)
            target_rows = target_rows * scale
        rows = torch.cat([self.lm_head.weight.detach().float().cpu(), target_rows])[order]
        with torch.no_grad():
            wide.lm_head.weight.copy_(rows.to(wide.lm_head.weight))
        return wide.train(self.training)

    # -- the computation -------------------------------------------------------------------------------------------
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux `[B, T, len(aux_layers) * H]` (the aux layers' states concatenated in `aux_layers` order) -> `[B, T, H]`."""
        return self.fc(aux)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor, past=None,
             mask: torch.Tensor | None = None, select: torch.Tensor | None = None) -> DraftStep:
        """One drafter step for T new positions: embeds `[B, T, H]` (the target's embedding of each position's
        token), hidden `[B, T, H]` (the fused aux state or the previous step's output), position_ids `[B, T]`,
        past (key, value) `[B, kv, S, d]`, mask `[B, T, S + T]` (None: causal, no past); select `[B, T]` bool:
        logits only at those positions (`[N, draft_V]`, row-major), the norm and lm_head skipped elsewhere."""
        cos, sin = self.rotary_emb(hidden, position_ids)
        z, k, v = self.layers[0](embeds, hidden, cos, sin, past, mask)
        out = z if select is None else z[select]
        return DraftStep(hidden=z, logits=self.lm_head(self.norm(out)), key=k, value=v)

    def ttt_logits(self, aux: torch.Tensor, embed, input_ids: torch.Tensor, steps: int,
                   valid: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   select: torch.Tensor | None = None, own_drafts: bool = False) -> list[torch.Tensor]:
        """Training-time test over whole (right-padded) sequences, `speculators`' semantics.

        aux `[B, T, A*H]`: entry j holds the aux states of position j; input_ids `[B, T]`: entry j holds token
        x_{j+1}, the token after the aux states' position (the caller shifts, as `speculators`' `shift_batch`);
        position_ids `[B, T]` (default 1..T); valid `[B, T]` bool (default all). Step s reads the teacher-forced
        tokens x_{j+1+s} (0 past the end) and its own step s-1 states; returns `steps` logits `[B, T, draft_V]`:
        step s at entry j predicts x_{j+2+s}. select `[B, T]` bool: logits only at those entries (`[N, draft_V]`
        per step, row-major): training's loss positions. The lm_head over an 8k-49k vocabulary is most of a step's
        work at these widths, and answers are a fraction of a padded batch (prompts and padding train nothing).
        `own_drafts` (greedy decoding's chains, no `select`): step s >= 1 reads the drafter's own step s-1 argmax at
        the same entry instead of the teacher's token, as the decoder's chain does; up to a chain's first wrong
        draft the two are the same, past it only this is the decoder's (the calibration prices gated chains)."""
        B, T = input_ids.shape
        dev = input_ids.device
        if valid is None:
            valid = torch.ones(B, T, dtype=torch.bool, device=dev)
        if position_ids is None:
            position_ids = torch.arange(1, T + 1, device=dev).expand(B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        base = causal[None] & valid[:, None, :]  # [B, T, T]: query i reads step-0 key j <= i of a real position
        diag = torch.eye(T, dtype=torch.bool, device=dev).expand(B, T, T)
        hidden = self.fuse(aux)
        keys, values, out = [], [], []
        ids = input_ids
        for s in range(steps):
            mask = torch.cat([base | diag] + [diag] * s, -1)  # step-0 keys, then the diagonal of steps 1..s
            past = None if s == 0 else (torch.cat(keys, 2), torch.cat(values, 2))
            r = self.step(embed(ids), hidden, position_ids + s, past, mask, select)
            keys.append(r.key)
            values.append(r.value)
            out.append(r.logits)
            hidden = r.hidden
            if own_drafts:
                ids = self.to_target(r.logits.argmax(-1))
            else:
                ids = torch.cat([input_ids[:, s + 1:], input_ids.new_zeros(B, s + 1)], 1)
        return out

    def extra_repr(self) -> str:
        c = self.config
        return f"aux_layers={c.aux_layers}, draft_vocab={c.draft_vocab_size}/{c.vocab_size}"


# -- the drafter's files in a training run's output folder ---------------------------------------------------------
DRAFTER_FILE = "hispec_drafter.safetensors"
DRAFTER_CONFIG = "hispec_drafter.json"
DRAFTER_FORMAT = "hispec-eagle3"


# hispec_drafter.json "version": 1 = the weights as floats; 2 = "storage": "int8" (per-row int8 + a scale each)
FILE_VERSIONS = {"float": 1, "int8": 2}
FILE_VERSION = max(FILE_VERSIONS.values())  # the newest this hispec reads
STORAGE = tuple(FILE_VERSIONS)
SCALE_SUFFIX = ".int8_scale"  # (no parameter of a drafter ends so)


def quantize_int8(state: dict) -> dict:
    """Every 2-D floating weight of a state dict as symmetric per-output-row int8, q = round(w / s) with
    s = max|w_row| / 127 stored beside it as `<name>.int8_scale` (fp32); other tensors unchanged. Why hand-written: the
    ecosystem's int8 formats (torchao, bitsandbytes, compressed-tensors) quantize for int8 *compute* and need their
    own runtime; this is storage only (a shipped drafter under 50 MB), dequantized once at load."""
    out = {}
    for k, v in state.items():
        if v.dim() == 2 and v.is_floating_point():
            w = v.float()
            scale = w.abs().amax(1).clamp(min=1e-12) / 127
            out[k] = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            out[k + SCALE_SUFFIX] = scale
        else:
            out[k] = v
    return out


def dequantize_int8(state: dict) -> dict:
    """The inverse of `quantize_int8` (fp32 weights)."""
    return {k: (v.float() * state[k + SCALE_SUFFIX][:, None] if k + SCALE_SUFFIX in state else v)
            for k, v in state.items() if not k.endswith(SCALE_SUFFIX)}


def save_drafter(drafter: Eagle3Drafter, folder, *, base: dict, extra: dict | None = None,
                 storage: str = "float") -> None:
    """Write `hispec_drafter.safetensors` (the state dict, speculators' names) and `hispec_drafter.json` (format,
    config, the target's identity `base` from `hispec.model.base_identity`) into `folder`, each atomically.
    `storage="int8"`: the weights as per-row int8 (`quantize_int8`; a quarter of fp32, loaded back as floats)."""
    if storage not in STORAGE:
        raise ValueError(f"storage must be one of {', '.join(STORAGE)}, got {storage!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()
             if not k.startswith("rotary_emb.")}
    if storage == "int8":
        state = quantize_int8(state)
    atomic_write(folder / DRAFTER_FILE, lambda p: save_file(state, str(p)))
    meta = {"format": DRAFTER_FORMAT, "version": FILE_VERSIONS[storage], "config": drafter.config.to_dict(),
            "base": base, **(extra or {})}
    if storage == "int8":
        meta["storage"] = "int8"
    write_json(folder / DRAFTER_CONFIG, meta)


def is_drafter_run(folder) -> bool:
    return (Path(folder) / DRAFTER_CONFIG).is_file()


def load_drafter(folder, device=None, dtype=None) -> tuple[Eagle3Drafter, dict]:
    """(drafter, its json) from a folder `save_drafter` wrote; a clear error for anything else."""
    folder = Path(folder)
    if not (folder / DRAFTER_CONFIG).is_file():
        raise FileNotFoundError(f"{folder} holds no EAGLE-3 drafter ({DRAFTER_CONFIG} is missing); train one with "
                                "train/heads.py --head_type eagle3")
    meta = read_json(folder / DRAFTER_CONFIG)
    if meta.get("format") != DRAFTER_FORMAT:
        raise ValueError(f"{folder / DRAFTER_CONFIG} is not a {DRAFTER_FORMAT} file (format {meta.get('format')!r})")
    if int(meta.get("version", 1)) > FILE_VERSION or meta.get("storage", "float") not in STORAGE:
        raise ValueError(f"{folder / DRAFTER_CONFIG} is version {meta.get('version')} (storage "
                         f"{meta.get('storage', 'float')!r}); hispec reads <= {FILE_VERSION}: upgrade hispec")
    drafter = Eagle3Drafter(Eagle3Config.from_dict(meta["config"]))
    state = load_file(str(folder / DRAFTER_FILE))
    if meta.get("storage") == "int8":
        state = dequantize_int8(state)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary_emb.")]
    if missing or unexpected:
        raise ValueError(f"{folder / DRAFTER_FILE} does not fit its config: missing {missing}, unexpected {unexpected}")
    drafter.to(device=device, dtype=dtype)
    return drafter.eval(), meta
