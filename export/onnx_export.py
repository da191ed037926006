"""Export :class:`.model.MambaLM` to a bundle's ONNX files, all sharing one external weights file.

What is written into the output directory:

    decode.onnx    token_ids [batch] -> logits [batch, Vp], conv_state_out, ssm_state_out; batch in 1..max_batch
    prefill.onnx   token_ids [rows]  -> logits [1, Vp], the states of one sequence; rows in 1..max_rows
    *.kernels.onnx the same graphs through mambatrt's ops, each layer's states a tensor of their own; their prefill
                   takes B sequences of T rows each (token_ids [B x T], states and logits [B, ..]), B in
                   1..max_prefill_batch (when the model is within the kernels' limits)
    *.kernels-cuda.onnx, *.kernels-cpu.onnx   the kernels graphs with MambaLinear products (:mod:`.linear_copies`)
    greedy.onnx    the greedy picker
    weights.bin    every initializer of the graphs above 1 KiB, each stored once (:mod:`.weights`)

The I/O names, dtypes and dynamic axes come from :mod:`mambatrt.contract`; each graph is exported, cleaned and
checked by :mod:`.graphs`. Tracing a graph is single-threaded Python and takes most of an export's time, so with
``workers`` > 1 the graphs are traced that many at once, in processes forked from this one (they share the loaded
model's memory and read none of its weights); this process stores each graph's weights as it comes back. The write
is atomic: files appear in the output directory only when every graph and the weights are complete.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from mambatrt.contract import (
    DECODE,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_PREFILL_BATCH,
    GRAPHS,
    GREEDY_FILE,
    KERNELS,
    PORTABLE,
    PREFILL,
    SCORE,
    GraphContract,
    cpu_graph_file,
    cuda_graph_file,
    graph_contract,
    graph_file,
    kernels_prefill_rows,
    kernels_unsupported,
)
from mambatrt.errors import InputError, raise_if_signalled
from mambatrt.paths import EXPORT_STAGE_PREFIX, check_output_folder, remove_dead_stages

from .checkpoint import load_model
from .graphs import check_graph, export_graph, finish_graph, write_greedy_graph
from .linear_copies import linear_copy
from .model import MambaLM, precision_dtype
from .weights import WEIGHTS_FILE, WeightsWriter

LINEAR_COPIES = ("", "decode", "all")  # cuda_linear: no CUDA copies, the decode graph's, both graphs' (head too)


@dataclass
class ExportResult:
    """What :func:`export_onnx` wrote and how long it took."""

    out_dir: Path
    graphs: dict[str, Path]
    weights_file: Path
    weights_bytes: int  # size of weights.bin
    param_bytes: int  # bytes of the model's parameters at the export precision
    node_counts: dict[str, int]
    seconds: float
    op_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    flavoured: dict[str, dict[str, Path]] = field(default_factory=dict)  # flavour -> graph -> file, beside portable
    cuda_graphs: dict[str, Path] = field(default_factory=dict)  # graph -> the kernels graph's CUDA copy
    cpu_graphs: dict[str, Path] = field(default_factory=dict)  # graph -> the kernels graph's CPU copy
    score_graph: Path | None = None  # score.onnx (contract.SCORE), beside a prefill graph

    @property
    def onnx_bytes(self) -> int:
        """Bytes of everything written: the graphs of every flavour plus the weights file."""
        files = list(self.graphs.values()) + [p for paths in self.flavoured.values() for p in paths.values()]
        files += list(self.cuda_graphs.values()) + list(self.cpu_graphs.values())
        files += [self.score_graph] if self.score_graph is not None else []
        return self.weights_bytes + sum(p.stat().st_size for p in files)


@dataclass(frozen=True)
class _Job:
    """One graph of one flavour to export, with its contract and where its copies with MambaLinear go."""

    graph: str
    flavour: str
    contract: GraphContract
    copies: tuple[tuple[str, bool], ...] = ()  # (provider "cuda" or "cpu", with the LM head): kernels graphs only

    @property
    def file(self) -> str:
        return graph_file(self.graph, self.flavour)

    @property
    def key(self) -> str:
        """The graph's name in the node and op counts: decode, prefill.kernels, ..."""
        return self.graph if self.flavour == PORTABLE else f"{self.graph}.{self.flavour}"


