"""The bundle manifest (``manifest.json``), typed: written by ``mambatrt bundle``, read by every other command.

One dataclass with its JSON form and its validation, so the keys are named once. Pure Python (no torch, no numpy).
The JSON keys are those of schema version 1 (``decoder_engine_layout`` for the layout, and so on); bundles/README.md
documents them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mambatrt.config import MambaConfig
from mambatrt.contract import DECODE, FLAVOURS, KERNELS, PORTABLE, PREFILL, GraphContract, graph_contract
from mambatrt.errors import BundleError, ConfigError

MANIFEST = "manifest.json"  # a bundle's manifest file
TOKENIZER = "tokenizer.json"  # a bundle's tokenizer, when it has one

FORMAT = "mambatrt-bundle"
# 4: the kernels graphs take each layer's states as tensors of their own (contract.py); 3: the fused and kernels
# prefill graphs run a batch of sequences too (``max_prefill_batch``); 2: the decode graph runs a batch of sequences
# (states with a batch axis, ``max_batch``); 1: one sequence per graph.
SCHEMA_VERSION = 4
OLDEST_SCHEMA = 1
LAYOUTS = ("split", "single")
PRECISIONS = ("fp32", "fp16", "bf16")
GRAPH_FILES = {DECODE: "decode.onnx", PREFILL: "prefill.onnx"}
PLAN_FILES = {DECODE: "engine.plan", PREFILL: "prefill.plan"}


def graphs_for_layout(layout: str) -> tuple[str, ...]:
    """The graphs a layout holds: split -> decode + prefill, single -> decode only."""
    if layout not in LAYOUTS:
        raise BundleError(f"unknown layout '{layout}'; choose one of {', '.join(LAYOUTS)}")
    return (DECODE, PREFILL) if layout == "split" else (DECODE,)


@dataclass(frozen=True)
class PlanInfo:
    """How one TensorRT plan was built (a manifest ``plans`` entry)."""

    file: str
    builder: str  # polygraphy | trtexec
    tensorrt_flavour: str  # tensorrt | tensorrt_rtx
    tensorrt_version: str
    profile: dict
    build_seconds: float
    log: str | None = None  # file name of the builder's log, when kept

    def to_json(self) -> dict:
        """JSON form (``log`` only when there is one)."""
        d = dataclasses.asdict(self)
        if d["log"] is None:
            del d["log"]
        return d


@dataclass(frozen=True)
class FileInfo:
    """Size and sha256 of one file of the bundle."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a bundle holds and how it was made. ``contract`` is derived from ``model``; the JSON carries a copy."""

    layout: str  # split | single
    precision: str  # fp32 | fp16 | bf16
    model: MambaConfig
    max_prefill_rows: int  # 1 for single bundles
    opt_prefill_rows: int
    prefill_scan: str | None  # None for single bundles
    graphs: dict[str, str]  # graph -> ONNX file
    files: dict[str, FileInfo]  # every file but the manifest
    plans: dict[str, PlanInfo] = field(default_factory=dict)
    tokenizer: str | None = None
    source: dict = field(default_factory=dict)  # checkpoint path, label
    export: dict = field(default_factory=dict)  # export seconds, node counts
    mambatrt_version: str = ""
    created: str = ""
    max_batch: int = 1  # the decode graph's largest batch (1 for schema 1)
    schema_version: int = SCHEMA_VERSION
    # flavour -> graph -> ONNX file, for the flavours beside the portable graphs ("fused", "kernels")
    flavour_graphs: dict[str, dict[str, str]] = field(default_factory=dict)
    # the "kernels" flavour's op library: {"file", "cuda" (has the CUDA kernels), "compiler", and with the CUDA
    # kernels of an fp32 model "cuda_graphs": graph (decode) -> the kernels graph's copy for the CUDA provider with
    # its projections as MambaLinear; for an fp32 model "cpu_graphs": the same for the CPU provider (session 31 on)}
    kernels_library: dict | None = None
    greedy_graph: str | None = None  # the greedy picker's ONNX file (contract.greedy_contract), if exported
    max_prefill_batch: int = 1  # sequences per launch of the fused and kernels prefill graphs (schema 3)

    @property
    def batched(self) -> bool:
        """Whether the graphs have the batch axis (schema 2 and later)."""
        return self.schema_version >= 2

    def contract(self, graph: str, flavour: str = PORTABLE) -> GraphContract:
        """The I/O contract of one graph of one flavour (they differ in the prefill graph's batch, and from schema 4
        the kernels graphs in their layered states)."""
        rows = self.max_prefill_rows if graph == PREFILL else 1
        prefill_batch = self.max_prefill_batch if flavour != PORTABLE else 1
        layered = flavour == KERNELS and self.schema_version >= 4
        return graph_contract(self.model, graph, rows, self.max_batch if self.batched else None, prefill_batch, layered)

    def prefill_batch(self, flavour: str) -> int:
        """Sequences one launch of ``flavour``'s prefill graph takes."""
        return self.contract(PREFILL, flavour).batch

    @property
    def checkpoint(self) -> str | None:
        """The source checkpoint's path, as recorded at build time."""
        return self.source.get("checkpoint")

    def to_json(self) -> dict[str, Any]:
        """The ``manifest.json`` object (keys in a stable order; ``max_batch`` from schema 2 on)."""
        batch = {"max_batch": self.max_batch} if self.batched else {}
        if self.schema_version >= 3:
            batch["max_prefill_batch"] = self.max_prefill_batch
        return {
            "format": FORMAT,
            "schema_version": self.schema_version,
            "mambatrt_version": self.mambatrt_version,
            "created": self.created,
            "decoder_engine_layout": self.layout,
            "max_prefill_rows": self.max_prefill_rows,
            "opt_prefill_rows": self.opt_prefill_rows,
            **batch,
            "prefill_scan": self.prefill_scan,
            "precision": self.precision,
            "model": self.model.to_dict(),
            "source": self.source,
            "contract": {g: self.contract(g).to_dict() for g in self.graphs},
            "graphs": self.graphs,
            **{f"{flavour}_graphs": files for flavour, files in self.flavour_graphs.items()},
            **({"kernels_library": self.kernels_library} if self.kernels_library else {}),
            **({"greedy_graph": self.greedy_graph} if self.greedy_graph else {}),
            "plans": {g: p.to_json() for g, p in self.plans.items()},
            "tokenizer": self.tokenizer,
            "export": self.export,
            "files": {name: dataclasses.asdict(f) for name, f in self.files.items()},
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "manifest.json") -> Manifest:
        """Validate a parsed ``manifest.json``; every problem is a BundleError naming the field and what to do."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise BundleError(f"{where}: not a {FORMAT} manifest; rebuild the bundle with `mambatrt bundle`")
        version = data.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise BundleError(f"{where}: schema version {version!r} is not a number; rebuild the bundle")
        if version > SCHEMA_VERSION:
            raise BundleError(
                f"{where}: schema version {version} is newer than this mambatrt reads ({SCHEMA_VERSION}); "
                "upgrade mambatrt (pip install -U mambatrt)"
            )
        if version < OLDEST_SCHEMA:
            raise BundleError(
                f"{where}: schema version {version}, this mambatrt reads {OLDEST_SCHEMA}..{SCHEMA_VERSION}; rebuild it"
            )

        def need(key: str, kind: type | tuple[type, ...]):
            if key not in data:
                raise BundleError(f"{where}: manifest has no '{key}'; rebuild the bundle with `mambatrt bundle`")
            value = data[key]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
                raise BundleError(f"{where}: manifest field '{key}' should be {names}, got {type(value).__name__}")
            return value

        layout = need("decoder_engine_layout", str)
        graph_names = graphs_for_layout(layout)
        precision = need("precision", str)
        if precision not in PRECISIONS:
            raise BundleError(f"{where}: unknown precision '{precision}'; rebuild the bundle")
        try:
            model = MambaConfig.from_dict(need("model", dict))
        except ConfigError as exc:
            raise BundleError(f"{where}: {exc}") from None
        graphs = need("graphs", dict)
        for graph in graph_names:
            if graph not in graphs:
                raise BundleError(f"{where}: layout '{layout}' needs a {graph} graph, the manifest lists none")
        try:
            files = {name: FileInfo(int(r["bytes"]), str(r["sha256"])) for name, r in need("files", dict).items()}
            plans = {g: PlanInfo(**r) for g, r in (data.get("plans") or {}).items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleError(f"{where}: malformed 'files' or 'plans' entry ({exc}); rebuild the bundle") from None
        flavoured = {}
        for flavour in FLAVOURS[1:]:
            files_of = data.get(f"{flavour}_graphs") or {}
            if not isinstance(files_of, dict) or (files_of and sorted(files_of) != sorted(graph_names)):
                raise BundleError(f"{where}: '{flavour}_graphs' should name a file for each of {graph_names}; rebuild")
            if files_of:
                flavoured[flavour] = dict(files_of)
        library = data.get("kernels_library")
        paired = (KERNELS in flavoured) == isinstance(library, dict)
        if not paired or (library and not isinstance(library.get("file"), str)):
            raise BundleError(f"{where}: 'kernels_graphs' and 'kernels_library' come together; rebuild the bundle")
        copies = {}
        for key in ("cuda_graphs", "cpu_graphs"):
            copies[key] = (library or {}).get(key) or {}
            if not isinstance(copies[key], dict) or not set(copies[key]) <= set(graph_names):
                raise BundleError(
                    f"{where}: 'kernels_library.{key}' should map graphs of {graph_names} to files; rebuild"
                )
        greedy = data.get("greedy_graph")
        if greedy is not None and not isinstance(greedy, str):
            raise BundleError(f"{where}: 'greedy_graph' should be a file name; rebuild the bundle")
        extra = [greedy] if greedy else []
        extra += [library["file"]] if library else []
        extra += [name for files_of in copies.values() for name in files_of.values()]
        extra += [name for files_of in flavoured.values() for name in files_of.values()]
        for name in list(graphs.values()) + extra + [p.file for p in plans.values()]:
            if name not in files:
                raise BundleError(f"{where}: '{name}' is referenced but not listed under 'files'; rebuild")
        max_rows = need("max_prefill_rows", int)
        max_batch = need("max_batch", int) if version >= 2 else 1
        prefill_batch = need("max_prefill_batch", int) if version >= 3 else 1
        if max_batch < 1 or prefill_batch < 1:
            raise BundleError(
                f"{where}: max_batch and max_prefill_batch must be >= 1, got {max_batch} and {prefill_batch}; "
                "rebuild the bundle"
            )
        return cls(
            layout=layout,
            precision=precision,
            model=model,
            max_prefill_rows=max_rows,
            opt_prefill_rows=int(data.get("opt_prefill_rows", max_rows)),
            prefill_scan=data.get("prefill_scan"),
            graphs=dict(graphs),
            files=files,
            plans=plans,
            tokenizer=data.get("tokenizer"),
            source=dict(data.get("source") or {}),
            export=dict(data.get("export") or {}),
            mambatrt_version=str(data.get("mambatrt_version", "")),
            created=str(data.get("created", "")),
            max_batch=max_batch,
            schema_version=version,
            flavour_graphs=flavoured,
            kernels_library=dict(library) if library else None,
            greedy_graph=greedy,
            max_prefill_batch=prefill_batch,
        )
