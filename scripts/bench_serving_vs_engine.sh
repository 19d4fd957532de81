#!/usr/bin/env bash
# Serving overhead of the engine-core process design: at max_num_seqs = concurrency N (8 and 32 by
# default) the output tokens/s of `bench-engine` (offline, the core in-process) and of `serve` driven by
# `harness --backend engine` (the core in its own process), the ratio of the two, then at concurrency 1
# the harness's ITL P50 minus the engine's own decode-step P50 (what the API process adds to each token).
# 128-token prompts and outputs, ignore_eos, one BLAS thread, on the `make-model --preset small`
# checkpoint. Each value of N alternates: bench-engine, then serve, in the same run. Both halves sample
# alike: TEMPERATURE goes to bench-engine's --temperature and to the harness's --temperature (sent in every
# request body), so neither half does a sampling draw the other skips (serve's own default is 1.0).
#
#   scripts/bench_serving_vs_engine.sh [N ...]      (default: 8 32)
#
# Environment: MODEL (checkpoint folder, made with make-model --preset small if missing), OUT (summary
# folder), PROMPT_LEN (128), OUTPUT_LEN (128), OUTPUT_LEN_C1 (output tokens per request at
# concurrency 1, 4 requests one after another; default 64), TEMPERATURE (0: greedy on both halves).
set -euo pipefail
MODEL=${MODEL:-models/small-llama}
OUT=${OUT:-results/serving-vs-engine}
PROMPT_LEN=${PROMPT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
OUTPUT_LEN_C1=${OUTPUT_LEN_C1:-64}
TEMPERATURE=${TEMPERATURE:-0}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
[ -f "$MODEL/config.json" ] || uv run attention-kv-caceh make-model --preset small --out "$MODEL"
mkdir -p "$OUT"
rows=()
for n in ${@:-8 32}; do
  uptime
  uv run attention-kv-caceh bench-engine --model "$MODEL" --max-num-seqs "$n" --prompt-len "$PROMPT_LEN" \
    --output-len "$OUTPUT_LEN" --temperature "$TEMPERATURE" --json "$OUT/bench-engine-$n.json" | tail -n 1 > "$OUT/bench-engine-$n.last"
  uv run attention-kv-caceh harness --backend engine --model "$MODEL" --max-num-seqs "$n" \
    --num-requests "$n" --concurrency "$n" --prompt-len "$PROMPT_LEN" --output-len "$OUTPUT_LEN" \
    --temperature "$TEMPERATURE" --ignore-eos --label "serve-$n" --summary-json "$OUT/serve-$n.json" > "$OUT/serve-$n.log"
  rows+=("$n")
done
uptime
uv run attention-kv-caceh harness --backend engine --model "$MODEL" --max-num-seqs 1 \
  --num-requests 4 --concurrency 1 --prompt-len "$PROMPT_LEN" --output-len "$OUTPUT_LEN_C1" \
  --temperature "$TEMPERATURE" --ignore-eos --label "serve-c1" --summary-json "$OUT/serve-c1.json" > "$OUT/serve-c1.log"
uv run python - "$OUT" "${rows[@]}" <<'PY'
import json, sys
out, sizes = sys.argv[1], sys.argv[2:]
print(f"{'N':>4} {'bench-engine tok/s':>19} {'serve tok/s':>12} {'serve / engine':>15}"
      f"  decode step P50 wall / CPU ms (bench-engine; serve core)")
for n in sizes:
    engine = json.loads(open(f"{out}/bench-engine-{n}.last").read())["output_tokens_per_s"][0]
    row = json.load(open(f"{out}/bench-engine-{n}.json"))["rows"][0]
    summary = json.load(open(f"{out}/serve-{n}.json"))
    serve, steps = summary["output_throughput"], summary["server"]["engine_steps"]
    print(f"{n:>4} {engine:>19.1f} {serve:>12.1f} {serve / engine:>15.3f}"
          f"  {row['decode_step_ms_p50']:.2f} / {row['core_step_cpu_ms_p50']:.2f};"
          f" {steps['median_decode_step_time_ms']:.2f} / {steps['median_decode_step_cpu_time_ms']:.2f}")
c1 = json.load(open(f"{out}/serve-c1.json"))
itl = c1["median_itl_ms"]
step = c1["server"]["engine_steps"]["median_decode_step_time_ms"]
print(f"concurrency 1: ITL P50 {itl:.2f} ms, decode step P50 {step:.2f} ms, difference {itl - step:.2f} ms")
PY
