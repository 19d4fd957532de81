"""What a grammar mask costs: the engine's decode step with a JSON-schema mask on every row against none.

What and why: structured outputs add work to every step of a constrained request: llguidance fills the
request's bitmask row (the tokens its grammar allows next), the sampler applies it, and the grammar
advances on the sampled token. This script runs the real model (SmolLM2-135M, float32) at 8 sequences,
the same prompts with and without `structured_outputs` (a JSON schema whose array of at least 40 integers
keeps every row masked for the whole run), and compares the decode steps' median wall time and thread
CPU time (`StepStats.step_time_ms`, `step_cpu_ms`: the whole step, the mask fill, the sampler's masking
and the grammar's advance included). The runs alternate, `--pairs` of each, so a shared machine's load
falls on both alike. It also times the compile of a few schemas (`compile_grammar`: llguidance's
validation and matcher construction, the median of 20) and the tokenizer view built once.

Oracle first: every masked output parses and validates against its schema (jsonschema), else it exits 1.

    OPENBLAS_NUM_THREADS=1 uv run python scripts/bench_grammar_mask.py --pairs 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import jsonschema

from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.structured_output import StructuredOutputsParams
from attention_kv_caceh.engine.structured_output.backend_guidance import build_llg_tokenizer, compile_grammar
from attention_kv_caceh.engine.tokenizer import Tokenizer
from attention_kv_caceh.entrypoints.chat_utils import load_chat_template
from attention_kv_caceh.model_executor.model import Model

ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 40}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array"}},
    "required": ["name", "age"],
}
NESTED = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "string", "pattern": "^[A-Z][0-9]{3}$"},
                    "n": {"type": "number"},
                },
                "required": ["id"],
            },
        },
        "kind": {"enum": ["a", "b", "c"]},
    },
    "required": ["items", "kind"],
}


def _decode_steps(engine: LLMEngine, first: int, batch: int) -> list[tuple[float, float]]:
    return [
        (s.step_time_ms, s.step_cpu_ms)
        for s in list(engine.step_stats)[first:]
        if s.num_prefill_tokens == 0 and s.num_decode_tokens == batch
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = Model.load("smollm2", "float32")
    tokenizer = Tokenizer.load("smollm2")
    cfg = EngineConfig(num_kv_blocks=256, max_num_seqs=args.batch)
    runner = ModelRunner(model, cfg, 256)
    engine = LLMEngine(
        cfg,
        runner,
        tokenizer,
        num_blocks=256,
        max_model_len=512,
        extra_eos_token_ids=model.config.eos_token_ids,
    )
    template = load_chat_template("smollm2")
    assert template is not None
    prompts = [
        tokenizer.encode(
            template.render([{"role": "user", "content": f"List {i + 40} numbers."}]),
            add_special_tokens=False,
        )
        for i in range(args.batch)
    ]
    so = StructuredOutputsParams(json=json.dumps(ARRAY), disable_any_whitespace=True)
    masked = SamplingParams(max_tokens=args.output_len, structured_outputs=so)
    plain = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "masked": []}
    for _ in range(args.pairs):
        for name, params in (("plain", plain), ("masked", masked)):
            first = len(engine.step_stats)
            outs = engine.generate(prompts, params)
            times[name] += _decode_steps(engine, first, args.batch)
            if name == "masked":
                for out in outs:  # the oracle: a cut output is a prefix; a finished one validates
                    text = tokenizer.decode(out)
                    if len(out) < args.output_len:
                        jsonschema.validate(json.loads(text), ARRAY)
                    elif not text.startswith("[") or any(c not in "0123456789,[]" for c in text):
                        print(f"masked output breaks the schema: {text!r}", file=sys.stderr)
                        return 1
    t0 = time.perf_counter()
    lltok = build_llg_tokenizer(tokenizer.backend_json(), [2])
    tokenizer_s = time.perf_counter() - t0
    compile_ms: dict[str, float] = {}
    for name, schema in (("array", ARRAY), ("person", PERSON), ("nested", NESTED)):
        samples = []
        for _ in range(20):
            t0 = time.perf_counter()
            compile_grammar(StructuredOutputsParams(json=json.dumps(schema)), lltok)
            samples.append((time.perf_counter() - t0) * 1e3)
        compile_ms[name] = statistics.median(samples)
    summary: dict[str, Any] = {"batch": args.batch, "pairs": args.pairs, "compile_ms": compile_ms}
    summary["tokenizer_view_s"] = tokenizer_s
    print(f"decode steps at {args.batch} sequences (median of each run's decode steps, ms)")
    print(f"{'run':<8}{'steps':>7}{'wall P50':>10}{'cpu P50':>10}")
    for name, rows in times.items():
        wall = statistics.median(r[0] for r in rows)
        cpu = statistics.median(r[1] for r in rows)
        summary[name] = {"steps": len(rows), "wall_ms_p50": wall, "cpu_ms_p50": cpu}
        print(f"{name:<8}{len(rows):>7}{wall:>10.2f}{cpu:>10.2f}")
    ratio_wall = summary["masked"]["wall_ms_p50"] / summary["plain"]["wall_ms_p50"]
    ratio_cpu = summary["masked"]["cpu_ms_p50"] / summary["plain"]["cpu_ms_p50"]
    summary["ratio_wall"], summary["ratio_cpu"] = ratio_wall, ratio_cpu
    print(f"masked / plain: wall {ratio_wall:.3f}, cpu {ratio_cpu:.3f}")
    print(
        "compile per schema (median of 20, ms): " + ", ".join(f"{k} {v:.2f}" for k, v in compile_ms.items())
    )
    print(f"tokenizer view (once): {tokenizer_s:.2f} s")
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
