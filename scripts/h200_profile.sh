#!/usr/bin/env bash
# H200: GPU tests, then profile the mamba-130m-shaped fp32 bundle on the onnxruntime CUDA EP (after h200_session.sh set-up).
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash scripts/h200_session.sh tests
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -c "from mambatrt.testing import write_hf_checkpoint, MAMBA_130M; write_hf_checkpoint('/tmp/ck130', **MAMBA_130M)" 2>/dev/null
mambatrt bundle /tmp/ck130 --out /tmp/b130-fp32 --engines none --quiet
python3 scripts/ort_profile.py /tmp/b130-fp32 1,7,64 2>&1 | tee "$OUT/profile.txt"
mambatrt bench /tmp/b130-fp32 --device cuda --prompt-lengths 5,71,128 --repeat 5 --json > "$OUT/bench_fix.json"
python3 -c "
import json; d=json.load(open('$OUT/bench_fix.json'))
for r in d['results']: print(r['prompt_len'], r['split']['prefill_ms'], r['split']['decode_ms_per_token'], r['token_by_token']['prefill_ms'])"
