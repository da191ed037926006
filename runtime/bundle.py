"""Bundles on disk: the manifest schema, validation and loading. Pure Python + hashlib (no torch, no numpy).

A bundle directory (see bundles/README.md):

    manifest.json    :class:`mambatrt.manifest.Manifest`: layout, precision, model config, files with sha256
    config.json      the checkpoint's model config (as given)
    tokenizer.json   when the checkpoint has one
    decode.onnx      one-token graph           engine.plan    its TensorRT plan (optional)
    prefill.onnx     1..max rows graph         prefill.plan   its TensorRT plan (optional; layout "split" only)
    weights.bin      the graphs' shared weights
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from mambatrt.config import MambaConfig
from mambatrt.contract import KERNELS, PORTABLE, PREFILL, GraphContract
from mambatrt.errors import BundleError
from mambatrt.manifest import MANIFEST, Manifest, PlanInfo, graphs_for_layout
from mambatrt.paths import sha256_file


@dataclass(frozen=True)
class Bundle:
    """A validated bundle: where it is and its manifest."""

    path: Path
    manifest: Manifest

    @property
    def config(self) -> MambaConfig:
        """The model's configuration."""
        return self.manifest.model

    @property
    def layout(self) -> str:
        """ "split" (prefill + decode engines) or "single" (decode only)."""
        return self.manifest.layout

    @property
    def precision(self) -> str:
        """fp32, fp16, bf16 or int8."""
        return self.manifest.precision

    @property
    def max_prefill_rows(self) -> int:
        """Largest chunk the prefill graph takes (1 for single bundles)."""
        return self.manifest.max_prefill_rows

    @property
    def graphs(self) -> tuple[str, ...]:
        """The graphs this bundle holds."""
        return graphs_for_layout(self.layout)

    def contract(self, graph: str, flavour: str = PORTABLE) -> GraphContract:
        """The I/O contract of one graph of one flavour."""
        return self.manifest.contract(graph, flavour)

    def prefill_batch(self, flavour: str) -> int:
        """Sequences one launch of ``flavour``'s prefill graph takes (1: portable graphs, bundles before schema 3)."""
        return self.manifest.prefill_batch(flavour) if PREFILL in self.graphs else 1

    @property
    def flavours(self) -> tuple[str, ...]:
        """The graph flavours this bundle holds that the runtime runs: "portable", and "kernels" when it was built
        with the kernels library (bundles of older versions may list other flavours' graphs, which are ignored)."""
        return (PORTABLE, *(f for f in self.manifest.flavour_graphs if f == KERNELS))

    @property
    def kernels_library(self) -> Path | None:
        """The "kernels" flavour's op library (onnxruntime custom ops), when the bundle has one."""
        library = self.manifest.kernels_library
        return self.path / library["file"] if library else None

    @property
    def kernels_cuda(self) -> bool:
        """Whether the op library has the CUDA kernels (built with nvcc), not only the CPU ones."""
        return bool(self.manifest.kernels_library and self.manifest.kernels_library.get("cuda"))

    @property
    def cuda_graphs(self) -> dict[str, str]:
        """graph -> the file of the kernels graph's CUDA copy (MambaLinear), for the graphs that have one."""
        return (self.manifest.kernels_library or {}).get("cuda_graphs") or {}

    @property
    def cpu_graphs(self) -> dict[str, str]:
        """graph -> the file of the kernels graph's CPU copy (MambaLinear), for the graphs that have one."""
        return (self.manifest.kernels_library or {}).get("cpu_graphs") or {}

    @property
    def greedy_path(self) -> Path | None:
        """The greedy picker's ONNX file, when the bundle has one."""
        name = self.manifest.greedy_graph
        return self.path / name if name else None

    @property
    def score_path(self) -> Path | None:
        """The scoring graph's ONNX file (every row's logits), when the bundle has one."""
        name = self.manifest.score_graph
        return self.path / name if name else None

    def graph_path(self, graph: str, flavour: str = PORTABLE, cuda: bool = False, cpu: bool = False) -> Path:
        """Path of a graph's ONNX file in the given flavour; ``cuda``: the kernels graph's copy for onnxruntime's
        CUDA provider, whose fp32 projections are MambaLinear, where the bundle has one; ``cpu``: likewise its copy
        for the CPU provider."""
        if cuda and flavour == KERNELS and graph in self.cuda_graphs:
            return self.path / self.cuda_graphs[graph]
        if cpu and flavour == KERNELS and graph in self.cpu_graphs:
            return self.path / self.cpu_graphs[graph]
        files = self.manifest.graphs if flavour == PORTABLE else self.manifest.flavour_graphs[flavour]
        return self.path / files[graph]

    def plan(self, graph: str) -> PlanInfo | None:
        """How a graph's plan was built, or None when the bundle has no plan for it."""
        return self.manifest.plans.get(graph)

    def plan_path(self, graph: str) -> Path:
        """Path of a graph's plan file."""
        return self.path / self.manifest.plans[graph].file

    @property
    def tokenizer_path(self) -> Path | None:
        """tokenizer.json when the bundle has one."""
        name = self.manifest.tokenizer
        return self.path / name if name else None

    @property
    def identity(self) -> str:
        """Fingerprint of the model a saved state belongs to: the sha256 of the graphs and weights."""
        h = hashlib.sha256()
        for name, record in sorted(self.manifest.files.items()):
            if name.endswith(".onnx") or name == "weights.bin":
                h.update(f"{name}:{record.sha256};".encode())
        return h.hexdigest()


def load_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Read and validate a bundle directory; ``verify`` checks every file's size and sha256.

    Raises BundleError naming the problem (missing directory or file, corrupt manifest, wrong format or schema,
    unknown layout, hash mismatch) and what to do.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise BundleError(f"{path}: is a file, not a bundle directory; pass the folder `mambatrt bundle` wrote")
    if not path.is_dir():
        raise BundleError(
            f"{path}: bundle directory not found; build one with `mambatrt bundle CHECKPOINT --out {path}`"
        )
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise BundleError(f"{manifest_path}: missing; this is not a mambatrt bundle (rebuild with `mambatrt bundle`)")
    try:
        data = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{manifest_path}: corrupt or truncated JSON ({exc}); rebuild the bundle") from None
    manifest = Manifest.from_json(data, str(manifest_path))
    for name, record in manifest.files.items():
        file = path / name
        if not file.is_file():
            raise BundleError(f"{file}: missing from the bundle; rebuild it with `mambatrt bundle`")
        if file.stat().st_size != record.bytes:
            raise BundleError(f"{file}: {file.stat().st_size} bytes, manifest says {record.bytes}; rebuild")
        if verify and sha256_file(file) != record.sha256:
            raise BundleError(f"{file}: sha256 does not match the manifest (corrupt or modified); rebuild the bundle")
    return Bundle(path, manifest)
