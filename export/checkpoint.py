"""Checkpoint loading: HF (``*-hf``) and original state-spaces Mamba-1 checkpoints into :class:`MambaLM`.

Weight files, first match wins: ``model.safetensors``; ``model.safetensors.index.json`` (shards);
``pytorch_model.bin`` (``torch.load(weights_only=True)``); ``pytorch_model.bin.index.json``.
Key schemes: ``backbone.embeddings.weight`` (HF) and ``backbone.embedding.weight`` (original).
A tied ``lm_head.weight`` may be absent. Every missing, unexpected or mis-shaped tensor is named in one error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mambatrt.config import MambaConfig, load_config
from mambatrt.contract import DEFAULT_MAX_ROWS
from mambatrt.errors import CheckpointError

from .model import MambaLM

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN, TORCH_BIN_INDEX)

_RENAMES = (("backbone.embedding.", "backbone.embeddings."),)


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: cannot read safetensors file ({exc}); the file is corrupt or truncated"
        ) from None


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad archive (pickle, zip, runtime errors)
        raise CheckpointError(f"{path}: cannot read PyTorch weights ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a state dict, found {type(data).__name__}")
    return data


def _load_index(path: Path, load_one) -> dict[str, torch.Tensor]:
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError, TypeError) as exc:
        raise CheckpointError(f"{path}: not a valid shard index ({exc!r}); it needs a 'weight_map' object") from None
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = path.parent / shard
        if not shard_path.is_file():
            raise CheckpointError(f"{shard_path}: shard listed in {path.name} is missing")
        tensors.update(load_one(shard_path))
    return tensors


def find_weight_file(checkpoint_dir: Path) -> Path:
    """The weights file (or shard index) of a checkpoint directory, by the preference order above."""
    for name in WEIGHT_FILES:
        if (checkpoint_dir / name).is_file():
            return checkpoint_dir / name
    raise CheckpointError(f"{checkpoint_dir}: no weights found; expected one of {', '.join(WEIGHT_FILES)}")


def load_state_dict(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """Raw tensors of a checkpoint directory, keys renamed to the HF scheme."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"{checkpoint_dir}: checkpoint directory not found")
    path = find_weight_file(checkpoint_dir)
    if path.name == SAFETENSORS:
        raw = _load_safetensors(path)
    elif path.name == SAFETENSORS_INDEX:
        raw = _load_index(path, _load_safetensors)
    elif path.name == TORCH_BIN:
        raw = _load_bin(path)
    else:
        raw = _load_index(path, _load_bin)
    out = {}
    for key, value in raw.items():
        for old, new in _RENAMES:
            if key.startswith(old):
                key = new + key[len(old) :]
        out[key] = value
    return out


def _fit_vocab(name: str, tensor: torch.Tensor, config: MambaConfig) -> torch.Tensor:
    """Pad an embedding/lm_head of V rows with zero rows up to Vp (original checkpoints are already padded)."""
    rows = tensor.shape[0]
    if tensor.dim() == 2 and config.vocab_size <= rows < config.vocab_padded:
        pad = torch.zeros(config.vocab_padded - rows, tensor.shape[1], dtype=tensor.dtype)
        return torch.cat([tensor, pad])
    return tensor


def load_model(checkpoint_dir: str | Path, precision: str = "fp32", max_rows: int = DEFAULT_MAX_ROWS) -> MambaLM:
    """Build a :class:`MambaLM` from a checkpoint directory (config.json + weights), in eval mode."""
    checkpoint_dir = Path(checkpoint_dir)
    config = load_config(checkpoint_dir)
    tensors = load_state_dict(checkpoint_dir)
    model = MambaLM(config, max_rows=max_rows)
    expected = model.state_dict()
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: the embedding serves as the head
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shaped = {}
    wrong = []
    for key in sorted(set(expected) & set(tensors)):
        value = tensors[key]
        if key in ("backbone.embeddings.weight", "lm_head.weight"):
            value = _fit_vocab(key, value, config)
        if tuple(value.shape) != tuple(expected[key].shape):
            wrong.append(f"{key}: checkpoint {tuple(value.shape)} vs config {tuple(expected[key].shape)}")
        shaped[key] = value.to(torch.float32)
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    if wrong:
        problems.append(f"mis-shaped tensors [{'; '.join(wrong)}]")
    if problems:
        raise CheckpointError(f"{checkpoint_dir}: weights do not match config.json: " + "; ".join(problems))
    model.load_state_dict(shaped)
    model.eval()
    model.requires_grad_(False)
    return model.to_precision(precision)
