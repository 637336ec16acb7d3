"""`EarlyExitModel`: a frozen base causal LM plus exit heads at a draft layer and an intermediate-verifier layer.

Contract:
- `EarlyExitModel.from_base(model_or_path, draft_layer=..., verify_layer=..., head_type=...)` wraps a loaded
  `PreTrainedModel` (or a Hub id / folder / .gguf file) with untrained heads.
- `hispec.load(path_or_hub_id)` / `EarlyExitModel.save(path)` use the checkpoint format of design.md §5: a plain
  HF folder (stock `AutoModelForCausalLM` loads it as the base model) whose config.json carries one namespaced
  key `"hispec"`, plus `hispec_heads.safetensors`. A heads-only folder references its base by name and revision.
- Heads whose recorded base does not match the loaded base (depth, hidden size, vocabulary, architecture) are
  refused with a message that says what differs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from . import decoding, packed
from .drafters.eagle3 import Eagle3Drafter, is_drafter_run, load_drafter
from .gguf import load_gguf_model, load_gguf_tokenizer
from .drafters.heads import CONTEXT_DEFAULTS, EXTRA_CACHE_INDEX, HEAD_TYPES, ExitHead
from .io import atomic_dir, parse_dtype, read_json, resolve_file, write_json
from .layers import DecoderAdapter
from .sampling import VERIFICATIONS, check_verification
from .vocab import vocab_for_model

FORMAT_VERSION = 2  # 2: exits as a list, decoding.ngram, calibration; version-1 configs still load
HEADS_FILE = "hispec_heads.safetensors"
TRAIN_FILE = "hispec_train.json"  # a training run's record (train/heads.py; read by hispec-export)
METRICS_FILE = "metrics.json"  # a training run's held-out metrics
EXITS = ("draft", "verify")
DEFAULT_GAMMA = 4
DEFAULT_WINDOW = 4
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not fit the base model."""


def default_exits(num_layers: int) -> tuple[int, int]:
    """round(depth/8) and round(depth/4), kept inside 1 <= draft < verify < depth."""
    draft = max(1, round(num_layers / 8))
    verify = max(draft + 1, round(num_layers / 4))
    return draft, verify


def validate_exits(draft_layer: int, verify_layer: int, num_layers: int) -> None:
    for name, layer in (("draft_layer", draft_layer), ("verify_layer", verify_layer)):
        if not isinstance(layer, int) or not 1 <= layer < num_layers:
            raise ValueError(
                f"{name} {layer} is out of range for a {num_layers}-layer model; choose 1..{num_layers - 1}"
            )
    if not draft_layer < verify_layer:
        raise ValueError(
            f"draft_layer ({draft_layer}) must be below verify_layer ({verify_layer}): 1 <= L_d < L_i < {num_layers}"
        )


def context_layers_for(exits: dict[str, int], num_layers: int, mid: bool = False) -> dict[str, list[int]]:
    """The layers each exit's `context` head reads: its own exit and the final layer (and, for the draft head with
    `mid`, the verifier exit too)."""
    d, v = exits["draft"], exits["verify"]
    return {"draft": [d, v, num_layers] if mid else [d, num_layers], "verify": [v, num_layers]}