def _jobs(model: MambaLM, graphs: tuple[str, ...], kernels: bool, limits: tuple[int, int], cuda_linear: str,
          cpu_linear: bool) -> list[_Job]:  # fmt: skip
    """The graphs to export: the portable ones, then the kernels ones (layered states, a batched prefill of rows of
    its own: :func:`kernels_prefill_rows`) when asked for and the model is within the kernels' limits. ``limits``:
    (max_batch, max_prefill_batch)."""
    max_batch, max_prefill_batch = limits
    portable = (*graphs, SCORE) if PREFILL in graphs else graphs  # the scoring graph beside a prefill graph
    jobs = [_Job(g, PORTABLE, graph_contract(model.config, g, model.max_rows, max_batch)) for g in portable]
    if not kernels or kernels_unsupported(model.config):
        return jobs
    rows = kernels_prefill_rows(model.max_rows)
    for g in graphs:
        contract = graph_contract(model.config, g, rows, max_batch, max_prefill_batch, layered=True)
        cuda = cuda_linear == "all" or (cuda_linear == "decode" and g == DECODE)
        copies = (("cuda", cuda_linear == "all"),) if cuda else ()
        jobs.append(_Job(g, KERNELS, contract, copies + ((("cpu", True),) if cpu_linear else ())))
    return jobs


