"""The OpenAI-compatible HTTP server over AsyncLLM (FastAPI, run with uvicorn).

Corresponds to vLLM's `vllm/entrypoints/openai/`: `api_server.build_app` makes the app; `protocol` holds
the request bodies and OpenAI's error body, `serving` turns a body into SamplingParams and writes the
stream chunks, `serving_response` streams or gathers the choices, `serving_tokenization` answers
/tokenize, and `body_budget` bounds the large bodies read at once.

Left out: vLLM's other endpoint families (embeddings, pooling, score and rerank, transcription, the
Responses API), tool and reasoning parsers, and `serving_models` (one served model name, no LoRA).
"""
