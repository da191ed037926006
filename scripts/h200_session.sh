#!/usr/bin/env bash
# One H200 session (device tool): install the staged onnxruntime-gpu/polygraphy/graphsurgeon wheels, install
# mambatrt, run the GPU tests, then time mamba-130m-shaped bundles through the onnxruntime CUDA EP.
# Usage there: bash scripts/h200_session.sh [tests|bench|all]   (results under $OUT)
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/stage
if [ ! -d /tmp/site/onnxruntime ]; then
  cat /tmp/stage/ort.part.* > /tmp/stage/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl && rm /tmp/stage/ort.part.*
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import onnxruntime as ort, torch, transformers, platform
ort.preload_dlls()
print("onnxruntime", ort.__version__, ort.get_available_providers())
print("torch", torch.__version__, torch.cuda.get_device_name(0), "transformers", transformers.__version__, platform.node())
PY
if [ "$what" = tests ] || [ "$what" = all ]; then
  python3 -m pytest -q -m gpu tests/runtime/test_cuda.py tests/export/test_scan_rows.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -c "from mambatrt.testing import write_hf_checkpoint, MAMBA_130M; write_hf_checkpoint('/tmp/ck130', **MAMBA_130M)" 2>/dev/null
  for p in fp32 fp16; do
    [ -d /tmp/b130-$p ] || mambatrt bundle /tmp/ck130 --out /tmp/b130-$p --precision $p --engines none --quiet
    mambatrt run /tmp/b130-$p --prompt-ids "$(python3 -c 'print(",".join(str(i * 37 % 50000) for i in range(128)))')" \
      --max-new-tokens 32 --device cuda --json | tee "$OUT/run_130m_$p.json"
    mambatrt bench /tmp/b130-$p --device cuda --prompt-lengths ${LENGTHS:-5,71,84,128,512} --repeat 5 --new-tokens 8 \
      ${REFERENCE:+--reference hf} --json > "$OUT/bench_130m_$p.json" 2> "$OUT/bench_130m_$p.err"
    tail -c 300 "$OUT/bench_130m_$p.err"
  done
fi
