"""The OpenAI-compatible HTTP server over AsyncLLM (FastAPI, run with uvicorn).

Corresponds to vLLM's `vllm/entrypoints/openai/`: `api_server.build_app` makes the app, whose routes are
thin: each calls a serving object (`serving_completion.OpenAIServingCompletion`,
`serving_chat.OpenAIServingChat`, `serving_tokenization.OpenAIServingTokenization`, over
`serving_engine.OpenAIServing`, which admits a request's choices). `protocol` holds the request bodies and
OpenAI's error body, `serving` turns a body into SamplingParams and writes the stream chunks,
`serving_response` streams or gathers the choices, and `middleware` and `body_budget` bound the bodies
read.

Left out: vLLM's other endpoint families (embeddings, pooling, score and rerank, transcription, the
Responses API), tool and reasoning parsers, and `serving_models` (one served model name, no LoRA).
"""
