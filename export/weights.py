"""weights.bin: every initializer of a bundle's graphs above 1 KiB, each byte sequence stored once.

The graphs come from the exporter with external data files of their own; :func:`write_weights` moves every large
initializer into one file (content-deduplicated: the flavours share their weights, the tied embedding serves the
Gather and the LM head) and points the graphs' tensors at it. Small initializers stay inside the graphs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo

WEIGHTS_FILE = "weights.bin"
EXTERNAL_MIN_BYTES = 1024  # smaller initializers stay inside the graph
ALIGN = 64  # byte alignment of every tensor in the weights file


def initializer_bytes(tensor: onnx.TensorProto, base_dir: Path) -> bytes:
    """The raw little-endian bytes of an initializer, wherever they are stored (external data under ``base_dir``)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        info = ExternalDataInfo(tensor)
        with open(base_dir / info.location, "rb") as f:
            f.seek(info.offset or 0)
            return f.read(info.length) if info.length else f.read()
    return onnx.numpy_helper.to_array(tensor).tobytes() if not tensor.raw_data else tensor.raw_data


class WeightsWriter:
    """Appends initializer bytes to one file, once per distinct content, and points tensors at them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")
        self.offsets: dict[tuple, tuple[int, int]] = {}

    def externalize(self, tensor: onnx.TensorProto, data: bytes) -> None:
        """Store ``data`` (deduplicated by content and dtype: graphs may view the same bytes in other shapes, as the
        flavours do the conv weights) and make ``tensor`` refer to it."""
        key = (hashlib.sha256(data).hexdigest(), tensor.data_type)
        if key not in self.offsets:
            pos = self.file.tell()
            pad = (-pos) % ALIGN
            self.file.write(b"\0" * pad)
            self.offsets[key] = (pos + pad, len(data))
            self.file.write(data)
        offset, length = self.offsets[key]
        tensor.ClearField("raw_data")
        for name in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            tensor.ClearField(name)
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
            entry = tensor.external_data.add()
            entry.key, entry.value = k, v

    def close(self) -> int:
        """Close the file; returns its size."""
        self.file.close()
        return self.path.stat().st_size


def write_weights(protos: Iterable[onnx.ModelProto], raw_dir: Path, path: Path) -> int:
    """Move the large initializers of ``protos`` (their external data under ``raw_dir``) into ``path``, the small
    ones inside their graphs, editing the protos in place; returns the file's size."""
    writer = WeightsWriter(path)
    try:
        for proto in protos:
            for tensor in proto.graph.initializer:
                data = initializer_bytes(tensor, raw_dir)
                if len(data) >= EXTERNAL_MIN_BYTES:
                    writer.externalize(tensor, data)
                elif tensor.data_location == onnx.TensorProto.EXTERNAL:
                    del tensor.external_data[:]
                    tensor.data_location = onnx.TensorProto.DEFAULT
                    tensor.raw_data = data
    finally:
        size = writer.close()
    return size