@dataclass
class HispecConfig:
    """What config.json's "hispec" key holds.

    Format 2 (written now): `"exits": [{"name": "draft", "layer": 4, "vocab_size": 8192}, {"name": "verify", ...}]`
    (ordered by depth), `"decoding": {"gamma", "window", "ngram": {...}, "verification"}` (verification: "token"
    or "hsd", see hispec.sampling; absent = "token") and an optional `"calibration"` (the
    latency model's measurements on one machine, see hispec.latency). Format 1 (`"exits": {"draft": 4, "verify":
    8}`, vocab sizes at the top level) is still read.
    """

    draft_layer: int
    verify_layer: int
    head_type: str = "linear"
    head_rank: int | None = None
    draft_vocab_size: int | None = None  # reduced output vocabulary of the draft head (None: full)
    verify_vocab_size: int | None = None  # ... of the verifier head
    gamma: int = DEFAULT_GAMMA
    window: int = DEFAULT_WINDOW
    base: dict = field(default_factory=dict)
    version: int = FORMAT_VERSION
    ngram: dict = field(default_factory=dict)  # NgramConfig fields for the n-gram level (empty: its defaults)
    verification: str = "token"  # sampling's acceptance rule at every level: "token" or "hsd" (hispec.sampling)
    calibration: dict | None = None  # hispec.latency.Calibration.to_dict(), or None
    # `context` heads: their settings (hispec.drafters.heads.CONTEXT_DEFAULTS keys) and, per exit, the layers they read
    context: dict | None = None
    context_layers: dict | None = None  # {"draft": [4, 30], "verify": [8, 30]}

    @property
    def exits(self) -> dict[str, int]:
        """Exit name -> layer, ordered by depth."""
        return {"draft": self.draft_layer, "verify": self.verify_layer}

    def layer_of(self, exit_name: str) -> int:
        try:
            return self.exits[exit_name]
        except KeyError:
            raise ValueError(f"unknown exit {exit_name!r}; this checkpoint has {', '.join(self.exits)}") from None

    def to_dict(self) -> dict:
        d = {
            "version": FORMAT_VERSION,
            "exits": [{"name": n, "layer": layer, "vocab_size": getattr(self, f"{n}_vocab_size")}
                      for n, layer in self.exits.items()],
            "head": {"type": self.head_type, "rank": self.head_rank, "shape": "residual-to-hidden",
                     **({"context": dict(self.context or {}), "context_layers": dict(self.context_layers)}
                        if self.head_type == "context" else {})},
            "decoding": {"gamma": self.gamma, "window": self.window},
            "base": dict(self.base),
        }
        if self.ngram:
            d["decoding"]["ngram"] = dict(self.ngram)
        if self.verification != "token":
            d["decoding"]["verification"] = self.verification
        if self.calibration:
            d["calibration"] = self.calibration
        return d

    @classmethod
    def from_dict(cls, d: dict) -> HispecConfig:
        try:
            version = int(d.get("version", 0))
            if version > FORMAT_VERSION:
                raise CheckpointError(
                    f"checkpoint format version {version} is newer than this hispec ({FORMAT_VERSION}); upgrade hispec"
                )
            exits = d["exits"]
            if isinstance(exits, dict):  # format 1
                layers = {n: int(exits[n]) for n in EXITS}
                vocab = {n: d.get(f"{n}_vocab_size") for n in EXITS}
            else:
                layers = {e["name"]: int(e["layer"]) for e in exits}
                vocab = {e["name"]: e.get("vocab_size") for e in exits}
                if sorted(layers) != sorted(EXITS):
                    raise CheckpointError(
                        f"checkpoint exits {sorted(layers)}: this hispec loads exactly the exits {list(EXITS)}"
                    )
            dec = d.get("decoding", {})
            verification = dec.get("verification", "token")
            if verification not in VERIFICATIONS:
                raise CheckpointError(f"checkpoint decoding.verification {verification!r} is unknown: this hispec "
                                      f"knows {', '.join(VERIFICATIONS)}")
            return cls(
                draft_layer=layers["draft"],
                verify_layer=layers["verify"],
                head_type=d["head"]["type"],
                head_rank=d["head"].get("rank"),
                draft_vocab_size=vocab["draft"],
                verify_vocab_size=vocab["verify"],
                gamma=int(dec.get("gamma", DEFAULT_GAMMA)),
                window=int(dec.get("window", DEFAULT_WINDOW)),
                base=dict(d.get("base", {})),
                version=version,
                ngram=dict(dec.get("ngram") or {}),
                verification=verification,
                calibration=d.get("calibration"),
                # written before context heads had a frontier path: none (the default for new heads is 1)
                context=({"frontier": 0, **(d["head"].get("context") or {})} if d["head"]["type"] == "context"
                         else d["head"].get("context")),
                context_layers={k: [int(x) for x in v] for k, v in d["head"]["context_layers"].items()}
                if d["head"].get("context_layers") else None,
            )
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"malformed 'hispec' config entry ({e!r}): {d}") from e


def base_identity(model: nn.Module, revision: str | None = None) -> dict:
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return {
        "name_or_path": getattr(config, "_name_or_path", "") or "",
        "revision": revision,
        "architectures": list(getattr(config, "architectures", None) or [type(model).__name__]),
        "model_type": getattr(config, "model_type", None),
        "num_hidden_layers": int(text.num_hidden_layers),
        "hidden_size": int(text.hidden_size),
        "vocab_size": int(text.vocab_size),
    }


