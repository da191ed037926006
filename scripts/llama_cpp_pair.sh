#!/usr/bin/env bash
# Paired CPU benchmark of mambatrt against llama.cpp on the same Mamba-1 checkpoint: one sequence, prompts of 5, 128
# and 512 tokens, 64 tokens decoded. The two tools run alternately (llama.cpp f32, mambatrt fp32, llama.cpp f16,
# mambatrt fp16, llama.cpp q8_0, mambatrt int8), ROUNDS times, so that a shared CPU's noise falls on both; prints one
# Markdown table with each figure as the min-max over the rounds. Raw outputs: $OUT_DIR/r<round>_*.json.
#
# Usage: bash scripts/llama_cpp_pair.sh LLAMA_BENCH GGUF_DIR [FP32_BUNDLE FP16_BUNDLE INT8_BUNDLE]
#   LLAMA_BENCH  llama.cpp's llama-bench binary
#   GGUF_DIR     a folder with the checkpoint converted by llama.cpp: one *f32.gguf, one *f16.gguf, one *q8_0.gguf
#   bundles      `mambatrt bundle` of the same checkpoint at --precision fp32 / fp16 / int8
#                (default: b130-fp32 b130-fp16 b130-int8 in the checkout)
# Env: ROUNDS (default 2), THREADS (llama-bench -t; default: nproc), OUT_DIR (default: build/llama_cpp_pair; relative
#      to the checkout), MAMBATRT (default: the checkout's .venv/bin/mambatrt), PYTHON (for the table; default: python3)
#
# Figures: llama-bench `-p 5,128,512 -n 64` (its warm-up, then 5 repetitions); prefill ms = the median repetition's
# prompt tokens / (t/s) * 1000, decode ms/token = 1000 / the median tg64 t/s (llama-bench decodes from an empty
# context: a Mamba step costs the same after any prompt). `mambatrt bench --device cpu` (a warm-up, then --repeat 3):
# the split path's prefill median, and decode ms/token as the median over the three prompt lengths' medians.
#
# GGUF files, with llama.cpp's sources (convert_hf_to_gguf.py needs torch, numpy and its gguf-py):
#   cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release
#   cmake --build build --target llama-bench llama-quantize -j
#   PYTHONPATH=gguf-py python convert_hf_to_gguf.py CHECKPOINT --outtype f32 --outfile gguf/ck-f32.gguf  # and f16
#   build/bin/llama-quantize gguf/ck-f32.gguf gguf/ck-q8_0.gguf q8_0
set -euo pipefail
[ $# -eq 2 ] || [ $# -eq 5 ] || { sed -n '2,13p' "$0" | cut -c3-; exit 2; }
LLAMA_BENCH=$(realpath "$1")
GGUF_DIR=$(realpath "$2")
BUNDLES=()
for b in "${3:-}" "${4:-}" "${5:-}"; do [ -n "$b" ] && BUNDLES+=("$(realpath "$b")"); done
cd "$(dirname "$0")/.."  # the checkout: the default bundles and OUT_DIR are relative to it
[ ${#BUNDLES[@]} -eq 3 ] || BUNDLES=(b130-fp32 b130-fp16 b130-int8)
MAMBATRT=${MAMBATRT:-.venv/bin/mambatrt}
PYTHON=${PYTHON:-python3}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-$(nproc)}
OUT_DIR=${OUT_DIR:-build/llama_cpp_pair}
mkdir -p "$OUT_DIR"

gguf() {  # the one file of GGUF_DIR that ends in $1
  local files=()
  mapfile -t files < <(find "$GGUF_DIR" -maxdepth 1 -name "*$1.gguf" ! -name "*b$1.gguf")
  [ ${#files[@]} -eq 1 ] || { echo "need exactly one *$1.gguf in $GGUF_DIR, found ${#files[@]}" >&2; exit 1; }
  echo "${files[0]}"
}
MODELS=("$(gguf f32)" "$(gguf f16)" "$(gguf q8_0)")
QUANTS=(f32 f16 q8_0)
PRECISIONS=(fp32 fp16 int8)

for r in $(seq 1 "$ROUNDS"); do
  for i in 0 1 2; do
    echo "round $r: llama.cpp ${QUANTS[i]}, mambatrt ${PRECISIONS[i]}" >&2
    "$LLAMA_BENCH" -m "${MODELS[i]}" -t "$THREADS" -p 5,128,512 -n 64 -o json \
      > "$OUT_DIR/r${r}_llama_${QUANTS[i]}.json" 2> "$OUT_DIR/r${r}_llama_${QUANTS[i]}.log"
    "$MAMBATRT" bench "${BUNDLES[i]}" --device cpu --prompt-lengths 5,128,512 --new-tokens 64 --repeat 3 --json \
      > "$OUT_DIR/r${r}_mambatrt_${PRECISIONS[i]}.json"
  done
done

"$PYTHON" - "$OUT_DIR" "$ROUNDS" <<'EOF'
import json, statistics, sys

out, rounds = sys.argv[1], int(sys.argv[2])
PROMPTS = (5, 128, 512)


def llama(path):  # {prompt length: prefill ms, "decode": ms/token}
    figures = {}
    for test in json.load(open(path)):
        ts = statistics.median(test["samples_ts"])
        if test["n_gen"] == 0:
            figures[test["n_prompt"]] = test["n_prompt"] / ts * 1000
        elif test["n_prompt"] == 0:
            figures["decode"] = 1000 / ts
    return figures


def mambatrt(path):
    rows = json.load(open(path))["results"]
    figures = {row["prompt_len"]: row["split"]["prefill_ms"]["median"] for row in rows}
    figures["decode"] = statistics.median(row["split"]["decode_ms_per_token"]["median"] for row in rows)
    return figures


def span(values):
    lo, hi = min(values), max(values)
    digits = 1 if hi >= 10 else 2
    return f"{lo:.{digits}f}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else f"{lo:.{digits}f}-{hi:.{digits}f}"


print("| path | prefill 5 ms | prefill 128 ms | prefill 512 ms | decode ms/token |")
print("| --- | ---: | ---: | ---: | ---: |")
for quant, precision in (("f32", "fp32"), ("f16", "fp16"), ("q8_0", "int8")):
    for name, read, stem in (("llama.cpp", llama, f"llama_{quant}"), ("mambatrt", mambatrt, f"mambatrt_{precision}")):
        runs = [read(f"{out}/r{r}_{stem}.json") for r in range(1, rounds + 1)]
        cells = [span([run[key] for run in runs]) for key in (*PROMPTS, "decode")]
        print(f"| {name} {quant if name == 'llama.cpp' else precision} | " + " | ".join(cells) + " |")
EOF
