"""The model side of the engine: the model, its layers, paged attention over the KV buffers, and the loaders.

Corresponds to vLLM's `vllm/model_executor/` (`models/`, `layers/`, `model_loader/`) and the warm-up of
`vllm/v1/worker/`. Modules:

- `model`: Model, the decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3) over packed or
  GGUF-block weights.
- `layers`: the linear layers, RMSNorm, SiLU-and-mul and rotary embedding.
- `paged_attention`: the paged KV buffers, the K/V writes and attention over block tables.
- `warmup`: one forward pass on dummy inputs so the first real step compiles nothing.
- `checkpoint`, `model_config`, `model_source`, `model_weights`: safetensors folders, the model's
  config, where a `--model` name points, and reading weights into the model's layout.
- `gguf_checkpoint`, `gguf_config`, `gguf_tokenizer`: a GGUF file through the `gguf` library.

Nothing here imports `attention_kv_caceh.engine`: the engine drives the model, never the other way.

Left out: vLLM's model registry and the other architectures, tensor parallelism, LoRA, quantization other
than GGUF's blocks and bfloat16.
"""
