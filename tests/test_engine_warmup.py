"""The engine warms up when it is built, so its first step (a prefill) and first decode step compile nothing.

Checked in a fresh process (Numba's dispatchers are per process): right after `LLMEngine.from_pretrained`,
every Numba function of the package must already hold every signature the steps then use, for a Hugging
Face folder and for a GGUF file (whose float32 norm weights are read-only views of the file: Numba types a
read-only array apart from a writable one), on the packed float32 path, in float64, with bfloat16 panels
(`dtype="bfloat16"`: the bf16 kernel where the CPU has one, else the machine's fallback), on a GGUF
file's own Q8_0, Q4_0 and Q4_1 blocks (`quantization="gguf"`), and with n-gram speculative decoding
(steps that verify k + 1 tokens of one request)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from gguf import GGMLQuantizationType

from attention_kv_caceh.toy_model.make_model import write_random_checkpoint
from tests.gguf_files import gguf_from_checkpoint

_CHILD = """
import sys
from numba.core.dispatcher import Dispatcher
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.engine.spec_decode.config import SpeculativeConfig
from attention_kv_caceh.model_executor.warmup import numba_compile_counts


def signatures():
    return {
        (name, attr): set(value.signatures)
        for name, module in list(sys.modules.items())
        if name.startswith("attention_kv_caceh.")
        for attr, value in list(vars(module).items())
        if isinstance(value, Dispatcher)
    }


group, folder, gguf, *block_files = sys.argv[1:]
spec = SpeculativeConfig(3, 1, 2)
if group == "float":
    cases = [
        (path, dtype, None, draft, dtype)
        for path in (folder, gguf)
        for dtype, draft in (("float32", None), ("float64", None), ("float32", spec))
    ]
elif group == "bfloat16":
    cases = [(path, "bfloat16", None, draft, "bfloat16") for path in (folder, gguf) for draft in (None, spec)]
else:  # m-q8_0.gguf ...: the files' own blocks
    cases = [
        (path, "float32", "gguf", draft, path.rsplit("-", 1)[1].removesuffix(".gguf"))
        for path in block_files
        for draft in (None, spec)
    ]
at_start = numba_compile_counts()
for path, dtype, quantization, spec, fmt in cases:
    config = EngineConfig(
        num_kv_blocks=40, block_size=16, dtype=dtype, quantization=quantization, speculative_config=spec
    )
    engine = LLMEngine.from_pretrained(path, config)
    model = engine.model_runner.model
    formats = {layer.gate_up_proj.format for layer in model.layers}
    assert formats == {fmt}, f"{path} {dtype} {quantization}: layers in {formats}, not {fmt}"
    caches = engine.model_runner.kv_caches
    assert all(not k.any() and not v.any() for k, v in caches), "the warm-up left K/V in the cache"
    after_init = signatures()
    # With drafts on, the prompt holds every token id once: whatever token comes out, the n-gram
    # proposer finds it and drafts, so the steps verify k + 1 tokens of one request.
    prompt = [1, 2, 3, 4, 5, 6] if spec is None else list(range(model.config.vocab_size))
    engine.add_request(dtype, prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    if spec is not None:
        drafted = sum(s.spec_decoding.num_draft_tokens for s in engine.step_stats if s.spec_decoding)
        assert drafted > 0, "no draft was verified"
    new = {key: sigs - after_init.get(key, set()) for key, sigs in signatures().items()}
    new = {key: sigs for key, sigs in new.items() if sigs}
    assert not new, f"{path} {dtype} {quantization} {spec}: the steps compiled {new}"
compiled, loaded = numba_compile_counts()
assert compiled + loaded > sum(at_start), "numba_compile_counts saw no compile and no cache load"
print("ok")
"""


class WarmUpTest(unittest.TestCase):
    def test_the_first_steps_compile_nothing_in_a_fresh_process(self) -> None:
        """One fresh process per group, so each group's first engine finds nothing compiled by another
        group's warm-up (the paged decode kernel and the small layers are shared by all of them)."""
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_random_checkpoint(Path(tmp) / "m", "llama", "tiny")
            gguf = gguf_from_checkpoint(folder, Path(tmp) / "m.gguf")
            blocks = [
                gguf_from_checkpoint(folder, Path(tmp) / f"m-{qtype.name.lower()}.gguf", qtype)
                for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
            ]
            for group in ("float", "bfloat16", "gguf"):
                with self.subTest(group=group):
                    done = subprocess.run(
                        [sys.executable, "-c", _CHILD, group, str(folder), str(gguf), *map(str, blocks)],
                        capture_output=True,
                        text=True,
                        timeout=300,
                    )
                    self.assertEqual(done.returncode, 0, done.stderr)
                    self.assertEqual(done.stdout.strip(), "ok")


if __name__ == "__main__":
    unittest.main()
