"""The compiled kernels (Numba): vLLM's `csrc/cpu/`, ggml's `ggml-cpu/`. Importing this package imports no Numba.

One module per op; its compiled loops sit beside it in `_<op>_jit.py` (and `_<op>_ir.py` where LLVM IR is
written by hand). Outside this package, import the op's module, never a `_` module.

- `decode_attention.py`: decode attention over a contiguous KV cache and over paged KV blocks, and the
  plain reference kernel; loops in `_decode_attention_jit.py` (contiguous, plain) and
  `_decode_attention_paged_jit.py` with its vector IR in `_decode_attention_paged_ir.py` (paged).
- `gemm.py`: linear layers over float32 and bfloat16 weights packed once; loops in `_gemm_jit.py`.
- `block_gemm.py`: linear layers over GGUF's block-quantized weights (every type of `block_formats.py`);
  loops in `_block_gemm_jit.py`, each type's register decode in `_block_gemm_ir.py`.
- `fused_layers.py`: RMSNorm, SiLU-and-mul and rotary embedding, one pass over each row; loops in
  `_fused_layers_jit.py`.
- `block_formats.py`: one row per GGUF type (bytes, fields in file order, NumPy decode, step bound,
  quantizer).
- `dispatch.py`: the dtype, quantization and weight-format names, and which kernel serves a format.
- `threads.py`: one pool of Numba threads for a step (the threading layer, the per-thread count) and the
  output-row split every GEMM's kernel runs under; the driver in `_parallel_jit.py`.
- `isa.py`: the one table of instruction sets (AVX-512, AVX2, NEON) and which one Numba compiles for.
- `ir.py`: the LLVM IR vocabulary the hand-written vector kernels share (and the vector exp).
- `_math_jit.py`: exp for float32, the prefetch hint and a bit cast, one copy for every kernel.
"""
