"""weights.bin: every initializer of a bundle's graphs above 1 KiB, each byte sequence stored once.

Each graph comes from the exporter as an ``onnx_ir`` model whose large initializers are the model's parameters
themselves (or constants folded from them). :class:`WeightsWriter` appends each one's bytes to weights.bin straight
from the tensor's memory (no copy), content-deduplicated across the graphs (the flavours share their weights, the
tied embedding serves the Gather and the LM head), and points the initializer at them; a parameter already written
is found by its memory and neither read nor hashed again. Once written, a parameter that views the mapped
checkpoint gives its pages back (:func:`.checkpoint.release_pages`), so a build holds the weights one at a time.
Small initializers stay inside the graphs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx_ir as ir
import torch

from .checkpoint import release_pages

WEIGHTS_FILE = "weights.bin"
EXTERNAL_MIN_BYTES = 1024  # smaller initializers stay inside the graph
ALIGN = 64  # byte alignment of every tensor in the weights file


class WeightsWriter:
    """Appends initializer bytes to one file, once per distinct content, and points initializers at them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")
        self.offsets: dict[tuple, tuple[int, int]] = {}  # (sha256, dtype) -> (offset, length)
        # a torch tensor's memory (address, bytes, dtype) -> (the tensor, kept alive so no other takes its address;
        # offset; length)
        self.placed: dict[tuple, tuple[torch.Tensor, int, int]] = {}

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self.file.tell()

    def externalize(self, model: ir.Model) -> None:
        """Store the initializers of ``model``'s graph of EXTERNAL_MIN_BYTES or more and make each refer to its
        bytes in the file (the graph's file must be saved beside it); the file is flushed, so a checker can read
        what the graph refers to."""
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if tensor is None or tensor.nbytes < EXTERNAL_MIN_BYTES:
                continue
            offset, length = self._place(tensor)
            shape = ir.Shape(tensor.shape.numpy())
            value.const_value = ir.ExternalTensor(
                WEIGHTS_FILE, offset, length, tensor.dtype, shape=shape, name=value.name, base_dir=self.path.parent
            )
        self.file.flush()

    def _place(self, tensor: ir.TensorProtocol) -> tuple[int, int]:
        """(offset, length) of ``tensor``'s bytes in the file, written unless a tensor of the same memory or the
        same content and dtype already was."""
        raw = getattr(tensor, "raw", None)
        if not isinstance(raw, torch.Tensor):
            return self._write(tensor.tobytes(), tensor.dtype)
        key = (raw.data_ptr(), raw.nbytes, tensor.dtype)
        if key not in self.placed:
            data = raw.detach().contiguous().reshape(-1).view(torch.uint8).numpy()  # the tensor's memory
            self.placed[key] = (raw, *self._write(data, tensor.dtype))
            del data
            release_pages(raw)
        return self.placed[key][1:]

    def _write(self, data, dtype: ir.DataType) -> tuple[int, int]:
        """Append ``data`` (a buffer of little-endian bytes), deduplicated by content and dtype: graphs may view the
        same bytes in other shapes, as the flavours do the conv weights."""
        key = (hashlib.sha256(data).hexdigest(), dtype)
        if key not in self.offsets:
            pos = self.file.tell()
            pad = (-pos) % ALIGN
            self.file.write(b"\0" * pad)
            self.offsets[key] = (pos + pad, memoryview(data).nbytes)
            self.file.write(data)
        return self.offsets[key]
