#!/usr/bin/env bash
# `harness --backend engine` against `serve` on the small preset (~125 M parameters) at several client
# concurrencies: output tokens/s, TTFT, TPOT, ITL, and the engine's own decode step time (from the
# server's GET /debug/step_stats). One BLAS thread. Each concurrency gets a fresh server.
#
#   scripts/bench_serving.sh [CONCURRENCY ...]      (default: 1 4 16 32)
#
# Environment: MODEL (checkpoint folder, made with make-model --preset small if missing), OUT (summary
# folder), OUTPUT_LEN (128), OUTPUT_LEN_C1 (output tokens at concurrency 1, where the 4 requests run one
# after another; default 128, lower it on a slow machine), PROMPT_LEN (128). num_requests = max(4, concurrency); --max-num-seqs 32.
set -euo pipefail
MODEL=${MODEL:-models/small-llama}
OUT=${OUT:-results/serving}
OUTPUT_LEN=${OUTPUT_LEN:-128}
OUTPUT_LEN_C1=${OUTPUT_LEN_C1:-128}
PROMPT_LEN=${PROMPT_LEN:-128}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
[ -f "$MODEL/config.json" ] || uv run attention-kv-caceh make-model --preset small --out "$MODEL"
mkdir -p "$OUT"
for c in "${@:-1 4 16 32}"; do
  for conc in $c; do
    n=$(( conc > 4 ? conc : 4 ))
    out=$OUTPUT_LEN
    [ "$conc" = 1 ] && out=$OUTPUT_LEN_C1
    uptime
    uv run attention-kv-caceh harness --backend engine --model "$MODEL" --max-num-seqs 32 \
      --num-requests "$n" --concurrency "$conc" --prompt-len "$PROMPT_LEN" --output-len "$out" \
      --ignore-eos --label "engine-c$conc" --summary-json "$OUT/c$conc.json"
  done
done
