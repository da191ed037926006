"""Build a bundle: export the graphs, compile the plans, write the manifest -- atomically.

Everything is built in a hidden temporary directory beside the target and renamed into place at the end; on any
failure nothing is left at the target, and an existing bundle there is untouched unless ``force``.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from mambatrt import __version__, envs
from mambatrt.compile.builders import PlanRequest, build_plan, choose_builder
from mambatrt.config import load_config
from mambatrt.contract import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_PREFILL_BATCH,
    DEFAULT_MAX_ROWS,
    DEFAULT_OPT_BATCH,
    DEFAULT_OPT_ROWS,
    FUSED,
    GREEDY_FILE,
    KERNELS,
    PREFILL,
    TOKEN_IDS,
    graph_contract,
    kernels_unsupported,
)
from mambatrt.errors import BundleError, InputError, raise_if_signalled
from mambatrt.export.scans import DEFAULT_SCAN
from mambatrt.manifest import (
    FORMAT,
    GRAPH_FILES,
    MANIFEST,
    PLAN_FILES,
    SCHEMA_VERSION,
    TOKENIZER,
    FileInfo,
    Manifest,
    graphs_for_layout,
)
from mambatrt.paths import EXPORT_STAGE_PREFIX, check_output_folder, remove_dead_stages, sha256_file
from mambatrt.tensorrt_flavour import find_tensorrt


def timing_cache_path() -> Path:
    """One timing cache per TensorRT flavour and version, shared by every build on this machine."""
    trt = find_tensorrt()
    tag = f"{trt.flavour}-{trt.version}" if trt else "none"
    root = envs.MAMBATRT_CACHE
    root.mkdir(parents=True, exist_ok=True)
    return root / f"timing-{tag}.cache"


def _log(message: str, quiet: bool) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def build_bundle(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    precision: str = "fp32",
    layout: str = "split",
    engines: str = "auto",
    max_rows: int = DEFAULT_MAX_ROWS,
    opt_rows: int | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_prefill_batch: int = DEFAULT_MAX_PREFILL_BATCH,
    force: bool = False,
    label: str | None = None,
    quiet: bool = False,
    scan: str = DEFAULT_SCAN,
    kernels: str = "auto",
    schema: int = SCHEMA_VERSION,
) -> Path:
    """Export + compile + manifest into ``out_dir``; returns it. See the module docstring for atomicity.

    ``kernels``: how to build the "kernels" flavour's op library (:func:`mambatrt.compile.kernels.plan_build`).
    ``schema``: the manifest schema to write, the current one or 3 (kernels graphs with stacked states, for a
    runtime of before schema 4, and the tests that hold this one to such bundles).
    """
    if schema not in (3, SCHEMA_VERSION):
        raise InputError(f"bundle schema {schema} cannot be written; choose 3 or {SCHEMA_VERSION}")
    from mambatrt.compile.kernels import LIBRARY_FILE, build_library, plan_build, with_cutlass
    from mambatrt.export.onnx_export import check_export_args, export_onnx

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    graphs = graphs_for_layout(layout)
    if layout == "single":
        max_rows = 1
    check_export_args(precision, max_rows, graphs, scan, max_batch, max_prefill_batch)
    if opt_rows is None:  # the profile's optimum: DEFAULT_OPT_ROWS, or the whole range when that is shorter
        opt_rows = min(DEFAULT_OPT_ROWS, max_rows)
    elif layout == "split" and not 1 <= opt_rows <= max_rows:
        raise InputError(f"--opt-rows must be in 1..--max-rows ({max_rows}), got {opt_rows}")
    builder = choose_builder(engines)  # a builder asked for by name is checked here, before the export
    compiler = plan_build(kernels)  # likewise a kernels compiler
    config = load_config(checkpoint_dir)  # refuse a missing or unsupported checkpoint before any work
    unsupported = kernels_unsupported(config)
    check_output_dir(out_dir, checkpoint_dir, force)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_stages(out_dir):
        _log(f"removed {stale}, left by a build that was killed", quiet)
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-{os.getpid()}-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(stage, 0o777 & ~umask)  # mkdtemp makes 0700; a bundle is an ordinary directory
    try:
        # the kernels library first: a compiler that fails should fail before the long export (builds are cached)
        built = None
        if compiler is None:
            _log(f"[1/4] no kernels library ({'--kernels none' if kernels == 'none' else 'no C++ compiler'})", quiet)
        elif unsupported:
            _log(f"[1/4] no kernels library: the kernels do not cover this model ({unsupported})", quiet)
        else:
            name = Path(compiler.path).name
            extra = ""
            if compiler.kind == "cuda":
                extra = (
                    ", CUTLASS"
                    if with_cutlass()
                    else ", no CUTLASS: pip install --no-deps nvidia-cutlass for faster fp32 GEMMs"
                )
            _log(f"[1/4] building the kernels library ({compiler.kind} kernels, {name}{extra}; cached)", quiet)
            built = build_library(compiler)
            shutil.copy(built.path, stage / LIBRARY_FILE)
        _log(f"[2/4] exporting {', '.join(graphs)} graphs ({precision}) from {checkpoint_dir}", quiet)
        result = export_onnx(
            checkpoint_dir,
            stage,
            precision=precision,
            max_rows=max_rows,
            graphs=graphs,
            scan=scan,
            progress=not quiet,
            max_batch=max_batch,
            flavours=(FUSED, KERNELS) if built else (FUSED,),
            max_prefill_batch=max_prefill_batch,
            layered=schema >= 4,
            cuda_linear=("all" if built.cutlass else "decode") if built and built.cuda else "",
            cpu_linear=bool(built),
        )
        raise_if_signalled()  # a signal whose KeyboardInterrupt the exporter's imports swallowed stops us here
        library = {"file": LIBRARY_FILE, "cuda": built.cuda, "compiler": built.compiler} if built else None
        if library and built.cutlass:
            library["cutlass"] = True
        if library and result.cuda_graphs:  # the kernels graphs' copies for the CUDA provider (MambaLinear)
            library["cuda_graphs"] = {g: p.name for g, p in result.cuda_graphs.items()}
        if library and result.cpu_graphs:  # the kernels graphs' copies for the CPU provider (MambaLinear)
            library["cpu_graphs"] = {g: p.name for g, p in result.cpu_graphs.items()}
        shutil.copy(checkpoint_dir / "config.json", stage / "config.json")
        if (checkpoint_dir / TOKENIZER).is_file():
            shutil.copy(checkpoint_dir / TOKENIZER, stage / TOKENIZER)
        plans = {}
        if builder is None:
            why = "--engines none" if engines == "none" else "no TensorRT builder found (trtexec, tensorrt_rtx)"
            _log(f"[3/4] {why}: writing an ONNX-only bundle", quiet)
        else:
            cache = timing_cache_path()
            for i, graph in enumerate(graphs, 1):
                contract = graph_contract(config, graph, max_rows if graph == PREFILL else 1, max_batch)
                shapes = contract.profile(opt_rows, DEFAULT_OPT_BATCH)
                axis = f"rows {shapes[TOKEN_IDS][0][0]}..{max_rows}" if graph == PREFILL else f"batch 1..{max_batch}"
                _log(f"[3/4] building {PLAN_FILES[graph]} with {builder} ({i}/{len(graphs)}, {axis})", quiet)
                request = PlanRequest(stage / GRAPH_FILES[graph], stage / PLAN_FILES[graph], shapes, cache)
                plans[graph] = build_plan(builder, request)
                _log(f"      {PLAN_FILES[graph]} built in {plans[graph].build_seconds:.1f} s", quiet)
        raise_if_signalled()
        _log("[4/4] writing manifest.json", quiet)
        manifest = Manifest(
            layout=layout,
            precision=precision,
            model=config,
            max_prefill_rows=max_rows,
            opt_prefill_rows=opt_rows if layout == "split" else 1,
            prefill_scan=scan if layout == "split" else None,
            graphs={g: GRAPH_FILES[g] for g in graphs},
            flavour_graphs={f: {g: p.name for g, p in paths.items()} for f, paths in result.flavoured.items()},
            kernels_library=library,
            greedy_graph=GREEDY_FILE if (stage / GREEDY_FILE).is_file() else None,
            files={p.name: FileInfo(p.stat().st_size, sha256_file(p)) for p in sorted(stage.iterdir()) if p.is_file()},
            plans=plans,
            tokenizer=TOKENIZER if (stage / TOKENIZER).is_file() else None,
            source={"checkpoint": str(checkpoint_dir.resolve()), "label": label},
            export={"seconds": round(result.seconds, 2), "node_counts": result.node_counts},
            mambatrt_version=__version__,
            max_batch=max_batch,
            max_prefill_batch=max_prefill_batch if layout == "split" else 1,
            schema_version=schema,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        )
        (stage / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
        raise_if_signalled()
        _replace(stage, out_dir, force)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out_dir


def is_bundle(path: Path) -> bool:
    """Whether ``path`` is a folder holding a mambatrt manifest (what ``--force`` may replace)."""
    try:
        return json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_replaceable(out_dir: Path) -> None:
    """What ``--force`` may replace: a mambatrt bundle or an empty folder, never a folder of other files."""
    if any(out_dir.iterdir()) and not is_bundle(out_dir):
        raise InputError(f"{out_dir}: holds files that are not a mambatrt bundle; --force replaces only a bundle")


def check_output_dir(out_dir: Path, checkpoint_dir: Path, force: bool) -> None:
    """Refuse an output folder that would destroy something, before any work.

    ``--force`` replaces a mambatrt bundle (or an empty folder), never the checkpoint, a folder holding it, the
    current folder, a file, or a folder of other files.
    """
    out, ckpt = out_dir.resolve(), checkpoint_dir.resolve()
    if out == ckpt or out in ckpt.parents:
        raise InputError(f"{out_dir}: is the checkpoint or a folder holding it; choose another --out")
    if out == Path.cwd().resolve() or out in Path.cwd().resolve().parents:
        raise InputError(f"{out_dir}: is the current folder or holds it; choose a new folder for --out")
    check_output_folder(out_dir)
    if out_dir.exists():
        if not force:
            raise BundleError(f"{out_dir}: already exists; pass --force to replace it")
        check_replaceable(out_dir)


def remove_stale_stages(out_dir: Path) -> list[Path]:
    """Remove what builds into ``out_dir`` that were killed left beside it: their stage and their export's stage."""
    parent = out_dir.parent
    return remove_dead_stages(parent, f".{out_dir.name}.building-") + remove_dead_stages(parent, EXPORT_STAGE_PREFIX)


def _replace(stage: Path, out_dir: Path, force: bool) -> None:
    """Move the finished stage into place; an old bundle is removed only after the new one is there.

    A target that appeared while building (another build into the same new folder) is an error unless ``force``.
    """
    old = None
    if out_dir.exists():
        if not force:
            raise BundleError(f"{out_dir}: appeared while this bundle was built (another build?); pass --force")
        check_replaceable(out_dir)
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        os.replace(out_dir, old)
    os.replace(stage, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
