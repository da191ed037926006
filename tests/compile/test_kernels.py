"""The kernels library (compile/kernels/, docs/kernels.md): its build, its C API and its CPU kernels alone (the
kernels graphs against the portable graphs: tests/runtime/test_flavours.py)."""

import ctypes
import platform
import subprocess
import sys

import numpy as np
import pytest

from mambatrt.compile import kernels
from mambatrt.contract import DECODE, KERNELS, PREFILL
from mambatrt.runtime.bundle import load_bundle
from mambatrt.runtime.runners.ort.cpu import OrtCpuRunner
from mambatrt.testing import check_mamba_linear


def test_build_compiles_every_source():
    """Every .cc and .cu file of compile/kernels/ is in one of the build's lists, and none reads the environment
    (the library takes what it needs from its callers: mambatrt_ops_cap_cpu_isa, not an environment variable)."""
    built = {*kernels.HOST_SOURCES, *kernels.CUDA_SOURCES, *kernels.CPU_ONLY_SOURCES}
    sources = {p.name for p in kernels.SOURCES.iterdir() if p.suffix in (".cc", ".cu")}
    assert built == sources
    for path in kernels.SOURCES.iterdir():
        assert "getenv" not in path.read_text(), f"{path.name} reads the environment"


def _bundle_with_failing_nvcc(checkpoint_factory, tmp_path, cli, monkeypatch, script: str) -> tuple[int, str]:
    """`mambatrt bundle --kernels cuda` with an nvcc that answers --version, runs ``script`` (sh) and fails; the
    build cache under tmp_path: (exit code, stderr)."""
    fake = tmp_path / "nvcc"
    version = 'if [ "$1" = --version ]; then echo "fake nvcc 0.1"; exit 0; fi'
    fake.write_text(f"#!/bin/sh\n{version}\n{script}\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("MAMBATRT_NVCC", str(fake))
    monkeypatch.setenv("MAMBATRT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "b"
    code, _, err = cli("bundle", checkpoint_factory("tiny"), "--out", out, "--plans", "none", "--kernels", "cuda")
    print(err)
    return code, err


def test_failing_kernels_compiler(checkpoint_factory, tmp_path, cli, monkeypatch):
    """A compiler that runs but fails: one line naming it and the way out (--kernels none), exit 2, before the
    export; nothing left at --out, no half-built library in the cache."""
    code, err = _bundle_with_failing_nvcc(checkpoint_factory, tmp_path, cli, monkeypatch, 'echo "boom" >&2')
    out = tmp_path / "b"
    assert code == 2 and "boom" in err and "--kernels none" in err and "Traceback" not in err
    assert len(err.strip().splitlines()[-1]) < 1000 and "exporting" not in err
    assert not out.exists() and not list(tmp_path.glob(".b.building-*"))
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


@pytest.mark.parametrize("case", ["found", "missing"])
def test_kernels_build_takes_cutlass_where_found(checkpoint_factory, tmp_path, cli, monkeypatch, case):
    """CUTLASS's headers (MAMBATRT_CUTLASS_INCLUDE here; the nvidia-cutlass package's otherwise) go into a CUDA
    build as -DMAMBATRT_WITH_CUTLASS -I DIR, and the bundle's progress line says so; a folder without them builds
    without and the line names the package to install. Every CUDA and host source is compiled. (A recording nvcc
    that then fails: the command is what is checked, nothing is built.)"""
    include = tmp_path / "include"
    if case == "found":
        (include / "cutlass" / "gemm" / "device").mkdir(parents=True)
        (include / "cutlass" / "gemm" / "device" / "gemm.h").write_text("// stand-in\n")
        (include / "cutlass" / "version.h").write_text("// stand-in\n")
    monkeypatch.setenv("MAMBATRT_CUTLASS_INCLUDE", str(include))
    args = tmp_path / "args"
    script = f'echo "$@" > {args}; echo "stop here" >&2'
    code, err = _bundle_with_failing_nvcc(checkpoint_factory, tmp_path, cli, monkeypatch, script)
    command = args.read_text()
    print(command)
    assert code == 2 and "stop here" in err and not (tmp_path / "b").exists()
    compiled = {word.rsplit("/", 1)[-1] for word in command.split()}
    assert compiled >= {*kernels.HOST_SOURCES, *kernels.CUDA_SOURCES}
    assert not compiled & set(kernels.CPU_ONLY_SOURCES)
    if case == "found":
        assert "-DMAMBATRT_WITH_CUTLASS" in command and f"-I {include}" in command and ", CUTLASS;" in err
    else:
        assert "CUTLASS" not in command and "pip install --no-deps nvidia-cutlass" in err


@pytest.mark.slow
def test_cpu_only_build():
    """The build a machine without nvcc makes (g++; cached like any build): its C API says it has no CUDA kernels
    and no streams, and MambaLinear's CPU kernel holds (as test_mamba_linear_cpu_kernel's)."""
    compiler = kernels.plan_build("cpu")
    built = kernels.build_library(compiler)
    assert not built.cuda and not built.cutlass and built.path.is_file()
    library = ctypes.CDLL(str(built.path))
    library.mambatrt_ops_cuda_check.restype = ctypes.c_char_p
    library.mambatrt_ops_new_stream.restype = ctypes.c_void_p
    assert library.mambatrt_ops_has_cuda() == 0 and b"without CUDA" in library.mambatrt_ops_cuda_check()
    assert library.mambatrt_ops_new_stream(0) is None
    check_mamba_linear(built.path, "CPUExecutionProvider", rows=(1, 17))


def test_kernels_library_says_whether_its_cuda_kernels_run(bundle_factory):
    """The library answers, before any launch, whether its CUDA kernels can run on this machine's GPU (the runtime
    asks before running the kernels graphs on CUDA): None where they can, else why (no GPU, no nvcc, an
    architecture the library has no code for)."""
    import onnxruntime as ort

    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    library = ctypes.CDLL(str(bundle.kernels_library))
    library.mambatrt_ops_cuda_check.restype = ctypes.c_char_p
    why = library.mambatrt_ops_cuda_check()
    print(why)
    if bundle.kernels_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        assert why is None
    else:
        assert why and isinstance(why, bytes)


def test_kernels_ask_onnxruntime_for_the_sessions_stream(bundle_factory):
    """Each kernel asks onnxruntime for its session's compute stream (OrtApi slot 193,
    KernelContext_GetGPUComputeStream), so that two sessions on two streams run side by side. On the CPU provider
    the answer is no stream: a wrong slot would crash, or answer with some other pointer (its neighbours write a
    memory info or a flag there). The GPU tests check that a CUDA session's kernels run on the stream it was given."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    library = ctypes.CDLL(str(bundle.kernels_library))
    library.mambatrt_ops_last_stream.restype = ctypes.c_void_p
    backend = OrtCpuRunner(bundle, KERNELS)  # registers the library: the same handle as ``library``
    before = library.mambatrt_ops_last_stream()
    backend.run(DECODE, [3])
    after = library.mambatrt_ops_last_stream()
    print("last stream before", before, "after a CPU launch", after)
    assert after is None  # nullptr: the CPU provider has no stream
    assert hasattr(library, "mambatrt_ops_new_stream")


def test_mamba_linear_cpu_kernel(bundle_factory):
    """MambaLinear's CPU kernel alone: x w^T within 1e-5 of float64 at mamba-130m's projection shapes and an odd one,
    a batch's rows as each row alone (mambatrt.testing.check_mamba_linear; tests/runtime/test_cuda.py runs the same
    on the CUDA kernel)."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    check_mamba_linear(bundle.kernels_library, "CPUExecutionProvider", rows=(1, 7, 17, 64))


def _threads_equal_one(bundle, label: str) -> None:
    """The kernels graphs on three threads give the bits they give on one: decode launches of 1, 5, 16 and max_batch
    sequences, prefill launches of 1 x 37, 3 x 64 and 2 x 5 rows (the CPU kernels' tasks, blocks of channels and
    sequences, on the session's threads where a launch has enough work: kParallelWork)."""
    c, most = bundle.config, bundle.manifest.max_batch
    one, three = OrtCpuRunner(bundle, KERNELS, 1), OrtCpuRunner(bundle, KERNELS, 3)
    rng = np.random.default_rng(4)
    for graph, batch, rows in ((DECODE, 1, 1), (DECODE, 5, 1), (DECODE, 16, 1), (DECODE, most, 1), (PREFILL, 1, 37),
                               (PREFILL, 3, 64), (PREFILL, 2, 5)):  # fmt: skip
        ids = rng.integers(0, c.vocab_size, batch * rows).astype(np.int64)
        conv = (rng.standard_normal((batch, *c.conv_state_shape)) * 0.3).astype(np.float32)
        ssm = (rng.standard_normal((batch, *c.ssm_state_shape)) * 0.3).astype(np.float32)
        want, got = (b.run_states(graph, ids, conv, ssm) for b in (one, three))
        for what, a, w in zip(("logits", "conv", "ssm"), got, want, strict=True):
            print(f"{label} {graph} {batch} x {rows}: {what} worst difference on three threads", np.abs(a - w).max())
            assert np.array_equal(a, w), f"{label} {graph} {batch} x {rows}: {what} differs on three threads"


@pytest.mark.parametrize("name", ["tiny-wide", "tiny-odd"])
def test_cpu_kernels_threads_equal_one_thread(bundle_factory, name):
    """The CPU conv and scan split a launch into tasks (blocks of channels, sequences) for the session's threads:
    the same bits on three threads as on one, with partial blocks (tiny-odd's 120 channels, tiny-wide's 320) and the
    AVX-512 passes for N = 16 where the CPU has them (test_cpu_kernels_builds_equal_portable: the other builds)."""
    _threads_equal_one(load_bundle(bundle_factory(name, "split", plans="none")), name)


ISA_BUILDS = ("sse2", "avx2", "avx512")  # the CPU kernels' builds on x86-64, from the baseline up


def test_unknown_isa_cap_is_refused(bundle_factory):
    """mambatrt_ops_cap_cpu_isa, the tests' hook, answers 1 for a name it does not know and changes nothing; the
    library names the build it runs (mambatrt_ops_cpu_isa), the best this CPU has."""
    bundle = load_bundle(bundle_factory("tiny-odd", "split", plans="none"))
    library = ctypes.CDLL(str(bundle.kernels_library))
    library.mambatrt_ops_cpu_isa.restype = ctypes.c_char_p
    isa, packs = library.mambatrt_ops_cpu_isa(), library.mambatrt_ops_cpu_linear()
    print("CPU kernels' build:", isa)
    assert isa.decode() in (*ISA_BUILDS, "portable") and packs == (isa == b"avx512")
    assert library.mambatrt_ops_cap_cpu_isa(b"avx1024") == 1 and library.mambatrt_ops_cap_cpu_isa(None) == 1
    assert library.mambatrt_ops_cpu_isa() == isa and library.mambatrt_ops_cpu_linear() == packs


def _capped_builds_equal_portable(isa: str, path: str, wide: str) -> None:
    """In a process of its own: the two bundles' libraries capped at ``isa`` before any session exists, then their
    kernels graphs held to the portable graphs and to themselves on one thread."""
    from mambatrt.runtime.runners.ort.loader import cpu_linear_copy
    from tests.runtime.test_flavours import RTOL_FP32, _launches_equal_portable

    bundles = load_bundle(path), load_bundle(wide)
    for bundle in bundles:
        library = ctypes.CDLL(str(bundle.kernels_library))
        library.mambatrt_ops_cpu_isa.restype = ctypes.c_char_p
        assert library.mambatrt_ops_cap_cpu_isa(isa.encode()) == 0
        runs = library.mambatrt_ops_cpu_isa().decode()  # the cap, or a lower build where the CPU lacks it
        print(f"capped at {isa}: the {runs} build runs")
        assert ISA_BUILDS.index(runs) <= ISA_BUILDS.index(isa) and not library.mambatrt_ops_cpu_linear()
    launches = ((DECODE, 5, 5), (PREFILL, 1, 37), (PREFILL, 1, 64))
    _launches_equal_portable(bundles[0], KERNELS, launches, RTOL_FP32, f"{isa} build")
    assert not cpu_linear_copy(bundles[0], KERNELS), "a capped build runs the CPU copies"
    _threads_equal_one(bundles[1], f"{isa} build")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="one CPU kernels build off x86-64")
@pytest.mark.parametrize("isa", ["sse2", "avx2"])
def test_cpu_kernels_builds_equal_portable(bundle_factory, isa):
    """The library's CPU kernels have an AVX-512 and an AVX2 build (the best the CPU has runs) and a baseline SSE2
    one; the C API's test hook mambatrt_ops_cap_cpu_isa caps the choice, so every build is held to the portable
    graphs on one machine (the default one in the other tests; a capped one here, in a process of its own, capped
    before its sessions are made), and gives the same bits on three threads as on one."""
    path = bundle_factory("tiny-n8-k3", "split", plans="none")
    wide = bundle_factory("tiny-wide", "split", plans="none")
    script = "import sys; from tests.compile.test_kernels import _capped_builds_equal_portable as f; f(*sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", script, isa, str(path), str(wide)], capture_output=True, text=True)
    print(done.stdout[-2000:], done.stderr[-2000:])
    assert done.returncode == 0
    assert "worst relative difference" in done.stdout and "on three threads 0.0" in done.stdout
