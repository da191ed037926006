"""The bundle manifest (``manifest.json``), typed: written by ``mambatrt bundle``, read by every other command.

One dataclass with its JSON form and its validation, so the keys are named once. Pure Python (no torch, no numpy).
The JSON keys are those of schema version 1 (``decoder_engine_layout`` for the layout, and so on);
docs/bundle-format.md documents them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .config import MambaConfig
from .contract import (
    DECODE,
    FLAVOURS,
    FUSED,
    KERNELS,
    PORTABLE,
    PREFILL,
    GraphContract,
    graph_contract,
    graph_file,
)
from .errors import BundleError, ConfigError

MANIFEST = "manifest.json"  # a bundle's manifest file
TOKENIZER = "tokenizer.json"  # a bundle's tokenizer, when it has one
TOKENIZER_CONFIG = "tokenizer_config.json"  # the checkpoint's, when it has one (its special tokens, chat template)

FORMAT = "mambatrt-bundle"
# 4: the kernels graphs take each layer's states as tensors of their own (contract.py); 3: the kernels prefill graph
# runs a batch of sequences too (``max_prefill_batch``); 2: the decode graph runs a batch of sequences (states with
# a batch axis, ``max_batch``); 1: one sequence per graph.
SCHEMA_VERSION = 4
OLDEST_SCHEMA = 1
LAYOUTS = ("split", "single")
PRECISIONS = ("fp32", "fp16", "bf16", "int8")
GRAPH_FILES = {DECODE: graph_file(DECODE), PREFILL: graph_file(PREFILL)}  # the portable graphs' files
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
    builder: str  # polygraphy (older bundles: trtexec)
    tensorrt_flavour: str  # tensorrt | tensorrt_rtx
    tensorrt_version: str
    profile: dict
    build_seconds: float
    log: str | None = None  # file name of the builder's log (older bundles' trtexec builds)

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
    prefill_scan: str | None  # the portable prefill graph's scan, "blocked" (older bundles: others); None if single
    graphs: dict[str, str]  # graph -> ONNX file
    files: dict[str, FileInfo]  # every file but the manifest
    plans: dict[str, PlanInfo] = field(default_factory=dict)
    tokenizer: str | None = None
    source: dict = field(default_factory=dict)  # the checkpoint's path (older bundles: a label too)
    export: dict = field(default_factory=dict)  # export seconds, node counts
    mambatrt_version: str = ""
    created: str = ""
    max_batch: int = 1  # the decode graph's largest batch (1 for schema 1)
    schema_version: int = SCHEMA_VERSION
    # flavour -> graph -> ONNX file, for the flavours beside the portable graphs ("kernels")
    flavour_graphs: dict[str, dict[str, str]] = field(default_factory=dict)
    # the "kernels" flavour's op library: {"file", "cuda" (has the CUDA kernels), "compiler", "cutlass" (its CUDA
    # kernels use CUTLASS's GEMMs), and for an fp32 model "cuda_graphs" (with the CUDA kernels) and "cpu_graphs":
    # graph -> the kernels graph's copy for that provider, its projections as MambaLinear}
    kernels_library: dict | None = None
    greedy_graph: str | None = None  # the greedy picker's ONNX file (contract.greedy_contract), if exported
    score_graph: str | None = None  # the scoring graph's ONNX file (contract.SCORE), if exported
    max_prefill_batch: int = 1  # sequences per launch of the kernels prefill graph (schema 3)
    # rows of one launch of the kernels prefill graph, per sequence and over its sequences together
    # (contract.kernels_prefill_rows); None: a bundle that does not record it, whose kernels prefill graph takes
    # max_prefill_rows per sequence as the portable one does
    kernels_prefill_rows: int | None = None

    @property
    def batched(self) -> bool:
        """Whether the graphs have the batch axis (schema 2 and later)."""
        return self.schema_version >= 2

    def contract(self, graph: str, flavour: str = PORTABLE) -> GraphContract:
        """The I/O contract of one graph of one flavour (they differ in the prefill graph's batch and rows, and from
        schema 4 the kernels graphs in their layered states)."""
        rows = self.prefill_rows(flavour) if graph == PREFILL else 1
        prefill_batch = self.max_prefill_batch if flavour != PORTABLE else 1
        layered = flavour == KERNELS and self.schema_version >= 4
        return graph_contract(self.model, graph, rows, self.max_batch if self.batched else None, prefill_batch, layered)

    def prefill_batch(self, flavour: str) -> int:
        """Sequences one launch of ``flavour``'s prefill graph takes."""
        return self.contract(PREFILL, flavour).batch

    def prefill_rows(self, flavour: str) -> int:
        """Rows per sequence one launch of ``flavour``'s prefill graph takes: the kernels graph's own limit where the
        manifest records one, else ``max_prefill_rows`` (the portable graphs and their plans, older bundles)."""
        if flavour == KERNELS and self.kernels_prefill_rows is not None:
            return self.kernels_prefill_rows
        return self.max_prefill_rows

    def prefill_launch_rows(self, flavour: str) -> int:
        """Rows one launch of ``flavour``'s prefill graph takes over all its sequences: the kernels graph's limit
        where the manifest records one (B x T within it), else a full chunk for each sequence of the batch."""
        if flavour == KERNELS and self.kernels_prefill_rows is not None:
            return self.kernels_prefill_rows
        return self.max_prefill_rows * self.prefill_batch(flavour)

    @property
    def checkpoint(self) -> str | None:
        """The source checkpoint's path, as recorded at build time."""
        return self.source.get("checkpoint")

    def to_json(self) -> dict[str, Any]:
        """The ``manifest.json`` object (keys in a stable order; ``max_batch`` from schema 2 on)."""
        batch = {"max_batch": self.max_batch} if self.batched else {}
        if self.schema_version >= 3:
            batch["max_prefill_batch"] = self.max_prefill_batch
        if self.kernels_prefill_rows is not None:
            batch["max_kernels_prefill_rows"] = self.kernels_prefill_rows
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
            **({"score_graph": self.score_graph} if self.score_graph else {}),
            "plans": {g: p.to_json() for g, p in self.plans.items()},
            "tokenizer": self.tokenizer,
            "export": self.export,
            "files": {name: dataclasses.asdict(f) for name, f in self.files.items()},
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "manifest.json") -> Manifest:
        """Validate a parsed ``manifest.json``; every problem is a BundleError naming the field and what to do."""
        fields = _Fields(data, where)
        version = fields.version()
        layout = fields.need("decoder_engine_layout", str)
        graph_names = graphs_for_layout(layout)
        graphs = fields.graphs(layout, graph_names)
        files, plans = fields.files_and_plans()
        flavoured = fields.flavour_graphs(graph_names)
        library = fields.kernels_library(KERNELS in flavoured, graph_names)
        greedy, score = data.get("greedy_graph"), data.get("score_graph")
        for key, name in (("greedy_graph", greedy), ("score_graph", score)):
            if name is not None and not isinstance(name, str):
                raise BundleError(f"{where}: '{key}' should be a file name; rebuild the bundle")
        optional = [name for name in (greedy, score) if name]
        named = [*graphs.values(), *(p.file for p in plans.values()), *optional]
        named += [name for files_of in flavoured.values() for name in files_of.values()]
        named += _library_files(library)
        for name in named:
            if name not in files:
                raise BundleError(f"{where}: '{name}' is referenced but not listed under 'files'; rebuild")
        max_rows, max_batch, prefill_batch = fields.limits(version)
        kernels_rows = fields.kernels_rows(KERNELS in flavoured and PREFILL in graph_names)
        return cls(
            layout=layout,
            precision=fields.precision(),
            model=fields.model(),
            max_prefill_rows=max_rows,
            opt_prefill_rows=int(data.get("opt_prefill_rows", max_rows)),
            prefill_scan=data.get("prefill_scan"),
            graphs=graphs,
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
            kernels_library=library,
            greedy_graph=greedy,
            score_graph=score,
            max_prefill_batch=prefill_batch,
            kernels_prefill_rows=kernels_rows,
        )


