#!/usr/bin/env bash
# Stage what a GPU machine without a package registry needs for scripts/h200_session.sh, into folders of this
# checkout that git ignores; then copy the checkout, those folders included, to the GPU machine. Wheels are for
# Linux x86-64 and CPython 3.12 (PY_VERSION). Run from the project's root, on a machine with a package registry:
#   bash scripts/serve_wheels.sh [runtime] [aiperf] [reference]      (no argument: all three)
#   runtime    .whl/     onnxruntime-gpu 1.31.1 (CUDA 13 build), polygraphy, onnx-graphsurgeon, the server (fastapi,
#                        uvicorn, httptools, pydantic, jinja2, ...), httpx and aiohttp for eval --url and bench-serve,
#                        nvidia-cutlass (headers for the kernels library's fp32 GEMMs)
#   aiperf     .apwhl/   AIPerf 0.13.0 and the packages it needs beyond the server's
#   reference  .anchor/  the sources of mamba-ssm 2.3.2.post1 and causal-conv1d 1.7.0, which
#                        scripts/mamba_ssm_reference.py builds on the GPU machine (their setup.py imports torch: run
#                        `make install` first, whose .venv has it)
# The GPU machine is assumed to have an NVIDIA driver and nvcc (CUDA 12.4 or later), Python 3.12 with torch (a CUDA
# build), transformers, numpy, onnx, onnxscript, safetensors, tokenizers, tqdm, pytest, anyio, h11, click,
# prometheus-client and uvloop; EXTRA="name ..." adds wheels to .whl/ for anything else it lacks.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
py_version=${PY_VERSION:-3.12}
platform=(--only-binary=:all: --python-version "$py_version" --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
exclude() { grep -qx "$1" .git/info/exclude 2>/dev/null || echo "$1" >> .git/info/exclude; }

for what in "${@:-runtime aiperf reference}"; do
  for step in $what; do
    case $step in
      runtime)
        exclude '/.whl/'
        python3 -m pip download -q --no-deps "${platform[@]}" -d .whl \
          onnxruntime-gpu==1.31.1 polygraphy onnx-graphsurgeon nvidia-cutlass \
          fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions \
          opentelemetry-api uvicorn httptools aiohttp aiohappyeyeballs aiosignal frozenlist multidict yarl propcache \
          attrs idna httpx httpcore jinja2 markupsafe ${EXTRA:-}
        echo ".whl: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1)";;
      aiperf)
        exclude '/.apwhl/'
        python3 -m pip download -q --no-deps "${platform[@]}" -d .apwhl \
          aiperf==0.13.0 crick cyclopts docstring-parser rich-rst docutils ffmpeg-python future msgspec orjson \
          pydantic-settings python-dotenv pyzmq ruamel.yaml ruamel.yaml.clib setproctitle zstandard brotli
        echo ".apwhl: $(ls .apwhl | wc -l) wheels, $(du -sh .apwhl | cut -f1)";;
      reference)
        exclude '/.anchor/'
        py=${PYTHON:-.venv/bin/python}
        "$py" -c "import torch" 2> /dev/null || { echo "$py has no torch: make install first, or PYTHON=..."; exit 1; }
        "$py" -m pip install -q wheel packaging ninja setuptools  # what their setup.py imports besides torch
        tmp=$(mktemp -d)
        # their CUDA builds are skipped here: scripts/mamba_ssm_reference.py compiles the forward kernels it needs
        MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE "$py" -m pip download -q --no-deps \
          --no-build-isolation --no-binary=:all: -d "$tmp" mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0
        rm -rf .anchor && mkdir -p .anchor
        for f in "$tmp"/*.tar.gz; do tar xzf "$f" -C .anchor; done
        rm -rf "$tmp"
        echo ".anchor: $(ls .anchor | tr '\n' ' ')";;
      *) echo "unknown step '$step': runtime, aiperf or reference"; exit 1;;
    esac
  done
done
