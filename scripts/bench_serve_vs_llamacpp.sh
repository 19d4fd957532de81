#!/usr/bin/env bash
# This project's `serve` against llama.cpp's `llama-server`, both on the same GGUF file, driven by the
# same harness command, in alternating runs on the same machine: for each pair and each concurrency C,
# one llama.cpp run, then one `serve` run, each C requests of PROMPT_LEN prompt tokens and OUTPUT_LEN
# output tokens (ignore_eos), at TEMPERATURE (default 0, greedy) on both. Every run has its own prompt
# seed, so no run finds another run's prompts in either server's prefix cache. `serve` computes on the
# file's own blocks (--quantization gguf) times 8-bit activations (--activations $ACTIVATIONS, default int8:
# llama.cpp's own numerics); llama-server runs SLOTS parallel sequences (default 8). With
# THREADS unset both run at their own default thread count (llama.cpp's `-t` default; serve's
# `--threads` default, the CPUs this process may use); THREADS=N passes N to both (`--threads N` to
# serve, `--threads N --threads-batch N` to llama-server). Both bind 127.0.0.1 and are stopped when the
# script exits (also on errors and Ctrl-C).
#
#   LLAMA_SERVER=/path/to/llama-server scripts/bench_serve_vs_llamacpp.sh [C ...]   (default: 1 8)
#
# LLAMA_SERVER: llama.cpp's server binary, built in a scratch environment (never this project's; for
# example from PyPI's llama-cpp-python sources, see docs/results.md). LLAMACPP_PYTHON instead: a
# Python with `llama-cpp-python[server]` (llama-cpp-python's own OpenAI server over the same library;
# it runs one request at a time, and is started with --interrupt_requests False, since by default a new
# request cuts the stream of the running one short).
# Environment: MODEL (a GGUF file or model name; default smollm2), PAIRS (3), OUT
# (results/serve-vs-llamacpp), PROMPT_LEN (128), OUTPUT_LEN (64), TEMPERATURE (0), THREADS (unset),
# SLOTS (8), ACTIVATIONS (int8; float32 for the float32-activation kernels), LLAMA_PORT (8300), SERVE_PORT (8200).
# A run that fails (the harness exits non-zero: a request failed, a server died, the 900 s timeout) is
# reported in the table as failed with its count of failed requests; the other runs still run, and the
# script exits 1 when any run failed (0 when all finished with every request ok).
set -euo pipefail
MODEL=${MODEL:-smollm2}
PAIRS=${PAIRS:-3}
OUT=${OUT:-results/serve-vs-llamacpp}
PROMPT_LEN=${PROMPT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-64}
TEMPERATURE=${TEMPERATURE:-0}
THREADS=${THREADS:-}
llama_threads=(); serve_threads=()
if [ -n "$THREADS" ]; then
  llama_threads=(--threads "$THREADS" --threads-batch "$THREADS"); serve_threads=(--threads "$THREADS")
fi
SLOTS=${SLOTS:-8}
ACTIVATIONS=${ACTIVATIONS:-int8}
LLAMA_PORT=${LLAMA_PORT:-8300}
SERVE_PORT=${SERVE_PORT:-8200}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
GGUF=$(uv run python -c "import sys; from attention_kv_caceh.model_executor.model_source import resolve_model; print(resolve_model(sys.argv[1]).path)" "$MODEL")
mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "-$p" 2>/dev/null || true; done; }
trap cleanup EXIT INT TERM
CTX=$((SLOTS * (PROMPT_LEN + OUTPUT_LEN + 64)))
if [ -n "${LLAMA_SERVER:-}" ]; then
  setsid "$LLAMA_SERVER" --model "$GGUF" --host 127.0.0.1 --port "$LLAMA_PORT" "${llama_threads[@]}" \
    --parallel "$SLOTS" --ctx-size "$CTX" > "$OUT/llamacpp-server.log" 2>&1 &
  "$LLAMA_SERVER" --version > "$OUT/versions.txt" 2>&1 || true
