"""Random test checkpoints, written locally: no download (vLLM has no counterpart; its tests fetch
small models from the hub).

- `make_model`: `write_random_checkpoint`, a seeded Llama / Qwen2 / Qwen3 folder in the Hugging Face
  layout with a tokenizer trained here; `make-model` is its command.
- `training_text`: the plain English that tokenizer is trained on.

Outside `engine/`, because the engine reads checkpoints and never writes them.
"""
