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
from dataclasses import dataclass
from pathlib import Path

from mambatrt import __version__
from mambatrt.config import MambaConfig, load_config
from mambatrt.contract import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_PREFILL_BATCH,
    DEFAULT_MAX_ROWS,
    DEFAULT_OPT_BATCH,
    DEFAULT_OPT_ROWS,
    GREEDY_FILE,
    PREFILL,
    SCORE_FILE,
    TOKEN_IDS,
    graph_contract,
    kernels_prefill_rows,
    kernels_unsupported,
)
from mambatrt.errors import BundleError, InputError, noting_interrupts, raise_if_signalled
from mambatrt.manifest import (
    FORMAT,
    GRAPH_FILES,
    MANIFEST,
    PLAN_FILES,
    TOKENIZER,
    TOKENIZER_CONFIG,
    FileInfo,
    Manifest,
    PlanInfo,
    graphs_for_layout,
)
from mambatrt.paths import EXPORT_STAGE_PREFIX, check_output_folder, remove_dead_stages, sha256_file
from mambatrt.tensorrt_flavour import TensorRT

from .builders import PlanRequest, build_plan, find_builder, timing_cache_path
from .kernels import LIBRARY_FILE, Compiler, KernelsLibrary, build_library, plan_build, with_cutlass


@dataclass(frozen=True)
class _Options:
    """What a bundle is built with (the options of :func:`build_bundle` the steps share)."""

    precision: str
    layout: str
    max_rows: int  # 1 for a single bundle
    max_batch: int
    max_prefill_batch: int
    quiet: bool
    workers: int  # graphs traced at once

    @property
    def graphs(self) -> tuple[str, ...]:
        return graphs_for_layout(self.layout)

    def log(self, message: str) -> None:
        """Progress, on stderr unless quiet."""
        if not self.quiet:
            print(message, file=sys.stderr, flush=True)


def build_bundle(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    precision: str = "fp32",
    layout: str = "split",
    plans: str = "auto",
    max_rows: int = DEFAULT_MAX_ROWS,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_prefill_batch: int = DEFAULT_MAX_PREFILL_BATCH,
    force: bool = False,
    quiet: bool = False,
    kernels: str = "auto",
    workers: int = 1,
) -> Path:
    """Export + compile + manifest into ``out_dir``; returns it. See the module docstring for atomicity.

    ``layout``: "split" (decode and prefill graphs) or "single" (decode only: prompts go token by token).
    ``plans``: "auto" builds TensorRT plans when a TensorRT module imports (else an ONNX-only bundle), "none" never.
    ``max_rows``: the prefill graph's largest chunk; ``max_batch``: the decode graph's largest batch of sequences;
    ``max_prefill_batch``: sequences per launch of the kernels prefill graph.
    ``kernels``: how to build the "kernels" flavour's op library (:func:`.kernels.plan_build`): auto, cuda, cpu or
    none (no kernels flavour).
    ``workers``: how many graphs the export traces at once, each in a process forked from this one (1: in this
    process). ``mambatrt bundle`` forks one per core (:func:`mambatrt.export.onnx_export.default_workers`) from its
    fresh process; a process that has already run onnxruntime sessions or torch's thread pools can leave a forked
    child deadlocked on a lock one of those threads held (a test process building a bundle after other tests did).
    """
    from mambatrt.export.onnx_export import check_export_args

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    max_rows = max_rows if PREFILL in graphs_for_layout(layout) else 1  # refuses an unknown layout
    opts = _Options(precision, layout, max_rows, max_batch, max_prefill_batch, quiet, workers)
    check_export_args(precision, max_rows, opts.graphs, max_batch, max_prefill_batch, workers)
    trt = find_builder(plans)  # refuse a bad option before the export
    compiler = plan_build(kernels)  # likewise a kernels compiler asked for by name
    config = load_config(checkpoint_dir)  # refuse a missing or unsupported checkpoint before any work
    check_output_dir(out_dir, checkpoint_dir, force)
    with noting_interrupts():
        return _build_in_stage(checkpoint_dir, out_dir, force, compiler, trt, plans, kernels, config, opts)


