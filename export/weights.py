"""weights.bin: every initializer of a bundle's graphs above 1 KiB, each byte sequence stored once.

An exported graph names the model's tensors it holds instead of carrying their bytes (:func:`refer_to_tensors`:
the exporter's large initializers are the model's parameters and buffers themselves), so that a graph traced in
another process comes back without them. :class:`WeightsWriter` then appends each named tensor's bytes to
weights.bin straight from the model's memory (no copy), and any other large initializer's (constants folded from
them), content-deduplicated across the graphs (the flavours share their weights, the tied embedding serves the
Gather and the LM head), and points the graph's initializers at them. A tensor is read and hashed once; once
written, one that views the mapped checkpoint gives its pages back (:func:`.checkpoint.release_pages`), so a build
holds the weights one at a time. Small initializers stay inside the graphs.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx
import onnx_ir as ir
import torch
from onnx.external_data_helper import ExternalDataInfo

from .checkpoint import release_pages

WEIGHTS_FILE = "weights.bin"
EXTERNAL_MIN_BYTES = 1024  # smaller initializers stay inside the graph
ALIGN = 64  # byte alignment of every tensor in the weights file
TENSOR_REF = "mambatrt-tensor:"  # the location of an initializer that names a model tensor, until it is stored


def refer_to_tensors(graph: ir.Model, tensors: dict[str, torch.Tensor]) -> None:
    """Make each initializer of ``graph`` of EXTERNAL_MIN_BYTES or more that is one of ``tensors`` (a model's state
    dict) name it (external data at ``TENSOR_REF`` + its name), so the graph serializes without its bytes."""
    names = {(t.data_ptr(), t.dtype, tuple(t.shape)): name for name, t in tensors.items() if t.is_contiguous()}
    for value in graph.graph.initializers.values():
        tensor = value.const_value
        raw = getattr(tensor, "raw", None)
        if tensor is None or tensor.nbytes < EXTERNAL_MIN_BYTES or not isinstance(raw, torch.Tensor):
            continue
        name = names.get((raw.data_ptr(), raw.dtype, tuple(raw.shape))) if raw.is_contiguous() else None
        if name is not None:  # the same memory, layout and shape: the same bytes
            shape = ir.Shape(tensor.shape.numpy())
            value.const_value = ir.ExternalTensor(
                TENSOR_REF + name, None, None, tensor.dtype, shape=shape, name=value.name
            )


class WeightsWriter:
    """Appends initializer bytes to one file, once per distinct content, and points graphs' initializers at them."""

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        """``tensors``: the model's state dict, whose tensors the graphs name (:func:`refer_to_tensors`)."""
        self.path = path
        self.tensors = tensors
        self.file = open(path, "wb")
        self.offsets: dict[tuple, tuple[int, int]] = {}  # (sha256, dtype) -> (offset, length)
        self.stored: dict[str, tuple[int, int]] = {}  # a named tensor -> (offset, length)

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    @property
    def size(self) -> int:
        """Bytes written so far."""
        return self.file.tell()

    def store(self, proto: onnx.ModelProto) -> None:
        """Store the graph's initializers that name a model tensor and those of EXTERNAL_MIN_BYTES or more, and
        make each refer to its bytes in the file (the graph's file must be saved beside it). The file is flushed,
        so a checker can read what the graph refers to."""
        for tensor in proto.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                location = ExternalDataInfo(tensor).location
                if not location.startswith(TENSOR_REF):
                    raise ValueError(f"initializer {tensor.name}: external data at {location}, not a model tensor")
                offset, length = self._store_tensor(location[len(TENSOR_REF) :], tensor.data_type)
            elif len(tensor.raw_data) >= EXTERNAL_MIN_BYTES:
                offset, length = self._write(tensor.raw_data, tensor.data_type)
                tensor.ClearField("raw_data")
            else:
                continue
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = k, v
        self.file.flush()

    def _store_tensor(self, name: str, data_type: int) -> tuple[int, int]:
        """(offset, length) of the model tensor ``name``, written from its memory the first time it is asked for."""
        if name not in self.stored:
            tensor = self.tensors[name]
            data = tensor.detach().reshape(-1).view(torch.uint8).numpy()  # the tensor's memory, no copy
            self.stored[name] = self._write(data, data_type)
            del data
            release_pages(tensor)
        return self.stored[name]

    def _write(self, data, data_type: int) -> tuple[int, int]:
        """Append ``data`` (a buffer of little-endian bytes), deduplicated by content and dtype: graphs may view the
        same bytes in other shapes, as the flavours do the conv weights."""
        key = (hashlib.sha256(data).hexdigest(), data_type)
        if key not in self.offsets:
            pos = self.file.tell()
            pad = (-pos) % ALIGN
            self.file.write(b"\0" * pad)
            self.offsets[key] = (pos + pad, memoryview(data).nbytes)
            self.file.write(data)
        return self.offsets[key]
