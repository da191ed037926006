#!/usr/bin/env bash
# docs/benchmarks.md's GPU figures, reproduced on one machine with an NVIDIA GPU (measured on an H200) and no
# package registry: installs the wheels that scripts/serve_wheels.sh staged beside the checkout (.whl/, .apwhl/),
# installs mambatrt, then runs the steps named on the command line, in order. Run from the checkout's root:
#   bash scripts/h200_session.sh [bundles] [tests] [bench] [reference] [aiperf] [big]
#   bundles    random-weight mamba-130m-shaped bundles for PRECISIONS (default "fp32 fp16"), built in the background
#              while the next steps run (bench and aiperf build what they need otherwise)
#   tests      the GPU tests: pytest -m gpu
#   bench      `mambatrt bench --device cuda` of the 130m bundles: prefill of LENGTHS (default 5,128,512) tokens and
#              decode ms/token, batch 1; REFERENCE_HF=1 adds HF transformers' column, measured in the same run
#   reference  mamba_ssm 2.3.2's fused kernels on the same GPU (scripts/mamba_ssm_reference.py; sources in .anchor/
#              from `bash scripts/serve_wheels.sh reference`): 130m fp32/fp16, and 2.8b fp16 (REFERENCE_SHAPES)
#   aiperf     `mambatrt serve --device cuda --max-batch 128` with serve's defaults, AIPerf 0.13.0 at AIPERF_LEVELS
#              (default "1 8 32 64 128"), ISL 128 / OSL 64, streaming, max(32, 8 x concurrency) requests per level,
#              greedy (EXTRA_INPUTS, default temperature:0; EXTRA_INPUTS= sends AIPerf's default sampling)
#   big        a random mamba-2.8b-shaped fp16 checkpoint, its bundle (wall time and peak memory) and its bench
# Results in OUT (default gpu-results/): log.txt, bench_*.json, mamba_ssm.json, aiperf-PRECISION/ (AIPerf's
# artifacts per level, the server's log and /metrics). Work files in WORK (default /tmp/mambatrt-gpu); the wheels
# install into SITE and APSITE (default under WORK). A failed step does not stop the next one.
set -uo pipefail
[ $# -gt 0 ] || { sed -n '2,20p' "$0"; exit 1; }  # no step named: print the usage above
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
WORK=${WORK:-/tmp/mambatrt-gpu}
SITE=${SITE:-$WORK/site}
APSITE=${APSITE:-$WORK/aiperf-site}
mkdir -p "$OUT" "$WORK"
log="$OUT/log.txt"

if [ ! -d "$SITE/onnxruntime" ]; then
  [ -d .whl ] || { echo "no .whl/ beside the checkout: bash scripts/serve_wheels.sh runtime, where a registry is"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || exit 1
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > "$WORK/pip.log" 2>&1 || { cat "$WORK/pip.log"; exit 1; }
python3 - <<'PY' 2>&1 | tee -a "$log"
import platform

import onnxruntime as ort
import torch
import transformers

ort.preload_dlls()
print("onnxruntime", ort.__version__, ort.get_available_providers())
print("torch", torch.__version__, torch.cuda.get_device_name(0), "transformers", transformers.__version__, platform.node())
PY
git log -1 --format="mambatrt at %h" 2>/dev/null | tee -a "$log"

checkpoint130() {  # WORK/ck-130m: random mamba-130m weights, with a tokenizer of its 50280 ids (text prompts, AIPerf)
  [ -f "$WORK/ck-130m/tokenizer.json" ] && return
  python3 -c "from mambatrt.testing import write_hf_checkpoint, MAMBA_130M; write_hf_checkpoint('$WORK/ck-130m', **MAMBA_130M)"
  python3 scripts/tokenizer_ids.py models/default/tokenizer.json 50280 "$WORK/tok130"
  cp "$WORK/tok130/tokenizer.json" "$WORK/ck-130m/"
}
build130() {  # build130 PRECISION -> WORK/b130-PRECISION
  checkpoint130
  [ -f "$WORK/b130-$1/manifest.json" ] && return
  { /usr/bin/time -f "bundle 130m $1: %e s, %M KiB peak" mambatrt bundle "$WORK/ck-130m" --out "$WORK/b130-$1" \
      --precision "$1" --max-batch 128 --plans none -q; } 2>&1 | tee -a "$log"
}
bundle130() {  # bundle130 PRECISION: waits for the `bundles` step's build of it, if any, else builds it
  [ -f "$WORK/bundle-$1.pid" ] && { wait "$(cat "$WORK/bundle-$1.pid")" 2>/dev/null; rm -f "$WORK/bundle-$1.pid"; }
  build130 "$1"
}

for step in "$@"; do
  case $step in
    bundles)
      checkpoint130
      for p in ${PRECISIONS:-fp32 fp16}; do build130 "$p" & echo $! > "$WORK/bundle-$p.pid"; done;;
    tests)
      echo "== GPU tests" | tee -a "$log"
      python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -25 | tee -a "$log";;
    bench)
      for p in ${PRECISIONS:-fp32 fp16}; do
        echo "== mambatrt bench, 130m $p, cuda" | tee -a "$log"
        bundle130 "$p"
        mambatrt bench "$WORK/b130-$p" --device cuda --prompt-lengths "${LENGTHS:-5,128,512}" --repeat 5 \
          --new-tokens 16 ${REFERENCE_HF:+--reference hf} --json 2>> "$log" | tee "$OUT/bench_130m_$p.json"
      done;;
    reference)
      echo "== mamba_ssm's fused kernels, the same GPU" | tee -a "$log"
      python3 scripts/mamba_ssm_reference.py --shapes "${REFERENCE_SHAPES:-130m,2.8b}" --json "$OUT/mamba_ssm.json" 2>&1 |
        grep -v -i warn | tee -a "$log";;
    aiperf)
      prec=${AIPERF_PREC:-fp32}
      echo "== AIPerf against mambatrt serve, 130m $prec, cuda, serve's defaults" | tee -a "$log"
      if [ ! -d "$APSITE/aiperf" ]; then
        [ -d .apwhl ] || { echo "no .apwhl/: bash scripts/serve_wheels.sh aiperf" | tee -a "$log"; continue; }
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$APSITE" .apwhl/*.whl
      fi
      printf '#!/bin/sh\nPYTHONPATH=%s:%s exec python3 -m aiperf "$@"\n' "$APSITE" "$SITE" > "$WORK/aiperf"
      chmod +x "$WORK/aiperf"
      bundle130 "$prec"
      rm -rf "$OUT/aiperf-$prec"
      MAMBATRT=mambatrt PYTHON=python3 AIPERF="$WORK/aiperf" BUNDLE="$WORK/b130-$prec" TOKENIZER="$WORK/tok130" \
        OUT_DIR="$OUT/aiperf-$prec" REQUESTS=32 REQ_MULT=8 WARMUP=1 EXTRA_INPUTS="${EXTRA_INPUTS-temperature:0}" \
        SERVE_ARGS="--device cuda --max-batch 128" bash scripts/aiperf_serve.sh "${AIPERF_LEVELS:-1 8 32 64 128}" 2>&1 |
        tee -a "$log";;
    big)
      echo "== mamba-2.8b shapes, fp16" | tee -a "$log"
      [ -f "$WORK/ck-2p8b/config.json" ] || { /usr/bin/time -f "checkpoint 2.8b: %e s, %M KiB peak" python3 -c \
        "from mambatrt.testing import write_hf_checkpoint, MAMBA_2_8B; write_hf_checkpoint('$WORK/ck-2p8b', dtype='float16', **MAMBA_2_8B)"; } 2>&1 |
        tail -2 | tee -a "$log"
      [ -f "$WORK/b2p8-fp16/manifest.json" ] || { /usr/bin/time -f "bundle 2.8b fp16: %e s, %M KiB peak" mambatrt bundle \
        "$WORK/ck-2p8b" --out "$WORK/b2p8-fp16" --precision fp16 --plans none -q; } 2>&1 | tail -2 | tee -a "$log"
      mambatrt bench "$WORK/b2p8-fp16" --device cuda --prompt-lengths "${BIG_LENGTHS:-128,512}" --repeat 3 \
        --new-tokens 8 ${REFERENCE_HF:+--reference hf} --json 2>> "$log" | tee "$OUT/bench_2p8b_fp16.json";;
    *)
      echo "unknown step '$step': bundles, tests, bench, reference, aiperf or big" | tee -a "$log";;
  esac
done