def check_base_matches(recorded: dict, model: nn.Module, where: str = "heads") -> None:
    actual = base_identity(model)
    diffs = [
        f"{k}: heads expect {recorded[k]!r}, model has {actual[k]!r}"
        for k in ("num_hidden_layers", "hidden_size", "vocab_size", "architectures")
        if recorded.get(k) is not None and recorded[k] != actual[k]
    ]
    if diffs:
        raise CheckpointError(
            f"{where} were trained for base '{recorded.get('name_or_path')}' and do not fit this model "
            f"('{actual['name_or_path']}'): " + "; ".join(diffs)
        )


def load_base_model(name_or_path: str, dtype=None, device=None, revision: str | None = None) -> nn.Module:
    """A Hub id, a local HF folder or a `.gguf` file -> an eval-mode, frozen `PreTrainedModel`."""
    dtype = parse_dtype(dtype)
    path = str(name_or_path)
    if path.endswith(".gguf"):
        model = load_gguf_model(path, dtype=dtype, device=device)
    else:
        from transformers import AutoModelForCausalLM

        kwargs = {"revision": revision} if revision else {}
        if dtype is not None:
            kwargs["dtype"] = dtype
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if device is not None:
            model = model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_tokenizer(name_or_path: str, revision: str | None = None):
    """The tokenizer that goes with `load_base_model(name_or_path)`, or None if there is none."""
    path = str(name_or_path)
    if path.endswith(".gguf"):
        return load_gguf_tokenizer(path)
    from transformers import AutoTokenizer

    local = Path(path)
    if local.is_dir() and not any((local / f).exists() for f in _TOKENIZER_FILES):
        return None  # transformers would build an empty placeholder tokenizer for some model types
    try:
        return AutoTokenizer.from_pretrained(path, **({"revision": revision} if revision else {}))
    except (OSError, ValueError):
        return None