else
  : "${LLAMACPP_PYTHON:?set LLAMA_SERVER (the llama-server binary) or LLAMACPP_PYTHON}"
  setsid "$LLAMACPP_PYTHON" -m llama_cpp.server --model "$GGUF" --host 127.0.0.1 --port "$LLAMA_PORT" \
    ${THREADS:+--n_threads "$THREADS" --n_threads_batch "$THREADS"} --n_ctx "$CTX" --interrupt_requests False > "$OUT/llamacpp-server.log" 2>&1 &
  "$LLAMACPP_PYTHON" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)" > "$OUT/versions.txt"
fi
pids+=($!)
setsid uv run attention-kv-caceh serve --model "$MODEL" --quantization gguf --activations "$ACTIVATIONS" --host 127.0.0.1 \
  --port "$SERVE_PORT" --max-num-seqs 32 "${serve_threads[@]}" > "$OUT/serve-server.log" 2>&1 &
pids+=($!)
for port in "$LLAMA_PORT" "$SERVE_PORT"; do
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null && break; sleep 2; done
  curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null || { echo "server on port $port not ready" >&2; exit 1; }
done
{ echo "threads: ${THREADS:-the default of each server} ($SLOTS llama.cpp slots; BLAS pinned to 1)"
  grep -m1 -i "system_info\|n_threads" "$OUT/llamacpp-server.log" || true
  grep -m1 -i "thread" "$OUT/serve-server.log" || true
} | tee -a "$OUT/versions.txt"
# llama-cpp-python's server takes a prompt only as text (a list of token ids is refused with HTTP 500),
# while the harness sends its exact-length prompts as ids: with LLAMACPP_PYTHON both sides instead get
# the same text prompts from a dataset per run (PROMPT_LEN token ids of the model's tokenizer drawn at
# random and decoded; the harness counts the tokens of the text, which are close to PROMPT_LEN).
text_prompts() {  # text_prompts SEED N FILE
  uv run python - "$MODEL" "$1" "$2" "$PROMPT_LEN" "$OUTPUT_LEN" "$3" <<'PY'
import asyncio, json, random, sys
from attention_kv_caceh.harness.prompts import local_tokenizer
model, seed, n, prompt_len, output_len, path = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
tok, rng = local_tokenizer(model), random.Random(seed)
rows = [asyncio.run(tok.decode([rng.randrange(1000, 40000) for _ in range(prompt_len)])) for _ in range(n)]
with open(path, "w") as f:
    f.writelines(json.dumps({"prompt": r, "output_len": output_len}) + "\n" for r in rows)
PY
}
failed_runs=0  # a failed run is reported in the table and the others still run
for pair in $(seq "$PAIRS"); do
  for c in ${@:-1 8}; do
    dataset=()
    if [ -z "${LLAMA_SERVER:-}" ]; then
      text_prompts "$((pair * 1000 + c))" "$((c * 2))" "$OUT/prompts-c$c-p$pair.jsonl"
      dataset=(--dataset "$OUT/prompts-c$c-p$pair.jsonl")
    fi
    for server in llamacpp:$LLAMA_PORT serve:$SERVE_PORT; do
      name=${server%%:*}; port=${server##*:}
      echo "$name c$c pair $pair: load $(cut -d' ' -f1 /proc/loadavg)"
      run="$OUT/$name-c$c-p$pair"
      rm -f "$run.json" "$run.rc"
      rc=0
      timeout 900 uv run attention-kv-caceh harness --backend openai-completions \
        --base-url "http://127.0.0.1:$port" --tokenizer "$MODEL" --num-requests "$((c * 2))" --concurrency "$c" \
        --prompt-len "$PROMPT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos --warmup-requests 0 \
        --temperature "$TEMPERATURE" --seed "$((pair * 1000 + c))" --label "$name-c$c-p$pair" \
        "${dataset[@]}" --summary-json "$run.json" > "$run.log" 2>&1 || rc=$?
      echo "$rc" > "$run.rc"
      if [ "$rc" -ne 0 ]; then
        failed_runs=$((failed_runs + 1))
        echo "$name c$c pair $pair: failed (exit $rc; $run.log)" >&2
      fi
    done
  done
done
uv run python "$(dirname "$0")/pair_table.py" "$OUT" "$PAIRS" llamacpp llama.cpp ${@:-1 8} || failed_runs=$((failed_runs + 1))
if [ "$failed_runs" -gt 0 ]; then
  echo "$failed_runs run(s) failed: see the table and their logs in $OUT" >&2
  exit 1
fi
