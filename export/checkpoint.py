"""Checkpoint loading: HF (``*-hf``) and original state-spaces Mamba-1 checkpoints into :class:`MambaLM`.

Weight files, first match wins: ``model.safetensors``; ``model.safetensors.index.json`` (shards);
``pytorch_model.bin`` (``torch.load(weights_only=True)``); ``pytorch_model.bin.index.json``.
Key schemes: ``backbone.embeddings.weight`` (HF) and ``backbone.embedding.weight`` (original).
A tied ``lm_head.weight`` may be absent. Every missing, unexpected or mis-shaped tensor is named in one error.

The weights are not read into memory at load: safetensors files are mapped copy-on-write and zip ``.bin`` files
through ``torch.load(mmap=True)``, and a tensor the model holds in the checkpoint's dtype becomes its parameter as a
view of the file, read when first used. Only tensors of another dtype are converted, once each. A build that has
written a parameter's bytes hands its pages back to the kernel (:func:`release_pages`), so the weights never need
to be resident all at once. A checkpoint file must not be rewritten in place while a model loaded from it is in use.
"""

from __future__ import annotations

import json
import mmap
import sys
import weakref
import zipfile
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

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# madvise(MADV_PAGEOUT) (Linux 5.4+; Python names it from 3.12 on): reclaim clean file pages now
_MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21) if sys.platform == "linux" else None
_MAPPED: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()  # address -> mapped file


def _safetensors_header(path: Path, size: int) -> tuple[dict, int]:
    """The header of a safetensors file (name -> dtype, shape, data_offsets) and where its data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= size - 8:
            raise ValueError(f"a header of {length} bytes in a file of {size}")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + length


def _safetensors_view(whole: torch.Tensor, entry: dict, start: int) -> torch.Tensor:
    """One tensor of a mapped safetensors file (``whole``: its bytes) as a view, or a copy when its offset is not a
    multiple of its element size (a view of another dtype needs that)."""
    dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"unsupported dtype {entry['dtype']}")
    shape, (begin, end) = [int(d) for d in entry["shape"]], entry["data_offsets"]
    numel = 1
    for d in shape:
        numel *= d
    if end - begin != numel * dtype.itemsize or begin < 0 or start + end > whole.numel():
        raise ValueError(f"data offsets {begin}..{end} do not fit shape {shape} {entry['dtype']} in the file")
    data = whole[start + begin : start + end]
    if (start + begin) % dtype.itemsize:
        data = data.clone()
    return data.view(dtype).reshape(shape)


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of the file mapped copy-on-write (nothing is read yet)."""
    try:
        size = path.stat().st_size
        header, start = _safetensors_header(path, size)
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        whole = torch.frombuffer(mapped, dtype=torch.uint8)  # [size]; keeps the mapping alive while views live
        _MAPPED[whole.data_ptr()] = mapped
        return {name: _safetensors_view(whole, entry, start) for name, entry in header.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{path}: cannot read safetensors file ({exc}); the file is corrupt or truncated"
        ) from None


def release_pages(tensor: torch.Tensor) -> None:
    """Hand the kernel back the resident pages of ``tensor`` when it views a mapped safetensors file: they are
    clean copies of the file, read again if the tensor is used again. A tensor of any other memory is left as it is.

    For a caller that has read the tensor and will not need it for a while (the bundle build after writing a
    parameter into weights.bin, the loader after converting one), so that the weights are resident one at a time.
    """
    mapped = _MAPPED.get(tensor.untyped_storage().data_ptr())
    if mapped is None or _MADV_PAGEOUT is None or tensor.numel() == 0:
        return
    begin = tensor.data_ptr() - tensor.untyped_storage().data_ptr()
    start = begin - begin % mmap.PAGESIZE
    try:
        mapped.madvise(_MADV_PAGEOUT, start, begin + tensor.nbytes - start)
    except OSError:
        pass  # a kernel before 5.4 knows no MADV_PAGEOUT: the pages stay until memory runs short


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        # the zip format (torch >= 1.6) is mapped, its tensors read when used; the legacy one is read whole
        data = torch.load(str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
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
    """Raw tensors of a checkpoint directory, keys renamed to the HF scheme (views of the mapped files where the
    format allows: see the module docstring)."""
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


def _model_dtypes(config: MambaConfig, precision: str) -> dict[str, torch.dtype]:
    """The dtype :meth:`MambaLM.to_precision` gives each tensor of the state dict (a model without storage); a
    tensor it replaces (int8's quantized matrices) is not named."""
    with torch.device("meta"):
        probe = MambaLM(config).to_precision(precision)
    return {key: value.dtype for key, value in probe.state_dict().items()}


def _fit_tensors(tensors: dict[str, torch.Tensor], model: MambaLM, precision: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the model's state dict: vocabulary padded, each in the dtype the model holds it
    in at ``precision``, converted only where the checkpoint's differs (one that ``to_precision`` replaces stays as
    it is: it converts that module by module). Raises CheckpointError naming every missing, unexpected or
    mis-shaped tensor."""
    config = model.config
    expected, dtypes = model.state_dict(), _model_dtypes(config, precision)
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)  # tied: the embedding serves as the head
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shaped, wrong = {}, []
    for key in sorted(set(expected) & set(tensors)):
        value = source = tensors.pop(key)
        if key in ("backbone.embeddings.weight", "lm_head.weight"):
            value = _fit_vocab(key, value, config)
        if tuple(value.shape) != tuple(expected[key].shape):
            wrong.append(f"{key}: checkpoint {tuple(value.shape)} vs config {tuple(expected[key].shape)}")
        shaped[key] = value.to(dtypes.get(key, value.dtype))
        if shaped[key] is not source:
            release_pages(source)  # read once, into the padded or converted copy
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    if wrong:
        problems.append(f"mis-shaped tensors [{'; '.join(wrong)}]")
    if problems:
        raise CheckpointError("weights do not match config.json: " + "; ".join(problems))
    return shaped


def load_model(checkpoint_dir: str | Path, precision: str = "fp32", max_rows: int = DEFAULT_MAX_ROWS) -> MambaLM:
    """Build a :class:`MambaLM` from a checkpoint directory (config.json + weights), in eval mode.

    The model is made without storage (the meta device) and takes the checkpoint's tensors as its parameters (see
    the module docstring): loading holds one copy of the weights at most, none for a checkpoint in the model's
    dtypes until they are used.
    """
    checkpoint_dir = Path(checkpoint_dir)
    config = load_config(checkpoint_dir)
    tensors = load_state_dict(checkpoint_dir)
    with torch.device("meta"):
        model = MambaLM(config, max_rows=max_rows)
    try:
        shaped = _fit_tensors(tensors, model, precision)
    except CheckpointError as exc:
        raise CheckpointError(f"{checkpoint_dir}: {exc}") from None
    model.load_state_dict(shaped, assign=True)
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"MambaLM tensors {left} are not in its state dict, so no checkpoint can fill them")
    model.eval()
    model.requires_grad_(False)
    model.to_precision(precision, replaced=release_pages)  # int8: each source read once, into its rows
    return model
