#!/usr/bin/env bash
# lm-evaluation-harness on the real model twice, and the two compared: `lm_eval --model local-completions`
# against `serve --model smollm2`, and `lm_eval --model hf` on transformers' load of the same GGUF file
# (`gguf_file=`, dequantized, float64). Both score the same token ids: local-completions tokenizes with
# transformers' tokenizer of the file (saved as a folder first) and sends ids (tokenized_requests=True).
# Then `scripts/lmeval_compare.py --versus` prints both log-likelihoods per (question, choice) and exits 1
# unless the accuracies are equal and every difference is below 1e-3.
#
#   LMEVAL_PY=/path/to/venv/bin/python bash scripts/lmeval_serve_vs_hf.sh [OUT_DIR]
#
# LMEVAL_PY: the python of a scratch environment with lm-eval[api] 0.4.13, torch, transformers (>= 5),
# gguf and accelerate (never the project's own environment). Run from the repository root (the task
# files' data paths are relative to it). Environment: PORT (8123), TASKS (facts_choice,tiny_choice),
# SERVE_DTYPE (float32), HF_DTYPE (float64). The server is stopped on exit.
set -euo pipefail
LMEVAL_PY=${LMEVAL_PY:?set LMEVAL_PY to the python of an environment with lm-eval, transformers, torch, gguf, accelerate}
OUT=${1:-/tmp/lmeval-smollm2}
PORT=${PORT:-8123}
TASKS=${TASKS:-facts_choice,tiny_choice}
SERVE_DTYPE=${SERVE_DTYPE:-float32}
HF_DTYPE=${HF_DTYPE:-float64}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
mkdir -p "$OUT"
GGUF=$(uv run python -c 'from attention_kv_caceh.model_executor.model_source import resolve_model; print(resolve_model("smollm2").path)')
"$LMEVAL_PY" -c 'import sys; from pathlib import Path; from transformers import AutoTokenizer
p = Path(sys.argv[1]); AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name).save_pretrained(sys.argv[2])' \
    "$GGUF" "$OUT/tokenizer"

uv run attention-kv-caceh serve --model smollm2 --port "$PORT" --dtype "$SERVE_DTYPE" > "$OUT/serve.log" 2>&1 &
SERVE=$!
trap 'kill "$SERVE" 2>/dev/null || true; wait "$SERVE" 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 "$SERVE" 2>/dev/null || { cat "$OUT/serve.log"; exit 1; }
    sleep 1
done
"$LMEVAL_PY" -m lm_eval --model local-completions \
    --model_args "model=smollm2,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$OUT/tokenizer,tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1" \
    --include_path scripts/lmeval --tasks "$TASKS" --batch_size 4 --log_samples --output_path "$OUT/serve"
kill "$SERVE"
"$LMEVAL_PY" -m lm_eval --model hf \
    --model_args "pretrained=$(dirname "$GGUF"),gguf_file=$(basename "$GGUF"),dtype=$HF_DTYPE" \
    --device cpu --include_path scripts/lmeval --tasks "$TASKS" --batch_size 1 --log_samples --output_path "$OUT/hf"
status=0
for task in ${TASKS//,/ }; do
    echo "== $task: lm_eval --model hf ($HF_DTYPE) vs local-completions through serve ($SERVE_DTYPE)"
    uv run python scripts/lmeval_compare.py --versus "$(ls "$OUT"/hf/*/samples_"$task"_*.jsonl)" \
        "$(ls "$OUT"/serve/*/samples_"$task"_*.jsonl)" || status=1
done
exit "$status"