def _build_in_stage(checkpoint_dir: Path, out_dir: Path, force: bool, compiler: Compiler | None, trt, plans: str,
                    kernels: str, config: MambaConfig, opts: _Options) -> Path:  # fmt: skip
    """The build's steps in a fresh stage, moved to ``out_dir`` at the end; the stage removed on any failure."""
    stage = _new_stage(out_dir, opts)
    try:
        built = _build_library(compiler, kernels, config, stage, opts)
        result = _export(checkpoint_dir, stage, built, opts)
        raise_if_signalled()  # a signal whose KeyboardInterrupt the exporter's imports swallowed stops us here
        for name in ("config.json", TOKENIZER, TOKENIZER_CONFIG):
            if (checkpoint_dir / name).is_file():
                shutil.copy(checkpoint_dir / name, stage / name)
        plan_infos = _build_plans(trt, plans, config, stage, opts)
        raise_if_signalled()
        opts.log("[4/4] writing manifest.json")
        manifest = _manifest(config, checkpoint_dir, stage, result, _library_entry(built, result), plan_infos, opts)
        (stage / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
        raise_if_signalled()
        _replace(stage, out_dir, force)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return out_dir


def _new_stage(out_dir: Path, opts: _Options) -> Path:
    """A fresh hidden folder beside ``out_dir`` to build in (what killed builds left there is removed first)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_stages(out_dir):
        opts.log(f"removed {stale}, left by a build that was killed")
    stage = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.building-{os.getpid()}-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(stage, 0o777 & ~umask)  # mkdtemp makes 0700; a bundle is an ordinary directory
    return stage


def _build_library(
    compiler: Compiler | None, kernels: str, config: MambaConfig, stage: Path, opts: _Options
) -> KernelsLibrary | None:
    """Step 1: the kernels flavour's op library into the stage, or None (no compiler, --kernels none, or a model
    outside the kernels' limits). First: a compiler that fails fails before the long export (builds are cached)."""
    unsupported = kernels_unsupported(config)
    if compiler is None:
        opts.log(f"[1/4] no kernels library ({'--kernels none' if kernels == 'none' else 'no C++ compiler'})")
        return None
    if unsupported:
        opts.log(f"[1/4] no kernels library: the kernels do not cover this model ({unsupported})")
        return None
    extra = ""
    if compiler.kind == "cuda":
        extra = ", CUTLASS" if with_cutlass() else ", no CUTLASS: pip install --no-deps nvidia-cutlass for faster GEMMs"
    opts.log(f"[1/4] building the kernels library ({compiler.kind} kernels, {Path(compiler.path).name}{extra}; cached)")
    built = build_library(compiler)
    shutil.copy(built.path, stage / LIBRARY_FILE)
    return built


def _export(checkpoint_dir: Path, stage: Path, built: KernelsLibrary | None, opts: _Options):
    """Step 2: the graphs (the kernels flavour's with a library, and their MambaLinear copies) and weights.bin."""
    from mambatrt.export.onnx_export import export_onnx

    at_once = f", up to {opts.workers} traced at once" if opts.workers > 1 else ""
    opts.log(f"[2/4] exporting {', '.join(opts.graphs)} graphs ({opts.precision}{at_once}) from {checkpoint_dir}")
    cuda_linear = ("all" if built.cutlass else "decode") if built and built.cuda else ""
    return export_onnx(
        checkpoint_dir,
        stage,
        precision=opts.precision,
        max_rows=opts.max_rows,
        graphs=opts.graphs,
        progress=not opts.quiet,
        max_batch=opts.max_batch,
        kernels=built is not None,
        max_prefill_batch=opts.max_prefill_batch,
        cuda_linear=cuda_linear,
        cpu_linear=built is not None,
        workers=opts.workers,
    )


def _build_plans(
    trt: TensorRT | None, plans: str, config: MambaConfig, stage: Path, opts: _Options
) -> dict[str, PlanInfo]:
    """Step 3: a TensorRT plan of each portable graph (profiles from the contract), or none."""
    if trt is None:
        why = "--plans none" if plans == "none" else "no TensorRT module to build plans (tensorrt, tensorrt_rtx)"
        opts.log(f"[3/4] {why}: writing an ONNX-only bundle")
        return {}
    cache, infos = timing_cache_path(trt), {}
    for i, graph in enumerate(opts.graphs, 1):
        contract = graph_contract(config, graph, opts.max_rows if graph == PREFILL else 1, opts.max_batch)
        shapes = contract.profile(DEFAULT_OPT_ROWS, DEFAULT_OPT_BATCH)
        if graph == PREFILL:
            axis = f"rows {shapes[TOKEN_IDS][0][0]}..{opts.max_rows}"
        else:
            axis = f"batch 1..{opts.max_batch}"
        opts.log(f"[3/4] building {PLAN_FILES[graph]} with {trt.flavour} ({i}/{len(opts.graphs)}, {axis})")
        request = PlanRequest(stage / GRAPH_FILES[graph], stage / PLAN_FILES[graph], shapes, cache)
        infos[graph] = build_plan(request, trt)
        opts.log(f"      {PLAN_FILES[graph]} built in {infos[graph].build_seconds:.1f} s")
    return infos


def _library_entry(built: KernelsLibrary | None, result) -> dict | None:
    """The manifest's ``kernels_library``: the library's file, kind and compiler, and the graphs' provider copies."""
    if built is None:
        return None
    library = {"file": LIBRARY_FILE, "cuda": built.cuda, "compiler": built.compiler}
    if built.cutlass:
        library["cutlass"] = True
    if result.cuda_graphs:  # the kernels graphs' copies for the CUDA provider (MambaLinear)
        library["cuda_graphs"] = {g: p.name for g, p in result.cuda_graphs.items()}
    if result.cpu_graphs:  # the kernels graphs' copies for the CPU provider (MambaLinear)
        library["cpu_graphs"] = {g: p.name for g, p in result.cpu_graphs.items()}
    return library


def _manifest(config: MambaConfig, checkpoint_dir: Path, stage: Path, result, library: dict | None,
              plans: dict[str, PlanInfo], opts: _Options) -> Manifest:  # fmt: skip
    """The manifest of the finished stage: every file in it with its size and sha256."""
    from mambatrt.export.scan_rows import BLOCKED

    split = opts.layout == "split"
    files = {p.name: FileInfo(p.stat().st_size, sha256_file(p)) for p in sorted(stage.iterdir()) if p.is_file()}
    return Manifest(
        layout=opts.layout,
        precision=opts.precision,
        model=config,
        max_prefill_rows=opts.max_rows,
        opt_prefill_rows=min(DEFAULT_OPT_ROWS, opts.max_rows),  # the prefill plan's optimum
        prefill_scan=BLOCKED if split else None,
        graphs={g: GRAPH_FILES[g] for g in opts.graphs},
        flavour_graphs={f: {g: p.name for g, p in paths.items()} for f, paths in result.flavoured.items()},
        kernels_library=library,
        greedy_graph=GREEDY_FILE if GREEDY_FILE in files else None,
        score_graph=SCORE_FILE if SCORE_FILE in files else None,
        files=files,
        plans=plans,
        tokenizer=TOKENIZER if TOKENIZER in files else None,
        source={"checkpoint": str(checkpoint_dir.resolve())},
        export={"seconds": round(result.seconds, 2), "node_counts": result.node_counts},
        mambatrt_version=__version__,
        max_batch=opts.max_batch,
        max_prefill_batch=opts.max_prefill_batch if split else 1,
        kernels_prefill_rows=kernels_prefill_rows(opts.max_rows) if split and result.flavoured else None,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


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
