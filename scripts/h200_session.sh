#!/usr/bin/env bash
# One H200 session (device tool): install the staged onnxruntime-gpu/polygraphy/graphsurgeon wheels, install
# mambatrt, run the GPU tests, then time mamba-130m-shaped bundles through the onnxruntime CUDA EP.
# Usage there: bash scripts/h200_session.sh [tests|bench|profile|kernels|big|scans|flavours|cold|serve|reference|all]...
# (results under $OUT: log.txt, and the JSON files of results/ packed into results.tar at the end)
#   bundles  build the mamba-130m-shaped bundles of PRECISIONS in the background (the steps that need one wait)
#   tests    GPU tests (CUDA EP against CPU and HF, captured decode graphs against plain runs, the serving engine
#            with its slots on the GPU, fused graphs against portable ones); TESTS_K: pytest's -k (those tests only)
#   flavours mamba-130m shapes, fp32 and fp16, portable, fused and kernels graphs (FLAVOURS=...): bench (prefill
#            5/128/512, decode), batched decode 1/8/32/64/128, GPU kernels per decode step and per 64-row prefill chunk
#   cold     one-shot `mambatrt run --device cuda` in a fresh process, both flavours (load, TTFT, wall)
#   serve    mambatrt serve --device cuda (130m fp32, max batch 128) loaded by `mambatrt bench-serve` at
#            concurrency 1, 8, 32, 64, 128 with the first of SERVE_GRAPHS (default: kernels fused portable), the
#            others at 1 and 64
#   servefe  the kernels graphs' server with 1, 2 and 4 HTTP front-end processes (API_SERVERS) at concurrency 1, 8,
#            32, 64, 128 (FE_LEVELS), PRECISIONS' bundles
#   serveoverlap  the kernels graphs' server (2 front ends) with --overlap on and off (OVERLAPS) at OV_LEVELS, traced
#   servelinear  the same server (overlap on) with the kernels graphs' CUDA copies (MambaLinear) and with their Gemms
#            (MAMBATRT_CUDA_LINEAR=0), in the order of LINEAR_ORDER (default "1 0"), at OV_LEVELS, traced
#   servehold  the same server with prompts gathered into fewer prefill rounds, one per
#            RATIO:OVERLAP[:PRECISION[:SMS]] of HOLD (default "0:on 0.25:on 0.5:on 0.25:off"; --waiting-served-ratio
#            RATIO, none for RATIO auto, --overlap OVERLAP --max-waiting-tokens MAX_WAIT, default 20; PRECISION's
#            bundle, default SERVE_PREC or fp32; --prefill-sms SMS, default auto), at OV_LEVELS (REQ_MULT:
#            REQ_MULT x concurrency requests per level), traced
#   aiperf   AIPerf 0.13.0 (its wheels and those of its needs the image lacks, in .apwhl beside the checkout) against
#            `serve --device cuda` of the AIPERF_PREC (default fp32) bundle with a tokenizer of its 50280 ids
#            (scripts/tokenizer_ids.py), scripts/aiperf_serve.sh at AIPERF_LEVELS (default 1 8 32 64 128), AIPERF_MULT
#            (default 8) x concurrency requests per level; EXTRA_INPUTS (e.g. temperature:0) goes to AIPerf, results
#            to results/aiperf-PREC[-AIPERF_TAG]; AIPERF_TRACE=1: the server traced (serve --trace), the trace kept;
#            AIPERF_SERVE_ARGS: more serve options (session 31: "--prefill-sms N"; serve's default is auto since then,
#            "--prefill-sms 0" the whole GPU as before); REPLICA_GPUS (e.g. "0 1"; "0 0" two on one GPU): replicas,
#            one server per entry, AIPerf round robin over their --url (scripts/aiperf_serve.sh; no AIPERF_TRACE)
#   linearbench  scripts/linear_bench.cu (.bin/linear_bench when built beside the checkout): MambaLinear's kernel
#            against cuBLAS at mamba-130m's and the default model's projections, M 1..1024 (BIN_ARGS: the bench's
#            arguments, e.g. tf32 or cluster)
#   wgmmabench  scripts/wgmma_bench.cu (.bin/wgmma_bench when built beside the checkout): 3xTF32 on the warpgroup
#            MMAs against MambaLinear and cuBLAS at the decode step's shapes, M 1..64
#   cutlassbench  scripts/cutlass_bench.cu (.bin/cutlass_bench when built beside the checkout, as its header says):
#            CUTLASS 3xTF32 tile configs against cuBLAS and MambaLinear's own kernel, M 16..2048
#   servecache  concurrency 64 with the state cache and without, alternating ROUNDS (default 2) times, traced (the
#            cache's cost); serveprof and servecache serve SERVE_PREC's bundle (default fp32)
#   serveab  the switch-interval A/B: serve with Python's default 5 ms GIL switch interval at concurrency 1 and 64
#            (serve sets 0.5 ms), and the fp16 bundle's server at 1 and 64
#   serverows  the kernels graphs' server at concurrency 32/64/128 with --prefill-rows 64, 512, 1024 (PREFILL_ROWS)
#   servetrace  one server per concurrency (TRACE_LEVELS, default 64 128), with and without --no-warmup, each
#            with --trace: scripts/trace_summary.py of where its iterations went
#   servec1  concurrency 1 with the state cache (256 MiB) and without, each traced: the TTFT gap between them
#   servenocache  the kernels graphs' server without a state cache at concurrency 1/32/64/128
#   serveprof  one server at concurrency 64 with `serve --profile` (the engine thread's sampled stacks, cProfile of the
#            HTTP loops)
#   replicas one server per GPU of REPLICA_GPUS (default "0 1": a machine with two; "0 0": two on one GPU), loaded
#            round robin by one bench-serve at REPLICA_LEVELS
#   reference  mamba_ssm 2.3.2 (fused CUDA kernels; sources in .anchor, bash ../shared/gpu/fetch-mamba-ssm.sh)
#   bench    mamba-130m shapes, fp32 and fp16: `mambatrt bench --device cuda` (REFERENCE=1 adds HF, same run),
#            plus fp32 with --no-cuda-graph for the decode comparison
#   profile  onnxruntime CUDA profile of the fp32 bundle's graphs (time per op type)
#   kernels  GPU time per kernel of the fp32 bundle's graphs (torch.profiler / CUPTI: what a captured graph replays)
#   prefillb batched prefill through the serving pool (k prompts per launch, PREFILL_KS), fp32 and fp16 kernels
#   kprof    the same for the kernels graphs, fp32 and fp16 (PRECISIONS): decode at batch 1, 8, 64, a 64-row chunk
#            (KPROF: other shapes; ORDER=n: the first n kernels of a run in launch order), with MambaLinear and with
#            the Gemms (LINEAR_ORDER)
#   gemmbench  scripts/gemm_bench.cu: the fp32 GEMMs of a decode step and a prefill chunk, cublasSgemm (as onnxruntime
#            calls it) against cuBLASLt's algorithms with split-K
#   headbench  scripts/head_bench.py: the LM head as one Gemm (transB) against w @ h^T, CUDA EP, batch 1..128
#   skinnybench  scripts/skinny_gemm_bench.cu: the decode step's fp32 GEMMs at batch 1..128, cuBLAS against an FFMA
#            kernel of mambatrt's own (registers only, and staged in shared memory; split-K in and across blocks)
#   scanbench  scripts/scan_step_bench.cu: the CUDA scan kernels alone, the step in several lane mappings and the
#            chunk kernel against a parallel scan over the rows, timed and compared
#   big      mamba-2.8b shapes, fp16: bundle (no plans) and bench
#   scans    mamba-130m shapes, fp32: the default (blocked), blocked-log and the CPU-oriented blocked-pieces prefill
# Everything is logged to $OUT/log.txt; a failed step does not stop the next one.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/results" /tmp/stage
log="$OUT/log.txt"
R="$OUT/results"
pack() {  # appends to an earlier invocation's results.tar (several invocations in one device call)
  (cd "$OUT" && { if [ -f results.tar ]; then tar rf results.tar results; else tar cf results.tar results; fi; } && rm -rf results)
}
trap pack EXIT
if [ ! -d /tmp/site/onnxruntime ]; then
  cat /tmp/stage/ort.part.* > /tmp/stage/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl && rm /tmp/stage/ort.part.*
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/stage/*.whl || exit 1
fi
if [ -d .whl ] && [ ! -d /tmp/site/fastapi ]; then  # the server's libraries (fastapi, uvicorn, pydantic, ...)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
python3 - <<'PY' 2>&1 | tee -a "$log"
import onnxruntime as ort, torch, transformers, platform
ort.preload_dlls()
print("onnxruntime", ort.__version__, ort.get_available_providers())
print("torch", torch.__version__, torch.cuda.get_device_name(0), "transformers", transformers.__version__, platform.node())
PY
prompt128=$(python3 -c 'print(",".join(str(i * 37 % 50000) for i in range(128)))')

wait_up() {  # wait_up PID PORT: until the server answers /health, at most 120 s; at once when PID has exited
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$2/health" > /dev/null && return 0
    [ -n "$1" ] && ! kill -0 "$1" 2>/dev/null && { echo "server $1 exited before it answered" | tee -a "$log"; return 1; }
    sleep 0.5
  done
  return 1
}

bundle130() {  # bundle130 PRECISION -> /tmp/b130-PRECISION (waits for the `bundles` step's build of it, if any)
  [ -f /tmp/bundle-$1.pid ] && { wait "$(cat /tmp/bundle-$1.pid)" 2>/dev/null; rm -f /tmp/bundle-$1.pid; }
  build130 "$1"
}
build130() {  # build130 PRECISION[t]: a trailing t, the checkpoint with a tokenizer of its 50280 ids (text prompts, AIPerf)
  [ -d /tmp/ck130 ] || python3 -c "from mambatrt.testing import write_hf_checkpoint, MAMBA_130M; write_hf_checkpoint('/tmp/ck130', **MAMBA_130M)" 2>/dev/null
  local ck=/tmp/ck130
  if [ "${1%t}" != "$1" ]; then
    ck=/tmp/ck130t
    [ -d $ck ] || { mkdir -p $ck && ln -s /tmp/ck130/* $ck/ && python3 scripts/tokenizer_ids.py models/default/tokenizer.json 50280 /tmp/tok130 && cp /tmp/tok130/tokenizer.json $ck/; }
  fi
  [ -d /tmp/b130-$1 ] || { /usr/bin/time -f "bundle 130m $1: %e s, %M KiB" mambatrt bundle $ck --out /tmp/b130-$1 --precision ${1%t} --engines none --max-batch 128 --quiet; } 2>&1 | tee -a "$log"
}

cutlass_include() { python3 -c 'import mambatrt.compile.kernels as k; print(k.cutlass_include())'; }

bench_bin() {  # bench_bin NAME NVCC_FLAGS...: scripts/NAME.cu built into .bin/NAME with NVCC_FLAGS (unless it was built
  # beside the checkout), then run with cuBLAS's library found for it
  local name=$1
  shift
  mkdir -p .bin
  [ -x ".bin/$name" ] || nvcc -O3 -std=c++17 "$@" -o ".bin/$name" "scripts/$name.cu" -ldl 2>&1 |
    grep -v -i warn | tail -3
  CUBLAS_LIB=$(find /usr/local /usr /tmp/site -name 'libcublas.so*' 2>/dev/null | grep -v -i lt | head -1) \
    timeout 300 ".bin/$name" ${BIN_ARGS:-} 2>&1 | tee -a "$log"
}

serve_traced() {  # serve_traced TAG ARGS...: the 130m bundle's server (SERVE_PREC, default fp32; kernels graphs, 2 front ends, ARGS),
  # loaded by bench-serve at OV_LEVELS (BENCH_ARGS: more of its options, e.g. --temperature 1), traced:
  # $R/serve_TAG.{json,log}, $R/trace_TAG.jsonl (the caller's environment reaches the server: `VAR=value serve_traced ...`)
  local tag=$1
  shift
  local prec=${SERVE_PREC:-fp32}
  mambatrt serve /tmp/b130-$prec --device cuda --graphs kernels --port 8000 --max-batch 128 --no-verify \
    --api-server-count 2 --trace "$R/trace_$tag.jsonl" "$@" > "$R/serve_$tag.log" 2>&1 &
  local server=$!
  wait_up $server 8000
  if [ -z "${REQ_MULT:-}" ]; then
    timeout 300 mambatrt bench-serve --url http://127.0.0.1:8000 --model b130-$prec --concurrency ${OV_LEVELS:-1 8 32 64 128} \
      --vocab 50000 --warmup 16 ${BENCH_ARGS:-} --json "$R/serve_$tag.json" 2>&1 | tee -a "$log"
  else  # REQ_MULT x concurrency requests per level (at least 16), one bench-serve per level
    local c
    for c in ${OV_LEVELS:-1 8 32 64 128}; do
      timeout 300 mambatrt bench-serve --url http://127.0.0.1:8000 --model b130-$prec --concurrency $c \
        --requests $((c * REQ_MULT > 16 ? c * REQ_MULT : 16)) --vocab 50000 --warmup 16 ${BENCH_ARGS:-} \
        --json "$R/serve_${tag}_c$c.json" 2>&1 | tee -a "$log"
    done
  fi
  kill -TERM $server; wait $server; echo "server exit $?" | tee -a "$log"
  tail -4 "$R/serve_$tag.log" | tee -a "$log"
  python3 scripts/trace_summary.py "$R/trace_$tag.jsonl" 0 2>&1 | head -9 | tee -a "$log"
}

for what in "${@:-all}"; do
  if [ "$what" = bundles ]; then  # PRECISIONS' bundles built in the background (CPU) while the next steps run
    [ -d /tmp/ck130 ] || python3 -c "from mambatrt.testing import write_hf_checkpoint, MAMBA_130M; write_hf_checkpoint('/tmp/ck130', **MAMBA_130M)" 2>/dev/null
    for p in ${PRECISIONS:-fp32 fp16}; do build130 $p & echo $! > /tmp/bundle-$p.pid; done
  fi
  if [ "$what" = tests ] || [ "$what" = all ]; then
    echo "== tests" | tee -a "$log"
    timeout 400 python3 -m pytest -q -m gpu tests/runtime/test_cuda.py tests/export/test_scan_rows.py -p no:cacheprovider \
      ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tail -25 | tee -a "$log"
  fi
  if [ "$what" = bench ] || [ "$what" = all ]; then
    for p in ${PRECISIONS:-fp32 fp16}; do
      echo "== bench 130m $p" | tee -a "$log"
      bundle130 $p
      mambatrt run /tmp/b130-$p --prompt-ids "$prompt128" --max-new-tokens 32 --device cuda --json 2>&1 | tee -a "$log"
      timeout 400 mambatrt bench /tmp/b130-$p --device cuda --prompt-lengths ${LENGTHS:-5,71,84,128,512} --repeat 5 \
        --new-tokens 16 ${REFERENCE:+--reference hf} --json > "$OUT/bench_130m_$p.json" 2>> "$log"
      python3 scripts/bench_table.py "$OUT/bench_130m_$p.json" 2>&1 | tee -a "$log"
    done
    echo "== bench 130m fp32, --no-cuda-graph" | tee -a "$log"
    timeout 200 mambatrt bench /tmp/b130-fp32 --device cuda --prompt-lengths 128 --repeat 5 --new-tokens 16 --no-cuda-graph \
      --json > "$OUT/bench_130m_fp32_nograph.json" 2>> "$log"
    python3 scripts/bench_table.py "$OUT/bench_130m_fp32_nograph.json" 2>&1 | tee -a "$log"
  fi
  if [ "$what" = profile ] || [ "$what" = all ]; then
    echo "== profile 130m fp32" | tee -a "$log"
    bundle130 fp32
    timeout 300 python3 scripts/ort_profile.py /tmp/b130-fp32 1,8,64 2>&1 | grep -v "Fallback mode" | tee -a "$log"
  fi
  if [ "$what" = kernels ] || [ "$what" = all ]; then
    echo "== GPU kernels 130m fp32" | tee -a "$log"
    bundle130 fp32
    timeout 300 python3 scripts/gpu_kernels.py /tmp/b130-fp32 1,8,64 2>&1 | grep -v -i warn | tee -a "$log"
  fi
  if [ "$what" = prefillb ]; then  # batched prefill through the serving pool: k prompts' 64-row chunks per launch
    for p in ${PRECISIONS:-fp32 fp16}; do
      bundle130 $p
      echo "== batched prefill 130m $p, kernels graphs" | tee -a "$log"
      timeout 200 python3 scripts/gpu_batch_prefill.py /tmp/b130-$p ${PREFILL_KS:-1,2,4,8,16} kernels cuda 2>&1 | tee -a "$log"
    done
  fi
  if [ "$what" = kprof ]; then
    for p in ${PRECISIONS:-fp32 fp16}; do
      bundle130 $p
      for lin in ${LINEAR_ORDER:-1 0}; do
        echo "== GPU kernels 130m $p, kernels graphs, MAMBATRT_CUDA_LINEAR=$lin" | tee -a "$log"
        MAMBATRT_CUDA_LINEAR=$lin GRAPHS=kernels timeout 200 python3 scripts/gpu_kernels.py /tmp/b130-$p ${KPROF:-1,1x8,1x64,64} 2>&1 | grep -v -i warn | tee -a "$log"
      done
    done
  fi
  if [ "$what" = scanbench ]; then  # the CUDA scan kernels alone (scripts/scan_step_bench.cu)
    echo "== scan step kernels (scripts/scan_step_bench.cu)" | tee -a "$log"
    nvcc -O3 -std=c++17 -arch=sm_90 -o /tmp/scan_step_bench scripts/scan_step_bench.cu 2>&1 | tail -5 | tee -a "$log"
    timeout 120 /tmp/scan_step_bench 2>&1 | tee -a "$log"
  fi
  if [ "$what" = gemmbench ]; then  # cuBLAS's fp32 GEMMs as onnxruntime calls them against tuned cuBLASLt algorithms
    echo "== fp32 GEMMs of the 130m shapes (scripts/gemm_bench.cu)" | tee -a "$log"
    roots="/usr /opt /root /tmp/site"  # the CUDA toolkit, and the nvidia-cublas wheel torch and onnxruntime use
    inc=$(dirname "$(find $roots -name cublasLt.h 2>/dev/null | head -1)")
    real=$(dirname "$(find $roots -name 'libcublasLt.so*' 2>/dev/null | head -1)")
    lib=$real
    echo "cuBLAS headers $inc, libraries $real" | tee -a "$log"
    if [ ! -e "$lib/libcublasLt.so" ]; then  # a wheel ships libcublasLt.so.N only: links for the linker
      lib=/tmp/cublas-links && mkdir -p $lib
      for l in "$real"/libcublas*.so.*; do ln -sf "$l" "$lib/$(basename "$l" | sed 's/\.so\..*/.so/')"; done
    fi
    nvcc -O3 -std=c++17 -arch=sm_90 -I "$inc" -o /tmp/gemm_bench scripts/gemm_bench.cu -L "$lib" -lcublasLt -lcublas \
      -Xlinker -rpath -Xlinker "$real" 2>&1 | tail -5 | tee -a "$log"
    timeout 200 /tmp/gemm_bench 2>&1 | tee -a "$log"
  fi
  if [ "$what" = headbench ]; then  # the LM head's two ONNX forms (Gemm transB, w @ h^T) at the decode batch sizes
    echo "== LM head forms, CUDA EP (scripts/head_bench.py)" | tee -a "$log"
    timeout 200 python3 scripts/head_bench.py cuda 2>&1 | tee -a "$log"
  fi
  if [ "$what" = skinnybench ]; then  # a GEMM kernel of mambatrt's own against cuBLAS at the decode batch sizes
    echo "== fp32 decode GEMMs, cuBLAS against an own kernel (scripts/skinny_gemm_bench.cu)" | tee -a "$log"
    roots="/usr /opt /root /tmp/site"
    inc=$(dirname "$(find $roots -name cublas_v2.h 2>/dev/null | head -1)")
    real=$(dirname "$(find $roots -name 'libcublas.so*' 2>/dev/null | head -1)")
    lib=$real
    if [ ! -e "$lib/libcublas.so" ]; then
      lib=/tmp/cublas-links && mkdir -p $lib
      for l in "$real"/libcublas*.so.*; do ln -sf "$l" "$lib/$(basename "$l" | sed 's/\.so\..*/.so/')"; done
    fi
    nvcc -O3 -std=c++17 -arch=sm_90 -I "$inc" -o /tmp/skinny scripts/skinny_gemm_bench.cu -L "$lib" -lcublas \
      -Xlinker -rpath -Xlinker "$real" 2>&1 | grep -v -i warn | tail -5 | tee -a "$log"
    timeout 300 /tmp/skinny 2>&1 | tee -a "$log"
  fi
  if [ "$what" = scans ]; then
    echo "== scans 130m fp32: blocked, blocked-log, blocked-pieces" | tee -a "$log"
    bundle130 fp32
    for s in pieces log; do
      [ -d /tmp/b130-$s ] || { /usr/bin/time -f "bundle 130m fp32 blocked-$s: %e s" mambatrt bundle /tmp/ck130 --out /tmp/b130-$s --scan blocked-$s --engines none --quiet; } 2>&1 | tee -a "$log"
    done
    for b in b130-fp32 b130-log b130-pieces; do
      timeout 200 mambatrt bench /tmp/$b --device cuda --prompt-lengths ${LENGTHS:-5,71,128} --repeat 5 --new-tokens 16 \
        --json > "$OUT/bench_130m_scan_$b.json" 2>> "$log"
      python3 scripts/bench_table.py "$OUT/bench_130m_scan_$b.json" 2>&1 | tee -a "$log"
    done
  fi
  if [ "$what" = flavours ] || [ "$what" = all ]; then
    for p in ${PRECISIONS:-fp32 fp16}; do
      bundle130 $p
      for g in ${FLAVOURS:-portable fused kernels}; do
        echo "== bench 130m $p, $g graphs" | tee -a "$log"
        timeout 300 mambatrt bench /tmp/b130-$p --device cuda --graphs $g --prompt-lengths ${LENGTHS:-5,128,512} --repeat 5 \
          --new-tokens 32 --json > "$R/bench_130m_${p}_$g.json" 2>> "$log"
        python3 scripts/bench_table.py "$R/bench_130m_${p}_$g.json" 2>&1 | tee -a "$log"
        timeout 200 python3 scripts/gpu_batch_decode.py /tmp/b130-$p ${BATCHES:-1,8,32,64,128} $g 2>&1 | tee -a "$log"
      done
    done
    [ "${KERNELS:-1}" = 1 ] && for g in ${FLAVOURS:-portable fused kernels}; do
      echo "== GPU kernels 130m fp32, $g graphs" | tee -a "$log"
      GRAPHS=$g timeout 200 python3 scripts/gpu_kernels.py /tmp/b130-fp32 1,64 2>&1 | grep -v -i warn | tee -a "$log"
    done
  fi
  if [ "$what" = cold ] || [ "$what" = all ]; then
    bundle130 fp32
    for g in ${FLAVOURS:-portable fused kernels} ${FLAVOURS:-portable fused kernels}; do
      echo "== cold run, one process: 130m fp32, $g graphs, 128-token prompt" | tee -a "$log"
      /usr/bin/time -f "wall %e s" mambatrt run /tmp/b130-fp32 --prompt-ids "$prompt128" --max-new-tokens 32 --device cuda \
        --graphs $g --no-verify --json 2>&1 | tee -a "$log"
    done
    timeout 100 python3 scripts/cold_probe.py /tmp/b130-fp32 2>&1 | tee -a "$log"
  fi
  if [ "$what" = serve ] || [ "$what" = all ]; then
    bundle130 fp32
    first=""
    for g in ${SERVE_GRAPHS:-kernels fused portable}; do
      echo "== serve 130m fp32 on cuda, $g graphs" | tee -a "$log"
      mambatrt serve /tmp/b130-fp32 --device cuda --graphs $g --port 8000 --max-batch 128 --no-verify > "$R/serve_$g.log" 2>&1 &
      server=$!
      wait_up $server 8000
      levels="1 8 32 64 128"; [ -n "$first" ] && levels="1 64"; first=$g
      timeout 300 mambatrt bench-serve --url http://127.0.0.1:8000 --model b130-fp32 --concurrency $levels --vocab 50000 \
        --warmup 16 --json "$R/serve_$g.json" 2>&1 | tee -a "$log"
      curl -s http://127.0.0.1:8000/metrics | grep -E "^mambatrt_(requests|generation|prompt|cached)" | tee -a "$log"
      kill -TERM $server; wait $server; echo "server exit $?" | tee -a "$log"
      tail -3 "$R/serve_$g.log" | tee -a "$log"
    done
  fi
  if [ "$what" = servefe ]; then  # HTTP front-end processes (API_SERVERS, default 1 2 4) at concurrency 1..128
    for p in ${PRECISIONS:-fp32}; do
      bundle130 $p
      for n in ${API_SERVERS:-1 2 4}; do
        echo "== serve 130m $p on cuda, kernels graphs, --api-server-count $n" | tee -a "$log"
        mambatrt serve /tmp/b130-$p --device cuda --graphs kernels --port 8000 --max-batch 128 --no-verify \
          --api-server-count $n > "$R/servefe_${p}_$n.log" 2>&1 &
        server=$!
        wait_up $server 8000
        timeout 300 mambatrt bench-serve --url http://127.0.0.1:8000 --model b130-$p --concurrency ${FE_LEVELS:-1 8 32 64 128} \
          --vocab 50000 --warmup 16 --json "$R/servefe_${p}_$n.json" 2>&1 | tee -a "$log"
        curl -s http://127.0.0.1:8000/metrics | grep -E "^mambatrt_(requests|engine|prefill)" | tee -a "$log"
        kill -TERM $server; wait $server; echo "server exit $?" | tee -a "$log"
        tail -3 "$R/servefe_${p}_$n.log" | tee -a "$log"
      done
    done
  fi
  if [ "$what" = serveoverlap ]; then  # prefill beside decode (--overlap on) against before it (off), traced
    bundle130 fp32
    i=0
    for ov in ${OVERLAPS:-on off}; do
      i=$((i + 1))
      echo "== serve 130m fp32 on cuda, kernels graphs, --overlap $ov, 2 front ends" | tee -a "$log"
      serve_traced overlap_${ov}_$i --overlap $ov
    done
  fi
  if [ "$what" = servelinear ]; then  # MambaLinear (the kernels decode graph's CUDA copy) against cuBLAS's Gemms
    bundle130 fp32
    round=0
    for lin in ${LINEAR_ORDER:-1 0}; do
      round=$((round + 1))
      echo "== serve 130m fp32 on cuda, kernels graphs, overlap on, 2 front ends, MAMBATRT_CUDA_LINEAR=$lin (round $round)" | tee -a "$log"
      MAMBATRT_CUDA_LINEAR=$lin serve_traced "linear${lin}_r$round" --overlap on
    done
  fi
  if [ "$what" = servehold ]; then  # prompts gathered into fewer prefill rounds (--waiting-served-ratio R)
    round=0
    for v in ${HOLD:-0:on 0.25:on 0.5:on 0.25:off}; do
      round=$((round + 1))
      IFS=: read -r ratio ov prec sms <<< "$v"
      prec=${prec:-${SERVE_PREC:-fp32}}
      sms=${sms:-auto}
      bundle130 "$prec"
      echo "== serve 130m $prec on cuda, kernels graphs, --waiting-served-ratio $ratio --overlap $ov --prefill-sms $sms (round $round)" | tee -a "$log"
      args=(--overlap "$ov" --max-waiting-tokens "${MAX_WAIT:-20}")
      [ "$ratio" = auto ] || args+=(--waiting-served-ratio "$ratio")
      args+=(--prefill-sms "$sms")
      SERVE_PREC=$prec serve_traced "hold${ratio}_${ov}_${prec}_sms${sms}_r$round" "${args[@]}"
    done
  fi
  if [ "$what" = aiperf ]; then  # AIPerf against the server of AIPERF_PREC's bundle with a tokenizer
    [ -d /tmp/apsite/aiperf ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/apsite .apwhl/*.whl
    printf '#!/bin/sh\nPYTHONPATH=/tmp/apsite:/tmp/site exec python3 -m aiperf "$@"\n' > /tmp/aiperf && chmod +x /tmp/aiperf
    prec=${AIPERF_PREC:-fp32}
    adir=/tmp/aiperf-$prec-$$-$SECONDS  # a folder per run: an earlier run's levels stay out of this run's table
    traced=""
    [ "${AIPERF_TRACE:-0}" = 1 ] && [ -z "${REPLICA_GPUS:-}" ] && traced="--trace $adir/trace.jsonl"
    bundle130 "${prec}t"
    echo "== AIPerf against serve 130m $prec on cuda (kernels graphs, serve's defaults), ${AIPERF_LEVELS:-1 8 32 64 128}" | tee -a "$log"
    MAMBATRT=mambatrt PYTHON=python3 AIPERF=/tmp/aiperf BUNDLE=/tmp/b130-${prec}t TOKENIZER=/tmp/tok130 \
      OUT_DIR=$adir REQ_MULT=${AIPERF_MULT:-8} REQUESTS=32 WARMUP=1 \
      SERVE_ARGS="--device cuda --graphs kernels --max-batch 128 --no-verify $traced ${AIPERF_SERVE_ARGS:-}" \
      timeout 560 bash scripts/aiperf_serve.sh "${AIPERF_LEVELS:-1 8 32 64 128}" 2>&1 | tee -a "$log"
    rdir="$R/aiperf-$prec${AIPERF_TAG:+-$AIPERF_TAG}"
    mkdir -p "$rdir"
    for f in "$adir"/aiperf_c*/profile_export_aiperf.json; do
      [ -f "$f" ] && cp "$f" "$rdir/$(basename "$(dirname "$f")").json"
    done
    cp "$adir"/server*.log "$adir"/metrics*.txt "$rdir/" 2>/dev/null
    [ -f "$adir/trace.jsonl" ] && gzip -c "$adir/trace.jsonl" > "$rdir/trace.jsonl.gz"
    grep -E "^mambatrt_(pool_sampled_tokens|prefill_launches|engine_iterations)" "$adir"/metrics*.txt 2>/dev/null | tee -a "$log"
  fi
  if [ "$what" = linearbench ]; then
    echo "== MambaLinear's kernel against cuBLAS (scripts/linear_bench.cu)" | tee -a "$log"
    bench_bin linear_bench -arch=sm_90
  fi
  if [ "$what" = wgmmabench ]; then
    echo "== 3xTF32 on the warpgroup MMAs (scripts/wgmma_bench.cu)" | tee -a "$log"
    bench_bin wgmma_bench --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -DMAMBATRT_WITH_CUTLASS \
      -I "$(cutlass_include)"
  fi
  if [ "$what" = cutlassbench ]; then
    echo "== CUTLASS 3xTF32 against cuBLAS and MambaLinear's own kernel (scripts/cutlass_bench.cu)" | tee -a "$log"
    bench_bin cutlass_bench --expt-relaxed-constexpr -arch=sm_90 -DMAMBATRT_WITH_CUTLASS -I "$(cutlass_include)"
  fi
  if [ "$what" = servecache ]; then  # the state cache's cost at concurrency 64: with / without, alternating, traced
    p=${SERVE_PREC:-fp32}
    bundle130 $p
    for round in $(seq 1 "${ROUNDS:-2}"); do
      for mib in 256 0; do
        echo "== serve 130m $p on cuda, kernels graphs, --state-cache-mib $mib, concurrency 64, round $round" | tee -a "$log"
        mambatrt serve /tmp/b130-$p --device cuda --graphs kernels --port 8000 --max-batch 128 --no-verify \
          --state-cache-mib $mib --trace "$R/trace_cache${mib}_r$round.jsonl" > "$R/servecache_${mib}_r$round.log" 2>&1 &
        server=$!
        wait_up $server 8000
        timeout 100 mambatrt bench-serve --url http://127.0.0.1:8000 --model b130-$p --concurrency 64 \
          --vocab 50000 --warmup 16 --json "$R/servecache_${mib}_r$round.json" 2>&1 | tail -1 | tee -a "$log"
        kill -TERM $server; wait $server
        python3 scripts/trace_summary.py "$R/trace_cache${mib}_r$round.jsonl" 0 2>&1 | head -6 | tee -a "$log"
      done
    done
  fi
  if [ "$what" = serveab ]; then  # one variable at a time against the `serve` step's first server
    bundle130 fp32
    bundle130 fp16
    for variant in gil5ms fp16; do
      p=fp32; pre="import mambatrt.runtime.cli as c; c.SERVE_SWITCH_INTERVAL_S = 0.005"
      [ $variant = fp16 ] && { p=fp16; pre="pass"; }
      echo "== serve 130m $p on cuda, auto graphs, $variant" | tee -a "$log"
      python3 -c "$pre
import sys
from mambatrt.cli import main
sys.exit(main(sys.argv[1:]))" serve /tmp/b130-$p --device cuda --port 8000 --max-batch 128 --no-verify \
        > "$R/serve_$variant.log" 2>&1 &
      server=$!
      wait_up $server 8000
      timeout 200 mambatrt bench-serve --url http://127.0.0.1:8000 --model b130-$p --concurrency 1 64 --vocab 50000 \
        --warmup 16 --json "$R/serve_$variant.json" 2>&1 | tee -a "$log"
      kill -TERM $server; wait $server
    done
  fi
  if [ "$what" = serverows ]; then  # the prefill budget per engine iteration against throughput and ITL at c64
    bundle130 fp32
    for rows in ${PREFILL_ROWS:-64 512 1024}; do
      echo "== serve 130m fp32 on cuda, auto graphs, --prefill-rows $rows" | tee -a "$log"
      mambatrt serve /tmp/b130-fp32 --device cuda --port 8000 --max-batch 128 --no-verify --prefill-rows $rows \
        > "$R/serve_rows$rows.log" 2>&1 &
      server=$!
      wait_up $server 8000
      timeout 200 mambatrt bench-serve --url http://127.0.0.1:8000 --model b130-fp32 --concurrency 32 64 128 \
        --vocab 50000 --warmup 16 --json "$R/serve_rows$rows.json" 2>&1 | tee -a "$log"
      kill -TERM $server; wait $server
    done
  fi
  if [ "$what" = servetrace ]; then  # one server per level, warm (captures at start) and not: --trace summaries
    bundle130 fp32
    for warm in "" --no-warmup; do
      for c in ${TRACE_LEVELS:-64 128}; do
        echo "== serve 130m fp32 on cuda, auto graphs, ${warm:-warm}, concurrency $c, --trace" | tee -a "$log"
        mambatrt serve /tmp/b130-fp32 --device cuda --port 8000 --max-batch 128 --no-verify $warm \
          --trace "$R/trace${warm}_c$c.jsonl" > "$R/servetrace${warm}_c$c.log" 2>&1 &
        server=$!
        wait_up $server 8000
        timeout 200 mambatrt bench-serve --url http://127.0.0.1:8000 --model b130-fp32 --concurrency $c \
          --vocab 50000 --warmup 16 --json "$R/servetrace${warm}_c$c.json" 2>&1 | tee -a "$log"
        kill -TERM $server; wait $server
        cat "$R/servetrace${warm}_c$c.log" | tee -a "$log"
        python3 scripts/trace_summary.py "$R/trace${warm}_c$c.jsonl" 2>&1 | tee -a "$log"
      done
    done
  fi
  if [ "$what" = servec1 ]; then  # concurrency 1 with and without the state cache, traced (where the TTFT gap is)
    bundle130 fp32
    for mib in 256 0; do
      echo "== serve 130m fp32 on cuda, auto graphs, --state-cache-mib $mib, concurrency 1, --trace" | tee -a "$log"
      mambatrt serve /tmp/b130-fp32 --device cuda --port 8000 --max-batch 128 --no-verify --state-cache-mib $mib \
        --trace "$R/trace_c1_cache$mib.jsonl" > "$R/servec1_cache$mib.log" 2>&1 &
      server=$!
      wait_up $server 8000
      timeout 100 mambatrt bench-serve --url http://127.0.0.1:8000 --model b130-fp32 --concurrency 1 --requests 32 \
        --vocab 50000 --warmup 8 --json "$R/servec1_cache$mib.json" 2>&1 | tee -a "$log"
      kill -TERM $server; wait $server
      python3 scripts/trace_summary.py "$R/trace_c1_cache$mib.jsonl" 4 2>&1 | tee -a "$log"
      python3 -c "import json,sys; [print(l.strip()) for l in open(sys.argv[1]).readlines()[-70:-60]]" \
        "$R/trace_c1_cache$mib.jsonl" 2>&1 | tee -a "$log"
    done
  fi
  if [ "$what" = servenocache ]; then  # the state cache's device-to-host copies (random prompts never hit it)
    bundle130 fp32
    echo "== serve 130m fp32 on cuda, auto graphs, --state-cache-mib 0" | tee -a "$log"
    mambatrt serve /tmp/b130-fp32 --device cuda --port 8000 --max-batch 128 --no-verify --state-cache-mib 0 \
      > "$R/serve_nocache.log" 2>&1 &
    server=$!
    wait_up $server 8000
    timeout 200 mambatrt bench-serve --url http://127.0.0.1:8000 --model b130-fp32 --concurrency 1 32 64 128 \
      --vocab 50000 --warmup 16 --json "$R/serve_nocache.json" 2>&1 | tee -a "$log"
    kill -TERM $server; wait $server
  fi
  if [ "$what" = serveprof ]; then  # where one server's CPU time goes at concurrency 64 (cProfile, both threads)
    p=${SERVE_PREC:-fp32}
    bundle130 $p
    echo "== serve 130m $p on cuda, auto graphs, --profile, concurrency 64" | tee -a "$log"
    mambatrt serve /tmp/b130-$p --device cuda --port 8000 --max-batch 128 --no-verify --profile "$R/prof" \
      > "$R/serveprof.log" 2>&1 &
    server=$!
    wait_up $server 8000
    timeout 200 mambatrt bench-serve --url http://127.0.0.1:8000 --model b130-$p --concurrency 64 --requests 512 \
      --vocab 50000 --warmup 16 2>&1 | tee -a "$log"
    kill -TERM $server; wait $server
    for f in engine http; do
      python3 -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(14)" "$R/prof/$f.prof" \
        2>&1 | tail -24 | tee -a "$log"
    done
    # the engine thread alone, sampled (engine.prof mixes every thread of the process on Python 3.12: session 25)
    head -70 "$R/prof/engine-samples.txt" 2>&1 | tee -a "$log"
  fi
  if [ "$what" = replicas ]; then  # one server per GPU of REPLICA_GPUS (default "0 1"; "0 0": two on one GPU), the
    # load client round robin over them
    bundle130 fp32
    gpus=${REPLICA_GPUS:-0 1}
    echo "== replicas on GPUs $gpus, 130m fp32, kernels graphs (serve's defaults)" | tee -a "$log"
    pids="" urls="" i=0
    for gpu in $gpus; do
      CUDA_VISIBLE_DEVICES=$gpu mambatrt serve /tmp/b130-fp32 --device cuda --port $((8000 + i)) --max-batch 128 \
        --no-verify > "$R/replica_$i.log" 2>&1 &
      pids="$pids $!" urls="$urls --url http://127.0.0.1:$((8000 + i))" i=$((i + 1))
    done
    for port in $(seq 8000 $((8000 + i - 1))); do
      wait_up "" $port
    done
    timeout 300 mambatrt bench-serve $urls --model b130-fp32 --concurrency ${REPLICA_LEVELS:-2 16 64 128} \
      --vocab 50000 --warmup 16 --json "$R/replicas.json" 2>&1 | tee -a "$log"
    kill -TERM $pids; wait $pids; echo "replicas exit $?" | tee -a "$log"
  fi
  if [ "$what" = reference ] || [ "$what" = all ]; then
    echo "== mamba_ssm reference (fused CUDA kernels), same GPU" | tee -a "$log"
    timeout 500 python3 .anchor/mamba_ssm_reference.py --json "$R/mamba_ssm.json" 2>&1 | grep -v -i warn | tail -12 | tee -a "$log"
  fi
  if [ "$what" = big ]; then
    echo "== mamba-2.8b shapes, fp16" | tee -a "$log"
    [ -d /tmp/ck2p8 ] || { /usr/bin/time -f "checkpoint 2.8b: %e s, %M KiB" python3 -c "from mambatrt.testing import write_hf_checkpoint, MAMBA_2_8B; write_hf_checkpoint('/tmp/ck2p8', dtype='float16', **MAMBA_2_8B)"; } 2>&1 | tail -3 | tee -a "$log"
    [ -d /tmp/b2p8 ] || { /usr/bin/time -f "bundle 2.8b fp16: %e s, %M KiB" mambatrt bundle /tmp/ck2p8 --out /tmp/b2p8 --precision fp16 --engines none --quiet; } 2>&1 | tail -3 | tee -a "$log"
    timeout 300 mambatrt bench /tmp/b2p8 --device cuda --prompt-lengths ${BIG_LENGTHS:-128,512} --repeat 3 --new-tokens 8 \
      --no-verify ${REFERENCE:+--reference hf} --json > "$OUT/bench_2p8b_fp16.json" 2>> "$log"
    python3 scripts/bench_table.py "$OUT/bench_2p8b_fp16.json" 2>&1 | tee -a "$log"
  fi
done