def _library_files(library: dict | None) -> list[str]:
    """The files a ``kernels_library`` entry names: the library and the kernels graphs' provider copies."""
    if not library:
        return []
    copies = [library.get(key) or {} for key in ("cuda_graphs", "cpu_graphs")]
    return [library["file"], *(name for files_of in copies for name in files_of.values())]


class _Fields:
    """The checks of :meth:`Manifest.from_json`, one field or group of fields each, on the parsed JSON ``data``."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise BundleError(f"{where}: not a {FORMAT} manifest; rebuild the bundle with `mambatrt bundle`")
        self.data, self.where = data, where

    def need(self, key: str, kind: type | tuple[type, ...]):
        """The value of a required field of type ``kind``."""
        if key not in self.data:
            raise BundleError(f"{self.where}: manifest has no '{key}'; rebuild the bundle with `mambatrt bundle`")
        value = self.data[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise BundleError(f"{self.where}: manifest field '{key}' should be {names}, got {type(value).__name__}")
        return value

    def version(self) -> int:
        """The schema version, one this mambatrt reads."""
        version, where = self.data.get("schema_version"), self.where
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
        return version

    def precision(self) -> str:
        """One of PRECISIONS."""
        precision = self.need("precision", str)
        if precision not in PRECISIONS:
            raise BundleError(f"{self.where}: unknown precision '{precision}'; rebuild the bundle")
        return precision

    def model(self) -> MambaConfig:
        """The model config."""
        try:
            return MambaConfig.from_dict(self.need("model", dict))
        except ConfigError as exc:
            raise BundleError(f"{self.where}: {exc}") from None

    def graphs(self, layout: str, graph_names: tuple[str, ...]) -> dict[str, str]:
        """The portable graphs' files: one for each graph of the layout."""
        graphs = self.need("graphs", dict)
        for graph in graph_names:
            if graph not in graphs:
                raise BundleError(f"{self.where}: layout '{layout}' needs a {graph} graph, the manifest lists none")
        return dict(graphs)

    def files_and_plans(self) -> tuple[dict[str, FileInfo], dict[str, PlanInfo]]:
        """Every file's size and sha256, and how each plan was built."""
        try:
            files = {name: FileInfo(int(r["bytes"]), str(r["sha256"])) for name, r in self.need("files", dict).items()}
            plans = {g: PlanInfo(**r) for g, r in (self.data.get("plans") or {}).items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleError(f"{self.where}: malformed 'files' or 'plans' entry ({exc}); rebuild the bundle") from None
        return files, plans

    def flavour_graphs(self, graph_names: tuple[str, ...]) -> dict[str, dict[str, str]]:
        """flavour -> graph -> file for the flavours beside the portable one. The retired "fused" flavour's entry
        (older bundles) is checked as the others and left out: its files stay listed and verified, never run."""
        flavoured = {}
        for flavour in (*FLAVOURS[1:], FUSED):
            files_of = self.data.get(f"{flavour}_graphs") or {}
            if not isinstance(files_of, dict) or (files_of and sorted(files_of) != sorted(graph_names)):
                raise BundleError(
                    f"{self.where}: '{flavour}_graphs' should name a file for each of {graph_names}; rebuild"
                )
            if files_of and flavour in FLAVOURS:
                flavoured[flavour] = dict(files_of)
        return flavoured

    def kernels_library(self, with_kernels: bool, graph_names: tuple[str, ...]) -> dict | None:
        """The kernels flavour's op library, which comes with the kernels graphs and only with them."""
        library, where = self.data.get("kernels_library"), self.where
        if with_kernels != isinstance(library, dict) or (library and not isinstance(library.get("file"), str)):
            raise BundleError(f"{where}: 'kernels_graphs' and 'kernels_library' come together; rebuild the bundle")
        for key in ("cuda_graphs", "cpu_graphs"):
            copies = (library or {}).get(key) or {}
            if not isinstance(copies, dict) or not set(copies) <= set(graph_names):
                raise BundleError(
                    f"{where}: 'kernels_library.{key}' should map graphs of {graph_names} to files; rebuild"
                )
        return dict(library) if library else None

    def limits(self, version: int) -> tuple[int, int, int]:
        """max_prefill_rows, max_batch (schema 2 on; else 1) and max_prefill_batch (schema 3 on; else 1)."""
        max_rows = self.need("max_prefill_rows", int)
        max_batch = self.need("max_batch", int) if version >= 2 else 1
        prefill_batch = self.need("max_prefill_batch", int) if version >= 3 else 1
        if max_batch < 1 or prefill_batch < 1:
            raise BundleError(
                f"{self.where}: max_batch and max_prefill_batch must be >= 1, got {max_batch} and {prefill_batch}; "
                "rebuild the bundle"
            )
        return max_rows, max_batch, prefill_batch

    def kernels_rows(self, with_kernels_prefill: bool) -> int | None:
        """The kernels prefill graph's rows (``max_kernels_prefill_rows``): absent in bundles built before it (None),
        and only beside a kernels prefill graph."""
        if "max_kernels_prefill_rows" not in self.data:
            return None
        rows = self.need("max_kernels_prefill_rows", int)
        if rows < 1 or not with_kernels_prefill:
            raise BundleError(
                f"{self.where}: max_kernels_prefill_rows should be >= 1 and come with a kernels prefill graph, got "
                f"{rows}; rebuild the bundle"
            )
        return rows
