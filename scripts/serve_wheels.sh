#!/usr/bin/env bash
# The server's wheels that the H200 image lacks (fastapi and what it needs, uvicorn, httptools; aiohttp for
# bench-serve; nvidia-cutlass for its headers, which the kernels library's build uses), for its Python
# 3.12, into .whl/ (git-ignored; carry it with the call that runs h200_session.sh). The image already has anyio,
# h11, click, prometheus-client, uvloop and annotated-doc. Run from the project's root: bash scripts/serve_wheels.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl \
  fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions opentelemetry-api \
  uvicorn httptools aiohttp aiohappyeyeballs aiosignal frozenlist multidict yarl propcache attrs idna nvidia-cutlass 2>&1 | grep -v -i warning || true
ls .whl