class EarlyExitModel(nn.Module):
    """A frozen base model with a draft head at `draft_layer` and a verifier head at `verify_layer`."""

    def __init__(self, base: nn.Module, config: HispecConfig, tokenizer=None):
        super().__init__()
        self.base = base
        self.adapter = DecoderAdapter(base)
        validate_exits(config.draft_layer, config.verify_layer, self.adapter.num_layers)
        if config.head_type not in HEAD_TYPES:
            raise ValueError(f"unknown head type '{config.head_type}'; choose one of {', '.join(HEAD_TYPES)}")
        if not config.base:
            config.base = base_identity(base)
        self.hispec_config = config
        self.tokenizer = tokenizer
        if config.head_type == "lowrank" and not config.head_rank:
            config.head_rank = min(64, self.adapter.hidden_size)
        rank = config.head_rank or 64
        exits = {"draft": config.draft_layer, "verify": config.verify_layer}
        if config.head_type == "context":
            config.context_layers = config.context_layers or context_layers_for(exits, self.adapter.num_layers)
            for name, layer in exits.items():
                got = config.context_layers.get(name)
                if not got or layer not in got or any(not layer <= x <= self.adapter.num_layers for x in got):
                    raise CheckpointError(
                        f"{name} context head reads layers {got}: they must include its own exit {layer} and lie "
                        f"in {layer}..{self.adapter.num_layers}")
        self.heads = nn.ModuleDict(
            {
                name: ExitHead(
                    config.head_type, self.adapter.final_norm, self.adapter.hidden_size, rank=rank,
                    # a `layer` head starts as a copy of the base layer right after its exit
                    layer=self.adapter.parts.layers[exits[name]] if config.head_type == "layer" else None,
                    layer_type=self.adapter.layer_types[exits[name]],
                    cache_index=self.adapter.num_layers + EXTRA_CACHE_INDEX[name],
                    context_layers=config.context_layers[name] if config.head_type == "context" else None,
                    context=config.context,
                )
                for name in EXITS
            }
        )
        for name in EXITS:
            size = self.vocab_size_of(name)
            if size is not None:
                if not 1 <= size <= self.adapter.vocab_size:
                    raise CheckpointError(
                        f"{name} head vocabulary of {size} tokens does not fit the model's {self.adapter.vocab_size}"
                    )
                self.heads[name].set_vocab(torch.arange(size))  # placeholder until the heads file is loaded
        self.heads.to(device=self.adapter.device, dtype=self.adapter.dtype)
        self.drafter = None  # an EAGLE-3 drafter (hispec.drafters.eagle3), the `eagle3` level; `attach_drafter`
        for p in self.base.parameters():
            p.requires_grad_(False)

    def attach_drafter(self, drafter) -> None:
        """Add an EAGLE-3 drafter (an `Eagle3Drafter`, or a folder holding `hispec_drafter.*`: a drafter run or a
        checkpoint exported with one) for the `eagle3` level; refused when it was made for another base."""
        if not isinstance(drafter, Eagle3Drafter):
            folder = drafter
            drafter, meta = load_drafter(folder)
            check_base_matches(dict(meta.get("base") or {}), self.base, where=f"the EAGLE-3 drafter in {folder}")
            # its drafts per round by default: a measured "gamma" if its files record one, else its training steps
            drafter.default_gamma = int(meta.get("gamma") or meta.get("ttt_steps") or 0) or None
        c = drafter.config
        if (c.hidden_size, c.vocab_size, c.target_num_layers) != (
                self.adapter.hidden_size, self.adapter.vocab_size, self.adapter.num_layers):
            raise CheckpointError(
                f"the EAGLE-3 drafter was made for a {c.target_num_layers}-layer model of hidden size {c.hidden_size} "
                f"and vocabulary {c.vocab_size}; this one has {self.adapter.num_layers} / {self.adapter.hidden_size} / "
                f"{self.adapter.vocab_size}")
        for p in drafter.parameters():
            p.requires_grad_(False)
        self.drafter = drafter.to(device=self.adapter.device, dtype=self.adapter.dtype).eval()

    # ------------------------------------------------------------------ properties
    @property
    def draft_layer(self) -> int:
        return self.hispec_config.draft_layer

    @property
    def verify_layer(self) -> int:
        return self.hispec_config.verify_layer

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    @property
    def exit_names(self) -> list[str]:
        """The exits' names, ordered by depth."""
        return list(self.hispec_config.exits)

    @property
    def extra_cache_layers(self) -> int:
        """Cache layers beyond the model's own that decoding must allocate (the `layer` heads' KV)."""
        return len(EXTRA_CACHE_INDEX) if self.stateful_heads else 0

    @property
    def device(self) -> torch.device:
        return self.adapter.device

    @property
    def dtype(self) -> torch.dtype:
        return self.adapter.dtype

    def vocab_size_of(self, exit_name: str) -> int | None:
        return getattr(self.hispec_config, f"{exit_name}_vocab_size")

    def set_exit_vocab(self, exit_name: str, ids) -> None:
        """Restrict exit `exit_name`'s head to the token ids `ids` (None: the full vocabulary); see hispec.vocab."""
        if exit_name not in EXITS:
            raise ValueError(f"unknown exit '{exit_name}'; choose one of {', '.join(EXITS)}")
        if ids is not None:
            ids = torch.as_tensor(ids, dtype=torch.long).flatten()
            if ids.numel() and int(ids.max()) >= self.adapter.vocab_size:
                raise ValueError(f"vocabulary ids must be < {self.adapter.vocab_size}, got {int(ids.max())}")
        self.heads[exit_name].set_vocab(ids)
        setattr(self.hispec_config, f"{exit_name}_vocab_size", self.heads[exit_name].vocab_size)

    @property
    def context_heads(self) -> bool:
        """True when the heads read the decoder's states of earlier positions (`context` heads)."""
        return any(h.needs_context for h in self.heads.values())

    @property
    def stateful_heads(self) -> bool:
        """True when the heads keep their own KV (`layer` heads): decoding allocates extra cache layers."""
        return any(h.stateful for h in self.heads.values())

    def exit_logits(self, exit_name: str, hidden: torch.Tensor, vocab: torch.Tensor | None = None,
                    run_layer=None, context=None) -> torch.Tensor:
        """Hidden `[.., H]` at exit `exit_name` ('draft' / 'verify') -> logits `[.., V]`.

        With `vocab` given: logits over those ids only, `[.., len(vocab)]`. Otherwise a head with a reduced
        vocabulary projects onto its ids only and returns full-size logits with -inf elsewhere. A `layer` head
        needs `run_layer`, a `context` head `context` (a `hispec.drafters.heads.ContextInputs`; see hispec.drafters.heads).
        """
        return self.project_exit(exit_name, self.heads[exit_name](hidden, run_layer, context), vocab)

    def project_exit(self, exit_name: str, feats: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Head features (the head's output) -> logits, honouring the head's reduced vocabulary."""
        head = self.heads[exit_name]
        if vocab is not None or head.vocab is None:
            return self.adapter.project(feats, vocab)
        sub = self.adapter.project(feats, head.vocab)
        out = sub.new_full((*sub.shape[:-1], self.adapter.vocab_size), float("-inf"))
        return out.index_copy_(-1, head.vocab, sub)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_base(
        cls,
        model_or_path,
        draft_layer: int | None = None,
        verify_layer: int | None = None,
        head_type: str = "linear",
        *,
        head_rank: int | None = None,
        gamma: int = DEFAULT_GAMMA,
        window: int = DEFAULT_WINDOW,
        dtype=None,
        device=None,
        revision: str | None = None,
        tokenizer=None,
        draft_vocab_size: int | None = None,
        verify_vocab_size: int | None = None,
        context: dict | None = None,
        context_mid: bool = False,
        verification: str = "token",
    ) -> EarlyExitModel:
        """Wrap a loaded model (or anything `load_base_model` accepts) with untrained heads.

        `context` heads: `context` overrides `hispec.drafters.heads.CONTEXT_DEFAULTS` (window, heads, head_dim, mlp_mult);
        `context_mid=True` lets the draft head also read the verifier exit's states of positions it verified.

        `draft_vocab_size` / `verify_vocab_size` restrict a head to that many tokens chosen by token id order
        (hispec.vocab; use `set_exit_vocab` with `hispec.vocab.vocab_for_model(..., files)` to count on data).
        `verification` ("token" or "hsd") is the sampling acceptance rule `generate` uses by default.
        """
        check_verification(verification)
        if isinstance(model_or_path, nn.Module):
            base = model_or_path
            dt = parse_dtype(dtype)
            if dt is not None or device is not None:
                base = base.to(device=device, dtype=dt)
            base.eval()
        else:
            base = load_base_model(model_or_path, dtype=dtype, device=device, revision=revision)
            if tokenizer is None:
                tokenizer = load_tokenizer(model_or_path, revision=revision)
        n = DecoderAdapter(base).num_layers
        d_default, v_default = default_exits(n)
        config = HispecConfig(
            draft_layer=d_default if draft_layer is None else draft_layer,
            verify_layer=v_default if verify_layer is None else verify_layer,
            head_type=head_type,
            head_rank=head_rank if head_type == "lowrank" else None,
            gamma=gamma,
            window=window,
            base=base_identity(base, revision),
            verification=verification,
        )
        if head_type == "context":
            config.context = {"frontier": CONTEXT_DEFAULTS["frontier"], **(context or {})}  # explicit in the config
            config.context_layers = context_layers_for(config.exits, DecoderAdapter(base).num_layers, context_mid)
        elif context or context_mid:
            raise ValueError(f"context settings apply to head_type='context', not {head_type!r}")
        if not isinstance(model_or_path, nn.Module):
            local = Path(str(model_or_path)).expanduser()
            config.base["name_or_path"] = str(local.absolute()) if local.exists() else str(model_or_path)
        model = cls(base, config, tokenizer=tokenizer)
        if draft_vocab_size or verify_vocab_size:
            for name, size in (("draft", draft_vocab_size), ("verify", verify_vocab_size)):
                if size:
                    model.set_exit_vocab(name, vocab_for_model(model, size))
        return model

    def heads_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.heads.state_dict().items()}

    def load_heads(self, path: str | os.PathLike) -> None:
        """Load `hispec_heads.safetensors` into the heads; clear errors for unreadable or ill-fitting files."""
        try:
            state = load_file(str(path), device=str(self.device))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"could not read heads file {path}: {e} (truncated or corrupt?)") from e
        target = self.heads.state_dict()
        # weights take the model's dtype, integer buffers (vocabulary ids) their own: ids written as fp32 by an
        # older trainer are exact there (< 2^24) but would be rounded in bf16
        state = {k: v.to(target[k].dtype if k in target and not target[k].is_floating_point() else self.dtype)
                 if v.is_floating_point() else v for k, v in state.items()}
        try:
            self.heads.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise CheckpointError(f"heads file {path} does not fit these heads: {e}") from e
        for name in EXITS:
            v = self.heads[name].vocab
            if v is not None and (int(v.max()) >= self.adapter.vocab_size or bool((v[1:] <= v[:-1]).any())):
                raise CheckpointError(f"heads file {path}: the {name} head's vocabulary ids are not sorted, unique "
                                      f"ids below {self.adapter.vocab_size}")

    def write_into(self, folder: str | os.PathLike, *, heads_only: bool = False,
                   max_shard_size: str | int = "5GB") -> None:
        """Write the checkpoint files into an existing folder (`save` wraps this in an atomic write)."""
        folder = Path(folder)
        if heads_only and not self.hispec_config.base.get("name_or_path"):
            raise CheckpointError(
                "a heads-only checkpoint must reference its base by name or path, but this base model has none; "
                "load the base from a folder or Hub id (or set hispec_config.base['name_or_path'])"
            )
        if heads_only:
            self.base.config.to_json_file(str(folder / "config.json"))
        else:
            self.base.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
        cfg = read_json(folder / "config.json")
        cfg["hispec"] = {**self.hispec_config.to_dict(), "heads_only": heads_only}
        write_json(folder / "config.json", cfg)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(folder)
        save_file(self.heads_state_dict(), str(folder / HEADS_FILE), metadata={"format": "pt", "hispec": "1"})

    def save(self, path: str | os.PathLike, *, overwrite: bool = False, heads_only: bool = False,
             max_shard_size: str | int = "5GB") -> Path:
        """Write the checkpoint folder atomically (temporary sibling, then one rename)."""
        with atomic_dir(path, overwrite=overwrite) as tmp:
            self.write_into(tmp, heads_only=heads_only, max_shard_size=max_shard_size)
        return Path(path)

    # ------------------------------------------------------------------ decoding
    def generate(self, input_ids, attention_mask=None, **kwargs):
        """Decode with a strategy ('auto', 'ar', 'self-spec', 'hispec', 'ngram', ... or a hierarchy such as
        'ngram>L4>full'); see `hispec.decoding.generate`."""
        return decoding.generate(self, input_ids, attention_mask=attention_mask, **kwargs)


def load(path_or_hub_id: str | os.PathLike, dtype=None, device=None, revision: str | None = None,
         pack: bool | None = None, drafter=None) -> EarlyExitModel:
    """Load a hispec checkpoint (local folder or Hub id): base + heads, checked against each other; an EAGLE-3
    drafter too when the folder holds one (`hispec_drafter.*`) or `drafter` names one (a drafter run folder).

    `pack`: multiply every linear layer through oneDNN-prepacked weights (`hispec.packed`: ~2x faster decoding on
    CPU, same tokens up to last-bit ties; twice the linear layers' weight memory). None packs on CPU in fp32 / bf16
    when this torch can; False keeps the stock kernels."""
    name = str(path_or_hub_id)
    if name.endswith(".gguf"):
        raise CheckpointError(
            f"{name} is a GGUF base model, not a hispec checkpoint; use EarlyExitModel.from_base({name!r}, ...)"
        )
    try:
        cfg = read_json(resolve_file(name, "config.json", revision))
    except FileNotFoundError as e:
        raise CheckpointError(f"{name} is not a model folder: {e}") from e
    if "hispec" not in cfg:
        raise CheckpointError(
            f"{name} has no 'hispec' entry in config.json: it is a plain model, not a hispec checkpoint. "
            "Wrap it with EarlyExitModel.from_base(...) and train heads, or export a trained run with hispec-export."
        )
    hconf = HispecConfig.from_dict(cfg["hispec"])
    try:
        heads_file = resolve_file(name, HEADS_FILE, revision)
    except FileNotFoundError as e:
        raise CheckpointError(f"{name} has no {HEADS_FILE}: {e}") from e
    if cfg["hispec"].get("heads_only"):
        base_ref = hconf.base.get("name_or_path")
        if not base_ref:
            raise CheckpointError(f"{name} is heads-only but records no base model name")
        base = load_base_model(base_ref, dtype=dtype, device=device, revision=hconf.base.get("revision"))
        tokenizer = load_tokenizer(name, revision) or load_tokenizer(base_ref, hconf.base.get("revision"))
    else:
        base = load_base_model(name, dtype=dtype, device=device, revision=revision)
        tokenizer = load_tokenizer(name, revision)
    check_base_matches(hconf.base, base, where=f"heads in {name}")
    model = EarlyExitModel(base, hconf, tokenizer=tokenizer)
    model.load_heads(heads_file)
    if drafter is None and Path(name).is_dir() and is_drafter_run(name):
        drafter = name
    if drafter is not None:
        model.attach_drafter(drafter)
    return packed.apply(model, pack)
