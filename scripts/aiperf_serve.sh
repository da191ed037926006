#!/usr/bin/env bash
# AIPerf against `mambatrt serve` on this machine (loopback): one server, several concurrencies, streaming,
# synthetic prompts. Results: $OUT_DIR/aiperf_c<N>/ (AIPerf's artifacts) and a table from scripts/aiperf_table.py.
#
# Usage: BUNDLE=... TOKENIZER=... bash scripts/aiperf_serve.sh [CONCURRENCIES, default "1 4 16"]
#   BUNDLE      a bundle (default: build/serve-default, built from models/default with --max-batch 64)
#   TOKENIZER   a folder with tokenizer.json + tokenizer_config.json for AIPerf (default: made from the bundle)
#   AIPERF      the aiperf command (default: aiperf on PATH; `pip install aiperf` in a venv of its own)
#   ISL / OSL   synthetic input / output lengths in tokens (default 128 / 64); REQUESTS per concurrency (default 64),
#               or REQ_MULT x concurrency where that is more; WARMUP=1: a warm-up of concurrency requests (at least 4)
#   MAMBATRT / PYTHON  the mambatrt command and a python with mambatrt (default: the checkout's .venv)
#   REPLICA_GPUS  replicas: one server per entry, CUDA_VISIBLE_DEVICES=entry, ports PORT, PORT+1, ... (e.g. "0 1" on
#               a machine with two GPUs, "0 0" two on one), AIPerf given every --url (--url-strategy round_robin):
#               the figures are the replicas' sum; their logs server_<i>.log, their /metrics metrics_<i>.txt
set -euo pipefail
cd "$(dirname "$0")/.."
MAMBATRT=${MAMBATRT:-.venv/bin/mambatrt}
AIPERF=${AIPERF:-aiperf}
OUT_DIR=${OUT_DIR:-build/aiperf}
BUNDLE=${BUNDLE:-build/serve-default}
ISL=${ISL:-128}; OSL=${OSL:-64}; REQUESTS=${REQUESTS:-64}
PORT=${PORT:-8431}
mkdir -p "$OUT_DIR"
if [ ! -f "$BUNDLE/manifest.json" ]; then
  "$MAMBATRT" bundle models/default --out "$BUNDLE" --max-batch 64 --plans none -q
fi
if [ -z "${TOKENIZER:-}" ]; then
  TOKENIZER=$OUT_DIR/tokenizer
  mkdir -p "$TOKENIZER"
  cp "$BUNDLE/tokenizer.json" "$TOKENIZER/"
  echo '{"tokenizer_class": "PreTrainedTokenizerFast"}' > "$TOKENIZER/tokenizer_config.json"
fi
pids=() urls=()
i=0
for gpu in ${REPLICA_GPUS:-none}; do
  log=$OUT_DIR/server.log
  [ -n "${REPLICA_GPUS:-}" ] && log=$OUT_DIR/server_$i.log
  if [ "$gpu" = none ]; then
    "$MAMBATRT" serve "$BUNDLE" --port $((PORT + i)) ${SERVE_ARGS:-} > "$log" 2>&1 &
  else
    CUDA_VISIBLE_DEVICES=$gpu "$MAMBATRT" serve "$BUNDLE" --port $((PORT + i)) ${SERVE_ARGS:-} > "$log" 2>&1 &
  fi
  pids+=($!) urls+=(--url "http://127.0.0.1:$((PORT + i))")
  i=$((i + 1))
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null || true' EXIT
for ((j = 0; j < i; j++)); do
  for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$((PORT + j))/health" > /dev/null && break; sleep 0.5; done
done
for c in ${1:-1 4 16}; do
  echo "== concurrency $c" >&2
  requests=$REQUESTS
  [ $((c * ${REQ_MULT:-0})) -gt "$requests" ] && requests=$((c * REQ_MULT))
  warmup=()
  [ "${WARMUP:-0}" = 1 ] && warmup=(--warmup-request-count $((c > 4 ? c : 4)))
  "$AIPERF" profile "${urls[@]}" --url-strategy round_robin --endpoint-type completions --streaming "${warmup[@]}" \
    --model "$(basename "$BUNDLE")" --tokenizer "$TOKENIZER" --concurrency "$c" --request-count "$requests" \
    --isl "$ISL" --osl "$OSL" --extra-inputs ignore_eos:true ${EXTRA_INPUTS:+--extra-inputs $EXTRA_INPUTS} --ui none --output-artifact-dir "$OUT_DIR/aiperf_c$c" > "$OUT_DIR/aiperf_c$c.log" 2>&1 \
    || { tail -20 "$OUT_DIR/aiperf_c$c.log" >&2; exit 1; }
done
if [ -n "${REPLICA_GPUS:-}" ]; then
  for ((j = 0; j < i; j++)); do curl -s "http://127.0.0.1:$((PORT + j))/metrics" > "$OUT_DIR/metrics_$j.txt"; done
else
  curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT_DIR/metrics.txt"
fi
${PYTHON:-.venv/bin/python} scripts/aiperf_table.py "$OUT_DIR"/aiperf_c*/