def export_model(
    model: MambaLM,
    out_dir: str | Path,
    graphs: tuple[str, ...] = GRAPHS,
    precision: str = "fp32",
    progress: bool = True,
    max_batch: int = DEFAULT_MAX_BATCH,
    kernels: bool = True,
    max_prefill_batch: int = DEFAULT_MAX_PREFILL_BATCH,
    cuda_linear: str = "",
    cpu_linear: bool = False,
    workers: int = 1,
) -> ExportResult:
    """Export an already loaded model's graphs into ``out_dir`` (created; existing graph files are replaced).

    ``max_batch``: the decode graph's largest batch of sequences (its batch axis runs 1..max_batch).
    ``kernels``: also the kernels flavour's graphs (mambatrt's ops), for a model within the kernels' limits.
    ``max_prefill_batch``: the kernels prefill graph's largest batch (the portable one takes one sequence).
    ``cuda_linear``: also write CUDA copies of the kernels graphs (:mod:`.linear_copies`; the op library must have
    its CUDA kernels) when the model has fp32 projections: "decode" the decode graph's, its layers' projections as
    MambaLinear; "all" (a library with CUTLASS's GEMMs) the decode and prefill graphs', the LM head too.
    ``cpu_linear``: also write the kernels graphs' CPU copies (every fp32 product, the LM head's too).
    ``workers``: how many graphs are traced at once, each in a process forked from this one (1: in this process;
    :func:`default_workers`).
    """
    from tqdm import tqdm

    check_export_args(precision, model.max_rows, graphs, max_batch, max_prefill_batch, workers)
    if cuda_linear not in LINEAR_COPIES:
        raise ValueError(f"cuda_linear must be one of {LINEAR_COPIES}, not {cuda_linear!r}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    jobs = _jobs(model, graphs, kernels, (max_batch, max_prefill_batch), cuda_linear, cpu_linear)
    workers = min(workers, len(jobs))
    steps = tqdm(total=2 * len(jobs), desc="export", unit="step", disable=not progress, leave=False)
    remove_dead_stages(out_dir.parent, EXPORT_STAGE_PREFIX)  # left by exports that were killed
    stage = Path(tempfile.mkdtemp(prefix=f"{EXPORT_STAGE_PREFIX}{os.getpid()}-", dir=out_dir.parent))
    try:
        final = stage / "final"
        final.mkdir()
        written, op_counts, weights_bytes = _export_into(model, jobs, final, precision, steps, workers)
        raise_if_signalled()  # a signal whose KeyboardInterrupt torch's imports swallowed: nothing moves into out_dir
        out_dir.mkdir(exist_ok=True)
        for item in final.iterdir():
            os.replace(item, out_dir / item.name)
    finally:
        steps.close()
        shutil.rmtree(stage, ignore_errors=True)

    return _result(model, out_dir, jobs, written, op_counts, weights_bytes, time.perf_counter() - start)


def _result(model: MambaLM, out_dir: Path, jobs: list[_Job], written: dict, op_counts: dict, weights_bytes: int,
            seconds: float) -> ExportResult:  # fmt: skip
    """The ExportResult of the files ``written`` (kind -> graph -> name, as :func:`_export_into` returns them)."""

    def paths(kind: str) -> dict[str, Path]:
        return {g: out_dir / name for g, name in written.get(kind, {}).items()}

    graphs = paths(PORTABLE)
    score = graphs.pop(SCORE, None)
    return ExportResult(
        out_dir=out_dir,
        graphs=graphs,
        weights_file=out_dir / WEIGHTS_FILE,
        weights_bytes=weights_bytes,
        param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        node_counts={job.key: sum(op_counts[job.key].values()) for job in jobs},
        seconds=seconds,
        op_counts=op_counts,
        flavoured={KERNELS: paths(KERNELS)} if KERNELS in written else {},
        cuda_graphs=paths(f"{KERNELS}-cuda"),
        cpu_graphs=paths(f"{KERNELS}-cpu"),
        score_graph=score,
    )


def _export_into(model: MambaLM, jobs: list[_Job], final: Path, precision: str, steps, workers: int) -> tuple:
    """Export every job's graph into ``final``, its large initializers into ``final``'s weights.bin as it comes.

    Returns (kind -> graph -> file name, kind "portable", "kernels", "kernels-cuda" or "kernels-cpu"; op counts by
    graph; the size of weights.bin). ``steps``: a tqdm bar, advanced once per graph and pass.
    """
    written, op_counts = {}, {}
    traced = closing(_traced(model, jobs, workers, steps))  # the workers stop when this closes, however it ends
    with traced as protos, WeightsWriter(final / WEIGHTS_FILE, model.state_dict()) as weights:
        for job, proto in zip(jobs, protos, strict=True):
            steps.update()
            weights.store(proto)
            finished = finish_graph(proto, model, job.contract, job.flavour, precision)
            _write_graph(finished, job, final, written, op_counts)
            steps.update()
        weights_bytes = weights.size
    write_greedy_graph(model.config, final / GREEDY_FILE)
    return written, op_counts, weights_bytes


def default_workers() -> int:
    """How many graphs an export traces at once by default: one per usable core. A trace keeps one core busy and
    storing weights between traces is short: a ~210M-parameter fp32 bundle took 80 s with two tracing processes on a
    2-core machine, 134 s traced in the build's own process."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores)


def _traced(model: MambaLM, jobs: list[_Job], workers: int, steps) -> Iterator[onnx.ModelProto]:
    """Each job's graph (:func:`.graphs.export_graph`), in job order: traced in this process, or ``workers`` at once,
    each in a process forked from this one for the job (its memory goes with it). A process that has loaded the
    CUDA driver traces in itself: CUDA does not survive fork() (the children of a test process holding onnxruntime
    CUDA sessions died of SIGSEGV)."""
    if workers <= 1 or _cuda_loaded():
        for job in jobs:
            steps.set_postfix_str(f"torch.onnx.export {job.file}")
            yield export_graph(model, job.contract, job.flavour)
        return
    steps.set_postfix_str(f"torch.onnx.export in {workers} processes")
    running: dict[int, tuple] = {}  # job index -> (process, the parent's end of its pipe)
    done: dict[int, onnx.ModelProto] = {}
    started = 0
    try:
        for i in range(len(jobs)):
            while started < len(jobs) and len(running) < workers:
                running[started] = _start_trace(model, jobs[started])
                started += 1
            while i not in done:
                _collect(running, done, jobs)
            yield done.pop(i)
    finally:
        for process, _ in running.values():
            process.terminate()
            process.join()


def _cuda_loaded() -> bool:
    """Whether this process has mapped the CUDA driver library (Linux's /proc says; elsewhere: not known, so True)."""
    try:
        with open("/proc/self/maps") as f:
            return any("libcuda.so" in line for line in f)
    except OSError:
        return True


def _start_trace(model: MambaLM, job: _Job) -> tuple:
    """A process forked to trace ``job``'s graph, and the parent's end of its pipe."""
    context = multiprocessing.get_context("fork")  # the child shares the loaded model's memory
    ours, theirs = context.Pipe(duplex=False)
    process = context.Process(target=_trace_in_child, args=(model, job, theirs), daemon=True)
    process.start()
    theirs.close()  # the child's end: once the child is gone, reading ours says so
    return process, ours


def _collect(running: dict[int, tuple], done: dict[int, onnx.ModelProto], jobs: list[_Job]) -> None:
    """Wait until a tracing process answers or ends; move its graph from ``running`` into ``done``, or raise."""
    waits = [c for _, c in running.values()] + [p.sentinel for p, _ in running.values()]
    ready = multiprocessing.connection.wait(waits)
    for k, (process, conn) in list(running.items()):
        if conn not in ready and process.sentinel not in ready:
            continue
        try:
            ok, payload = conn.recv()
        except EOFError:  # ended without a word: killed (out of memory?)
            process.join()
            ok, payload = False, f"the process ended with exit code {process.exitcode}"
        del running[k]
        process.join()
        if not ok:
            raise RuntimeError(f"tracing {jobs[k].file} failed in its process: {payload}")
        done[k] = onnx.ModelProto.FromString(payload)


def _trace_in_child(model: MambaLM, job: _Job, conn) -> None:
    """In a forked tracing process: send back the job's graph (it names the model's tensors rather than holding
    them) or the traceback of its failure. Ctrl-C is left to the parent, which ends the processes (SIGTERM); one
    torch thread, as the traces beside it take the other cores."""
    import traceback

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(1)
    try:
        conn.send((True, export_graph(model, job.contract, job.flavour).SerializeToString()))
    except Exception:
        conn.send((False, traceback.format_exc()))


def _write_graph(proto: onnx.ModelProto, job: _Job, final: Path, written: dict, op_counts: dict) -> None:
    """Save a finished graph and its MambaLinear copies into ``final``, check each, and record their files
    (``written``: kind -> graph -> name) and op counts."""
    onnx.save(proto, str(final / job.file))
    op_counts[job.key] = check_graph(final / job.file)
    written.setdefault(job.flavour, {})[job.graph] = job.file
    for provider, head in job.copies:
        made = linear_copy(proto, head=head, cpu=provider == "cpu")
        if made is None:
            continue
        name = (cuda_graph_file if provider == "cuda" else cpu_graph_file)(job.graph)
        onnx.save(made, str(final / name))
        op_counts[f"{job.graph}.{KERNELS}-{provider}"] = check_graph(final / name)
        written.setdefault(f"{KERNELS}-{provider}", {})[job.graph] = name


def check_export_args(
    precision: str,
    max_rows: int,
    graphs: tuple[str, ...] = GRAPHS,
    max_batch: int = DEFAULT_MAX_BATCH,
    max_prefill_batch: int = DEFAULT_MAX_PREFILL_BATCH,
    workers: int = 1,
) -> None:
    """Refuse an unknown precision or graph, or row, batch and process counts outside 1..4096, before any work."""
    precision_dtype(precision)
    for name, value in (
        ("--max-rows", max_rows),
        ("--max-batch", max_batch),
        ("--max-prefill-batch", max_prefill_batch),
        ("workers", workers),
    ):
        if not 1 <= value <= 4096:
            raise InputError(f"{name} must be in 1..4096, got {value}")
    if not graphs:
        raise InputError(f"no graph to export; choose from {', '.join(GRAPHS)}")
    for g in graphs:
        if g not in GRAPHS:
            raise InputError(f"unknown graph '{g}'; choose from {', '.join(GRAPHS)}")


def export_onnx(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    precision: str = "fp32",
    max_rows: int = 64,
    graphs: tuple[str, ...] = GRAPHS,
    progress: bool = True,
    max_batch: int = DEFAULT_MAX_BATCH,
    kernels: bool = True,
    max_prefill_batch: int = DEFAULT_MAX_PREFILL_BATCH,
    cuda_linear: str = "",
    cpu_linear: bool = False,
    workers: int = 1,
) -> ExportResult:
    """Load a checkpoint and export its graphs (see the module docstring and :func:`export_model`) into
    ``out_dir``."""
    check_export_args(precision, max_rows, graphs, max_batch, max_prefill_batch, workers)
    check_output_folder(out_dir)
    model = load_model(checkpoint_dir, precision=precision, max_rows=max_rows)
    limits = {"max_batch": max_batch, "max_prefill_batch": max_prefill_batch}
    copies = {"cuda_linear": cuda_linear, "cpu_linear": cpu_linear}
    return export_model(
        model, out_dir, graphs, precision, progress, kernels=kernels, workers=workers, **limits, **copies
    )
