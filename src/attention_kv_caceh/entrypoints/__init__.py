"""The ways into the engine from outside the process: the OpenAI-compatible HTTP server and its chat templates.

Corresponds to vLLM's `vllm/entrypoints/`: `openai/` is the HTTP server (`api_server`: the FastAPI app,
its routes and middleware; `serving_*`: one class per endpoint family over AsyncLLM; `protocol`: the
request bodies; `body_budget`: the bound on large bodies in flight) and `chat_utils` renders a
conversation with the checkpoint's chat template; `launcher` serves the app with uvicorn and drains
the engine at Ctrl-C / SIGTERM. The arrows point one way: entrypoints import
`attention_kv_caceh.engine`, and nothing under engine/ imports entrypoints (tests/test_layering.py).

Left out: vLLM's offline `LLM` class (`entrypoints/llm.py`; here `engine/llm_engine.py:LLMEngine` is used
directly), its CLI (`entrypoints/cli/`; here `cli/serve.py`), and the Anthropic-, gRPC- and
sagemaker-shaped servers.
"""
