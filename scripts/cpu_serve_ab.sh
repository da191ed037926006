#!/usr/bin/env bash
# Serving on a 2-core CPU, session 19's protocol: `mambatrt serve BUNDLE --threads 1` on core 0, `mambatrt
# bench-serve` on core 1 at concurrency 1 and 16 (ISL 128, OSL 64, greedy), a fresh server per row; each row once
# with the kernels graphs' CPU copies (MambaLinear, MAMBATRT_CPU_LINEAR=1) and once without (MLAS's Gemms, =0), in
# turn (MODES, default "1 0"), rounds FIRST..LAST.
#   scripts/cpu_serve_ab.sh BUNDLE VOCAB REQUESTS TAG [LAST] [MODES] [FIRST]   (JSON: benchmarks/TAG_{on,off}N.json)
# REQ_MULT=M: each level C gets max(REQUESTS, M x C) requests, as the H200 protocol's AIPerf runs (max(32, 8C)):
# concurrency 16 over 8 rounds of its clients rather than 2 (session 32: the figure did not move, 123.8 against
# 125.9 tokens/s on the means of five servers). LEVELS (default "1 16"): the concurrencies, each C or C:N (N
# requests whatever REQ_MULT says: the old count beside the new).
# SERVE_ARGS: more serve options. PIN=0: neither pinned, serve with its default threads (one per core) beside
# bench-serve (session 33: the CPU kernels' tasks on both cores).
set -euo pipefail
bundle=$1 vocab=$2 requests=$3 tag=$4 last=${5:-1} modes=${6:-"1 0"} first=${7:-1}
port=${PORT:-8123}
for round in $(seq "$first" "$last"); do
  for mode in $modes; do
    name=$([ "$mode" = 1 ] && echo on || echo off)
    if [ "${PIN:-1}" = 1 ]; then on0=(taskset -c 0) on1=(taskset -c 1) threads=(--threads 1); else on0=() on1=() threads=(); fi
    MAMBATRT_CPU_LINEAR=$mode "${on0[@]}" mambatrt serve "$bundle" "${threads[@]}" --port "$port" \
      --served-model-name m ${SERVE_ARGS:-} > "/tmp/cpu_serve_ab_$name.log" 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null || true' EXIT
    for _ in $(seq 1 240); do
      curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
      kill -0 $server 2>/dev/null || { cat "/tmp/cpu_serve_ab_$name.log"; exit 1; }
      sleep 0.5
    done
    grep "MambaLinear" "/tmp/cpu_serve_ab_$name.log" || echo "(MLAS's Gemms)"
    out="benchmarks/${tag}_${name}${round}.json"
    warmup=4 parts=() seed=0
    for level in ${LEVELS:-1 16}; do  # each level's prompts its own (--seed), so none meets the state cache
      c=${level%%:*} n=$requests
      [ $((c * ${REQ_MULT:-0})) -gt "$n" ] && n=$((c * REQ_MULT))
      [ "$level" != "$c" ] && n=${level#*:}
      part="/tmp/cpu_serve_ab_$name.c$c.n$n.json"
      "${on1[@]}" mambatrt bench-serve --url "http://127.0.0.1:$port" --model m --concurrency "$c" \
        --requests "$n" --vocab "$vocab" --warmup "$warmup" --seed "$seed" --json "$part" > /dev/null
      warmup=0 parts+=("$part") seed=$((seed + 1000))
    done
    python3 -c 'import json, sys
json.dump([r for p in sys.argv[2:] for r in json.load(open(p))], open(sys.argv[1], "w"), indent=1)' "$out" "${parts[@]}"
    python3 -c 'import json, sys
rows = json.load(open(sys.argv[1]))
cells = ["c{} ({} requests) {:.2f} tok/s, ITL p50 {:.2f} ms".format(r["concurrency"], r["requests"],
         r["output_token_throughput"], r["inter_token_latency"]["p50"]) for r in rows]
ratios = ["{:.2f}x".format(r["output_token_throughput"] / rows[0]["output_token_throughput"]) for r in rows[1:]]
print(sys.argv[2], "; ".join(cells), "; against c1:", " ".join(ratios))' "$out" "$name$round"
    kill -TERM $server
    wait $server || true
    trap - EXIT
  done
done
