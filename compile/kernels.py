"""Build mambatrt's onnxruntime custom-op library (compile/kernels/, docs/kernels.md) for the "kernels" graph flavour.

The library holds MambaConv, MambaScan, MambaAddNorm16 and MambaLinear for onnxruntime's CPU provider, and for its
CUDA provider when nvcc is found (the CUDA runtime linked statically, so the library also loads on machines without
CUDA). Where CUTLASS's headers are found too (the nvidia-cutlass package, or MAMBATRT_CUTLASS_INCLUDE), they are
always built in: MambaLinear's CUDA kernel hands its products of many rows to CUTLASS's 3xTF32 GEMMs
(kernels/mamba_linear_cutlass.cuh). A bundle carries the built library beside its graphs, so running a bundle needs
no compiler. Builds are cached by the hash of every file in compile/kernels/ and of the compiler command
(``$MAMBATRT_CACHE/kernels/``): every bundle built on a machine shares one build.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mambatrt import envs
from mambatrt.errors import BundleError, InputError

SOURCES = Path(__file__).parent / "kernels"
# The files compiled (the headers beside them are included): the onnxruntime glue, the C API and the CPU kernels in
# every build; with nvcc the CUDA kernels, else the CUDA entry points' stand-ins.
HOST_SOURCES = ("ort_ops.cc", "c_api.cc", "cpu_kernels.cc", "cpu_scan.cc", "cpu_linear.cc")
CUDA_SOURCES = ("conv_norm_cuda.cu", "scan_cuda.cu", "linear_cuda.cu", "sample_cuda.cu", "streams_cuda.cu")
CPU_ONLY_SOURCES = ("cuda_stubs.cc",)
LIBRARY_FILE = "libmambatrt_ops.so"
KERNEL_CHOICES = ("auto", "cuda", "cpu", "none")
# Compute capabilities with machine code in the library (sm_75 is the oldest CUDA 13 builds for; sm_80 code also runs
# on 8.6/8.9); compute_90 PTX lets the driver compile for newer GPUs. A GPU none of them covers is found at load
# (mambatrt_ops_cuda_check) and runs another flavour.
CUDA_ARCHS = (
    *("-gencode", "arch=compute_75,code=sm_75"),
    *("-gencode", "arch=compute_80,code=sm_80"),
    *("-gencode", "arch=compute_90,code=[sm_90,compute_90]"),
)
COMMON_FLAGS = ("-O3", "-std=c++17", "-shared")
NVCC_FLAGS = ("--threads", "0")  # the architectures compiled in parallel


@dataclass(frozen=True)
class KernelsLibrary:
    """A built library: its file, whether it has the CUDA kernels (and among them CUTLASS's GEMMs), and the compiler
    that built it."""

    path: Path
    cuda: bool
    compiler: str
    cutlass: bool = False


@dataclass(frozen=True)
class Compiler:
    """The compiler a build uses: ``kind`` "cuda" (nvcc: CUDA + CPU kernels) or "cpu", its path and version line."""

    kind: str
    path: str
    version: str


def _tool(kind: str, named: str | None, *names: str) -> Compiler | None:
    """The compiler ``named`` (an environment variable's value), else the first of ``names`` on PATH, when it runs
    (its ``--version`` answers; the version line goes into the build cache's key)."""
    path = named or next(filter(None, map(shutil.which, names)), None)
    if not path:
        return None
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines() or [""]
    return Compiler(kind, path, lines[-1] if kind == "cuda" else lines[0])  # nvcc's build line is its last


def cutlass_include() -> Path | None:
    """The folder of CUTLASS's C++ headers (``cutlass/gemm/device/gemm.h``): MAMBATRT_CUTLASS_INCLUDE, else the one
    the nvidia-cutlass package ships (module ``cutlass_library``, found without importing it); None when neither
    has them."""
    folders = []
    if envs.MAMBATRT_CUTLASS_INCLUDE is not None:
        folders.append(envs.MAMBATRT_CUTLASS_INCLUDE)
    else:
        try:
            spec = importlib.util.find_spec("cutlass_library")
        except (ImportError, ValueError):
            spec = None
        for location in (spec.submodule_search_locations or []) if spec else []:
            folders.append(Path(location) / "source" / "include")
    return next((f for f in folders if (f / "cutlass" / "gemm" / "device" / "gemm.h").is_file()), None)


def with_cutlass() -> bool:
    """Whether a CUDA build takes CUTLASS's GEMMs in: wherever its headers are found."""
    return cutlass_include() is not None


def _cutlass_flags() -> list[str]:
    if not with_cutlass():
        return []
    return ["-DMAMBATRT_WITH_CUTLASS", "--expt-relaxed-constexpr", "-diag-suppress=20013", "-I", str(cutlass_include())]


def _command(kind: str, tool: str, out: Path) -> list[str]:
    host = [str(SOURCES / name) for name in HOST_SOURCES]
    if kind == "cuda":
        cuda = [str(SOURCES / name) for name in CUDA_SOURCES]
        flags = "-Xcompiler=-fPIC,-fvisibility=hidden"
        return [tool, *COMMON_FLAGS, *NVCC_FLAGS, flags, "-DMAMBATRT_WITH_CUDA", *_cutlass_flags(), *CUDA_ARCHS,
                "-o", str(out), *host, *cuda]  # fmt: skip
    stubs = [str(SOURCES / name) for name in CPU_ONLY_SOURCES]
    return [tool, *COMMON_FLAGS, "-fPIC", "-fvisibility=hidden", "-o", str(out), *host, *stubs]


def _cache_root() -> Path:
    return envs.MAMBATRT_CACHE / "kernels"


def plan_build(kernels: str = "auto") -> Compiler | None:
    """The compiler a build would use: ``auto`` takes nvcc when it runs, else a C++ compiler; ``cuda`` and
    ``cpu`` insist; ``none`` builds nothing. Raises InputError when an insisted-on compiler is missing, so a bundle
    build fails before its export."""
    if kernels not in KERNEL_CHOICES:
        raise InputError(f"unknown --kernels '{kernels}'; choose one of {', '.join(KERNEL_CHOICES)}")
    if kernels == "none":
        return None
    if kernels in ("auto", "cuda"):
        nvcc = _tool("cuda", envs.MAMBATRT_NVCC, "nvcc")
        if nvcc:
            return nvcc
        if kernels == "cuda":
            raise InputError("--kernels cuda needs nvcc (the CUDA toolkit) on PATH or in MAMBATRT_NVCC")
    cxx = _tool("cpu", envs.MAMBATRT_CXX, "g++", "c++")
    if cxx:
        return cxx
    if kernels == "cpu":
        raise InputError("--kernels cpu needs a C++ compiler (g++) on PATH or in MAMBATRT_CXX")
    return None


def build_library(compiler: Compiler) -> KernelsLibrary:
    """Compile (or take from the cache) the library with ``compiler`` (:func:`plan_build`)."""
    digest = hashlib.sha256()
    for source in sorted(SOURCES.iterdir()):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    command = _command(compiler.kind, Path(compiler.path).name, Path(LIBRARY_FILE))
    digest.update(" ".join([*command, compiler.version]).encode())
    if "-DMAMBATRT_WITH_CUTLASS" in command:  # CUTLASS's version is part of the build
        digest.update((cutlass_include() / "cutlass" / "version.h").read_bytes())
    folder = _cache_root() / f"{compiler.kind}-{digest.hexdigest()[:16]}"
    library = folder / LIBRARY_FILE
    if not library.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
        os.close(fd)
        try:
            done = subprocess.run(
                _command(compiler.kind, compiler.path, Path(tmp)), capture_output=True, text=True, timeout=900
            )
            if done.returncode != 0:
                raise BundleError(
                    f"building the kernels library failed ({Path(compiler.path).name} exit {done.returncode}): "
                    f"{(done.stderr or done.stdout).strip()[-800:]}; use --kernels none to build without it"
                )
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o755 & ~umask)  # mkstemp makes 0600: other users must be able to load a bundle's copy
            os.replace(tmp, library)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return KernelsLibrary(library, compiler.kind == "cuda", compiler.version, "-DMAMBATRT_WITH_CUTLASS" in command)
