"""Model configuration of a Mamba-1 language model, read from a HF or an original state-spaces ``config.json``.

Dimension letters used across the project:

    S  rows (prompt tokens in one prefill chunk)      D  model width (hidden_size / d_model)
    E  inner width (d_inner = expand * D)             N  SSM state size (d_state)
    K  conv kernel width (d_conv)                     R  time-step rank (dt_rank)
    L  layers                                         V  vocabulary (padded: Vp)

Pure Python: the runtime reads the same dataclass from a bundle without torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

DEFAULT_PAD_VOCAB_MULTIPLE = 8


@dataclass(frozen=True)
class MambaConfig:
    """Shape and options of a Mamba-1 LM. Derived sizes are properties, computed from the stored fields."""

    d_model: int  # D
    n_layer: int  # L
    vocab_size: int  # V, the tokenizer's vocabulary as the checkpoint's config states it
    d_state: int = 16  # N
    d_conv: int = 4  # K
    expand: int = 2
    d_inner: int = 0  # E; 0 means expand * d_model
    dt_rank: int = 0  # R; 0 means ceil(d_model / 16)
    conv_bias: bool = True
    proj_bias: bool = False  # bias on in_proj / out_proj
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    pad_vocab_multiple: int = DEFAULT_PAD_VOCAB_MULTIPLE

    def __post_init__(self) -> None:
        if self.d_inner == 0:
            object.__setattr__(self, "d_inner", self.expand * self.d_model)
        if self.dt_rank == 0:
            object.__setattr__(self, "dt_rank", math.ceil(self.d_model / 16))
        for name in ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "d_inner", "dt_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config field '{name}' must be a positive integer, got {value!r}")
        if self.d_conv < 2:
            raise ConfigError(f"config field 'd_conv' (conv_kernel) must be at least 2, got {self.d_conv}")
        if self.pad_vocab_multiple < 1:
            raise ConfigError(f"config field 'pad_vocab_size_multiple' must be >= 1, got {self.pad_vocab_multiple}")

    @property
    def vocab_padded(self) -> int:
        """Vp: rows of the embedding and columns of the logits (vocab rounded up to pad_vocab_multiple)."""
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def conv_state_shape(self) -> tuple[int, int, int]:
        """[L, E, K-1]: the previous K-1 conv inputs of every layer."""
        return (self.n_layer, self.d_inner, self.d_conv - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        """[L, E, N]: the selective-scan state of every layer."""
        return (self.n_layer, self.d_inner, self.d_state)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the stored fields (what a bundle manifest records)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MambaConfig:
        """Inverse of :meth:`to_dict`; unknown or missing fields are refused by name."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ConfigError(f"unknown model config field(s) {unknown}; expected a subset of {sorted(fields)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ConfigError(f"model config is incomplete: {exc}") from None


def _require(raw: dict[str, Any], key: str, source: str) -> Any:
    if key not in raw:
        raise ConfigError(f"{source}: missing field '{key}' needed for a Mamba-1 model")
    return raw[key]


def config_from_hf(raw: dict[str, Any], source: str = "config.json") -> MambaConfig:
    """Build a config from a transformers ``MambaConfig`` dict (model_type "mamba")."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act '{act}' is not supported; Mamba-1 uses 'silu'")
    rank = raw.get("time_step_rank", "auto")
    hidden = int(_require(raw, "hidden_size", source))
    return MambaConfig(
        d_model=hidden,
        n_layer=int(_require(raw, "num_hidden_layers", source)),
        vocab_size=int(_require(raw, "vocab_size", source)),
        d_state=int(_require(raw, "state_size", source)),
        d_conv=int(_require(raw, "conv_kernel", source)),
        expand=int(raw.get("expand", 2)),
        d_inner=int(_require(raw, "intermediate_size", source)),
        dt_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
        conv_bias=bool(raw.get("use_conv_bias", True)),
        proj_bias=bool(raw.get("use_bias", False)),
        norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", True)),
        pad_vocab_multiple=int(raw.get("pad_vocab_size_multiple", DEFAULT_PAD_VOCAB_MULTIPLE)),
    )


def config_from_original(raw: dict[str, Any], source: str = "config.json") -> MambaConfig:
    """Build a config from an original state-spaces config (``d_model``, ``n_layer``, ``ssm_cfg``, ...)."""
    ssm_cfg = raw.get("ssm_cfg") or {}
    layer = ssm_cfg.get("layer", "Mamba1")
    if layer != "Mamba1":
        raise ConfigError(f"{source}: ssm_cfg.layer '{layer}' is not supported; mambatrt handles Mamba-1 only")
    if raw.get("d_intermediate", 0):
        raise ConfigError(f"{source}: d_intermediate={raw['d_intermediate']} (MLP blocks) is not supported")
    if raw.get("attn_layer_idx"):
        raise ConfigError(f"{source}: attn_layer_idx (hybrid attention layers) is not supported")
    if not raw.get("rms_norm", True):
        raise ConfigError(f"{source}: rms_norm=false (LayerNorm) is not supported; set up RMSNorm models only")
    d_model = int(_require(raw, "d_model", source))
    rank = ssm_cfg.get("dt_rank", "auto")
    return MambaConfig(
        d_model=d_model,
        n_layer=int(_require(raw, "n_layer", source)),
        vocab_size=int(_require(raw, "vocab_size", source)),
        d_state=int(ssm_cfg.get("d_state", 16)),
        d_conv=int(ssm_cfg.get("d_conv", 4)),
        expand=int(ssm_cfg.get("expand", 2)),
        dt_rank=math.ceil(d_model / 16) if rank == "auto" else int(rank),
        conv_bias=bool(ssm_cfg.get("conv_bias", True)),
        proj_bias=bool(ssm_cfg.get("bias", False)),
        norm_eps=float(raw.get("norm_epsilon", 1e-5)),
        tie_embeddings=bool(raw.get("tie_embeddings", True)),
        pad_vocab_multiple=int(raw.get("pad_vocab_size_multiple", DEFAULT_PAD_VOCAB_MULTIPLE)),
    )


def parse_config(raw: dict[str, Any], source: str = "config.json") -> MambaConfig:
    """Dispatch on the config's flavour: HF (``model_type``) or original (``d_model``)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type is not None:
        if model_type != "mamba":
            raise ConfigError(
                f"{source}: model_type '{model_type}' is not supported; mambatrt handles Mamba-1 (model_type 'mamba')"
            )
        return config_from_hf(raw, source)
    if "d_model" in raw:
        return config_from_original(raw, source)
    raise ConfigError(
        f"{source}: neither 'model_type' (HF) nor 'd_model' (state-spaces) found; is this a Mamba-1 checkpoint?"
    )


def load_config(path: str | Path) -> MambaConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found; a checkpoint directory needs a config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); re-download or re-save the checkpoint") from None
    return parse_config(raw, str(path))
