"""Bundles on disk: the manifest schema, validation and loading. Pure Python + hashlib (no torch, no numpy).

A bundle directory (see bundles/README.md):

    manifest.json    format, schema version, layout, precision, model config, I/O contract, files with sha256
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
from mambatrt.contract import DECODE, PREFILL, GraphContract, graph_contract
from mambatrt.errors import BundleError, ConfigError

FORMAT = "mambatrt-bundle"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
LAYOUTS = ("split", "single")
GRAPH_FILES = {DECODE: "decode.onnx", PREFILL: "prefill.onnx"}
PLAN_FILES = {DECODE: "engine.plan", PREFILL: "prefill.plan"}
TOKENIZER = "tokenizer.json"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def graphs_for_layout(layout: str) -> tuple[str, ...]:
    """The graphs a layout holds: split -> decode + prefill, single -> decode only."""
    if layout not in LAYOUTS:
        raise BundleError(f"unknown layout '{layout}'; choose one of {', '.join(LAYOUTS)}")
    return (DECODE, PREFILL) if layout == "split" else (DECODE,)


@dataclass(frozen=True)
class Bundle:
    """A validated bundle: where it is, its manifest, and what it holds."""

    path: Path
    manifest: dict
    config: MambaConfig

    @property
    def layout(self) -> str:
        """ "split" (prefill + decode engines) or "single" (decode only)."""
        return self.manifest["decoder_engine_layout"]

    @property
    def precision(self) -> str:
        """fp32, fp16 or bf16."""
        return self.manifest["precision"]

    @property
    def max_prefill_rows(self) -> int:
        """Largest chunk the prefill graph takes (1 for single bundles)."""
        return int(self.manifest["max_prefill_rows"])

    @property
    def graphs(self) -> tuple[str, ...]:
        """The graphs this bundle holds."""
        return graphs_for_layout(self.layout)

    def contract(self, graph: str) -> GraphContract:
        """The I/O contract of one graph."""
        return graph_contract(self.config, graph, self.max_prefill_rows if graph == PREFILL else 1)

    def graph_path(self, graph: str) -> Path:
        """Path of a graph's ONNX file."""
        return self.path / self.manifest["graphs"][graph]

    def plan(self, graph: str) -> dict | None:
        """The manifest record of a graph's plan, or None when the bundle has no plan for it."""
        return self.manifest.get("plans", {}).get(graph)

    def plan_path(self, graph: str) -> Path:
        """Path of a graph's plan file."""
        return self.path / self.manifest["plans"][graph]["file"]

    @property
    def tokenizer_path(self) -> Path | None:
        """tokenizer.json when the bundle has one."""
        name = self.manifest.get("tokenizer")
        return self.path / name if name else None

    @property
    def identity(self) -> str:
        """Fingerprint of the model a saved state belongs to: the sha256 of the decode graph and weights."""
        files = self.manifest["files"]
        h = hashlib.sha256()
        for name in sorted(files):
            if name.endswith(".onnx") or name == "weights.bin":
                h.update(f"{name}:{files[name]['sha256']};".encode())
        return h.hexdigest()


def _need(manifest: dict, key: str, kind: type, where: Path):
    if key not in manifest:
        raise BundleError(f"{where}: manifest has no '{key}'; rebuild the bundle with `mambatrt bundle`")
    value = manifest[key]
    if not isinstance(value, kind):
        raise BundleError(f"{where}: manifest field '{key}' should be {kind.__name__}, got {type(value).__name__}")
    return value


def load_bundle(path: str | Path, verify: bool = True) -> Bundle:
    """Read and validate a bundle directory; ``verify`` checks every file's size and sha256.

    Raises BundleError naming the problem (missing directory or file, corrupt manifest, wrong format or schema,
    unknown layout, hash mismatch) and what to do.
    """
    path = Path(path)
    if not path.is_dir():
        raise BundleError(
            f"{path}: bundle directory not found; build one with `mambatrt bundle CHECKPOINT --out {path}`"
        )
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise BundleError(f"{manifest_path}: missing; this is not a mambatrt bundle (rebuild with `mambatrt bundle`)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{manifest_path}: corrupt or truncated JSON ({exc}); rebuild the bundle") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise BundleError(f"{manifest_path}: not a {FORMAT} manifest; rebuild the bundle with `mambatrt bundle`")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BundleError(
            f"{manifest_path}: schema version {version!r}, this mambatrt reads {SCHEMA_VERSION}; rebuild the bundle"
        )
    layout = _need(manifest, "decoder_engine_layout", str, manifest_path)
    graphs = graphs_for_layout(layout)
    _need(manifest, "precision", str, manifest_path)
    _need(manifest, "max_prefill_rows", int, manifest_path)
    files = _need(manifest, "files", dict, manifest_path)
    listed_graphs = _need(manifest, "graphs", dict, manifest_path)
    try:
        config = MambaConfig.from_dict(_need(manifest, "model", dict, manifest_path))
    except ConfigError as exc:
        raise BundleError(f"{manifest_path}: {exc}") from None
    for graph in graphs:
        if graph not in listed_graphs:
            raise BundleError(f"{manifest_path}: layout '{layout}' needs a {graph} graph, the manifest lists none")
    for name, record in files.items():
        file = path / name
        if not file.is_file():
            raise BundleError(f"{file}: missing from the bundle; rebuild it with `mambatrt bundle`")
        if file.stat().st_size != record.get("bytes"):
            raise BundleError(f"{file}: {file.stat().st_size} bytes, manifest says {record.get('bytes')}; rebuild")
        if verify and sha256_file(file) != record.get("sha256"):
            raise BundleError(f"{file}: sha256 does not match the manifest (corrupt or modified); rebuild the bundle")
    referenced = list(listed_graphs.values()) + [p["file"] for p in manifest.get("plans", {}).values()]
    for name in referenced:
        if name not in files:
            raise BundleError(f"{manifest_path}: '{name}' is referenced but not listed under 'files'; rebuild")
    return Bundle(path, manifest, config)
