"""The engine compiles its paged decode kernel at construction, so the first decode step compiles nothing.

Checked in a fresh process (Numba's dispatchers are per process): the kernel's compiled signatures right
after `LLMEngine.from_pretrained` must already hold every signature a real decode step then uses.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from attention_kv_caceh.engine.make_model import write_random_checkpoint

_CHILD = """
import sys
from attention_kv_caceh import _kernels_jit as jit
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.llm_engine import LLMEngine
from attention_kv_caceh.engine.request import SamplingParams

for dtype in ("float32", "float64"):
    engine = LLMEngine.from_pretrained(sys.argv[1], EngineConfig(num_kv_blocks=8, dtype=dtype))
    after_init = set(jit.paged_serial.signatures)
    engine.add_request(dtype, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    decode = set(jit.paged_serial.signatures)
    assert len(decode) >= 1, "no decode step ran the paged kernel"
    assert decode == after_init, f"{dtype}: the first decode compiled {decode - after_init}"
print("ok")
"""


class WarmUpTest(unittest.TestCase):
    def test_the_first_decode_step_compiles_no_kernel_in_a_fresh_process(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            model = write_random_checkpoint(Path(tmp) / "m", "llama", "tiny")
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, str(model)], capture_output=True, text=True, timeout=300
            )
        self.assertEqual(done.returncode, 0, done.stderr)
        self.assertEqual(done.stdout.strip(), "ok")


if __name__ == "__main__":
    unittest.main()
