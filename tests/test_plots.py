"""Plot smoke tests: a PNG is written (atomically, no pyplot), bad paths are refused."""

from __future__ import annotations

import tempfile
import unittest
from pathlib import Path

from attention_kv_caceh.experiments.cache_growth import CacheGrowthConfig, run_cache_growth
from attention_kv_caceh.report.plots import plot_cache_growth

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class CacheGrowthPlotTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        config = CacheGrowthConfig(steps=12, batch_size=1, num_heads=2, num_kv_heads=2, head_dim=4, repeats=2)
        cls.result = run_cache_growth(config)

    def test_writes_a_png(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = plot_cache_growth(self.result.samples, self.result.memory, Path(tmp, "sub", "g.png"))
            self.assertEqual(path.read_bytes()[:8], PNG_MAGIC)
            self.assertGreater(path.stat().st_size, 1000)
            self.assertEqual([p.name for p in path.parent.iterdir()], ["g.png"])  # no temporary left

    def test_without_memory_rows(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = plot_cache_growth(self.result.samples, [], Path(tmp, "g.png"))
            self.assertEqual(path.read_bytes()[:8], PNG_MAGIC)

    def test_refuses_other_suffixes(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            with self.assertRaisesRegex(ValueError, "png"):
                plot_cache_growth(self.result.samples, [], Path(tmp, "g.svg"))
            self.assertEqual(list(Path(tmp).iterdir()), [])


if __name__ == "__main__":
    unittest.main()
