"""The NumPy model and model runner against independent references, on tiny random checkpoints.

Oracles: a float64 forward written here from the formulas (loops over heads, positions and rotary
pairs; no cache, no batching, weights read with safetensors directly), the lab's contiguous attention
for the paged attention, and the full prompt at once for chunked prefill and decode.
"""

from __future__ import annotations

import json
import math
import tempfile
import unittest
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

from attention_kv_caceh.attention import scaled_dot_product_attention
from attention_kv_caceh.engine.config import EngineConfig
from attention_kv_caceh.engine.model_runner import ModelRunner
from attention_kv_caceh.engine.request import SamplingParams
from attention_kv_caceh.kernels.decode_attention import paged_decode_attention
from attention_kv_caceh.kernels.dispatch import resolve_gemm_path
from attention_kv_caceh.model_executor.layers import (
    LinearWeight,
    apply_rotary,
    compiled_rms_norm,
    compiled_rotary,
    compiled_silu_and_mul,
    linear,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    silu_and_mul,
)
from attention_kv_caceh.model_executor.model import Model
from attention_kv_caceh.model_executor.paged_attention import (
    AttentionMetadata,
    pack_kv_blocks,
    paged_attention,
    write_kv,
)
from attention_kv_caceh.oracle import reference_paged_decode_attention
from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

ARCHS = ("llama", "qwen2", "qwen3")


# The runner reads only these attributes of a request (sampling_params: whether it asks for prompt logprobs) and of a scheduler output (the engine contract);
# the fakes keep these tests independent of how the scheduler constructs its own types.
@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list[int])
    sampling_params: SamplingParams = field(default_factory=SamplingParams)  # read for prompt_logprobs


@dataclass
class FakeSchedulerOutput:
    scheduled_requests: list[FakeRequest]
    num_scheduled_tokens: dict[str, int]
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict[str, list[int]])
    block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict[str, tuple[list[int], ...]])


def reference_logits(folder: Path, token_ids: list[int]) -> np.ndarray:
    """Float64 logits `[T, V]` of every prompt position, from the formulas, one loop at a time."""
    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in load_file(folder / "model.safetensors").items()}
    arch = cfg["architectures"][0]
    h, h_kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    t_len = len(token_ids)

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / math.sqrt(float(np.mean(x * x)) + eps) * g

    def rope(x: np.ndarray, pos: int) -> np.ndarray:  # one head's [D] vector
        out = x.copy()
        for i in range(d // 2):
            angle = pos * theta ** (-2 * i / d)
            c, s = math.cos(angle), math.sin(angle)
            out[i] = x[i] * c - x[i + d // 2] * s
            out[i + d // 2] = x[i + d // 2] * c + x[i] * s
        return out

    xs = [w["model.embed_tokens.weight"][t].copy() for t in token_ids]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        qs, ks, vs = [], [], []
        for pos, x in enumerate(xs):
            xn = rms(x, w[p + "input_layernorm.weight"])
            proj = {}
            for name in ("q", "k", "v"):
                y = w[f"{p}self_attn.{name}_proj.weight"] @ xn
                if arch == "Qwen2ForCausalLM":
                    y = y + w[f"{p}self_attn.{name}_proj.bias"]
                proj[name] = y
            q = proj["q"].reshape(h, d)
            k = proj["k"].reshape(h_kv, d)
            if arch == "Qwen3ForCausalLM":
                q = np.stack([rms(qh, w[p + "self_attn.q_norm.weight"]) for qh in q])
                k = np.stack([rms(kh, w[p + "self_attn.k_norm.weight"]) for kh in k])
            qs.append(np.stack([rope(qh, pos) for qh in q]))
            ks.append(np.stack([rope(kh, pos) for kh in k]))
            vs.append(proj["v"].reshape(h_kv, d))
        new_xs = []
        for t in range(t_len):
            heads = []
            for head in range(h):
                g = head // (h // h_kv)
                scores = [float(qs[t][head] @ ks[s][g]) / math.sqrt(d) for s in range(t + 1)]
                m = max(scores)
                e = [math.exp(sc - m) for sc in scores]
                heads.append(sum(e[s] / sum(e) * vs[s][g] for s in range(t + 1)))
            x = xs[t] + w[p + "self_attn.o_proj.weight"] @ np.concatenate(heads)
            xn = rms(x, w[p + "post_attention_layernorm.weight"])
            gate = w[p + "mlp.gate_proj.weight"] @ xn
            up = w[p + "mlp.up_proj.weight"] @ xn
            silu = gate / (1 + np.exp(-gate))
            new_xs.append(x + w[p + "mlp.down_proj.weight"] @ (silu * up))
        xs = new_xs
    head_w = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return np.stack([head_w @ rms(x, w["model.norm.weight"]) for x in xs])


class EngineModelTestBase(unittest.TestCase):
    folders: dict[str, Path]

    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.folders = {a: write_random_checkpoint(Path(cls._tmp.name) / a, a, "tiny", seed=7) for a in ARCHS}

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def prompt(self, n: int, seed: int = 0) -> list[int]:
        return [int(t) for t in np.random.default_rng(seed).integers(0, 512, size=n)]


class TestModelForward(EngineModelTestBase):
    def test_full_prompt_logits_equal_float64_reference_for_each_architecture(self) -> None:
        tokens = self.prompt(11, seed=1)
        for arch in ARCHS:
            with self.subTest(arch=arch):
                model = Model.load(self.folders[arch], "float64")
                runner = ModelRunner(model, EngineConfig(block_size=4, dtype="float64"), num_blocks=8)
                inputs = runner.prepare_inputs(
                    FakeSchedulerOutput([FakeRequest("a", tokens, 0, [5, 2, 7])], {"a": 11})  # type: ignore[arg-type]
                )
                hidden = model.forward(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.metadata)
                got = model.compute_logits(hidden)  # [T, V]
                want = reference_logits(self.folders[arch], tokens)
                np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)

    def test_float32_greedy_decode_agrees_with_float64_and_top2_gaps_are_wide(self) -> None:
        # 24 greedy steps per architecture: every choice has a top-2 logit gap far above float32 error,
        # and the float32 model picks the same tokens as the float64 one.
        for arch in ARCHS:
            with self.subTest(arch=arch):
                picks: dict[str, list[int]] = {}
                gaps: list[float] = []
                for dtype in ("float64", "float32"):
                    model = Model.load(self.folders[arch], dtype)
                    runner = ModelRunner(model, EngineConfig(block_size=8, dtype=dtype), num_blocks=8)
                    req = FakeRequest("r", self.prompt(5, seed=3), 0, [3, 1, 6, 0, 4])
                    n = 5
                    for _ in range(24):
                        logits = runner.execute_model(FakeSchedulerOutput([req], {"r": n}))[0]  # type: ignore[arg-type]
                        self.assertEqual(logits.dtype, np.dtype(dtype))
                        req.num_computed_tokens += n
                        top2 = np.sort(logits)[-2:]
                        if dtype == "float64":
                            gaps.append(float(top2[1] - top2[0]))
                        req.all_token_ids.append(int(np.argmax(logits)))
                        n = 1
                    picks[dtype] = req.all_token_ids
                self.assertEqual(picks["float32"], picks["float64"])
                self.assertGreater(min(gaps), 1e-3)
                self.assertGreater(len(set(picks["float64"][5:])), 1)  # not one token repeated forever


class TestPagedAttention(unittest.TestCase):
    def check_plan(self, plan: list[tuple[int, int]], bs: int, seed: int) -> None:
        """Paged attention of requests with (cached c, scheduled n) over shuffled blocks equals the
        lab's contiguous attention of each request alone."""
        rng = np.random.default_rng(seed)
        h, h_kv, d = 6, 2, 8
        num_blocks = sum(-(-(c + n) // bs) for c, n in plan) + 3  # a few blocks stay unused
        perm = [int(b) for b in rng.permutation(num_blocks)]
        k_cache = rng.standard_normal((num_blocks, bs, h_kv, d))  # garbage where nothing is written
        v_cache = rng.standard_normal((num_blocks, bs, h_kv, d))
        tables, full_k, full_v, qs, slots = [], [], [], [], []
        for c, n in plan:
            t = c + n
            blocks = [perm.pop() for _ in range(-(-t // bs))]
            tables.append(blocks)
            k, v = rng.standard_normal((t, h_kv, d)), rng.standard_normal((t, h_kv, d))
            full_k.append(k)
            full_v.append(v)
            for p in range(c):  # earlier positions: already in the cache
                k_cache[blocks[p // bs], p % bs], v_cache[blocks[p // bs], p % bs] = k[p], v[p]
            slots += [blocks[p // bs] * bs + p % bs for p in range(c, t)]
            qs.append(rng.standard_normal((n, h, d)))
        block_tables = np.full((len(plan), max(map(len, tables))), -1, dtype=np.int32)
        for i, b in enumerate(tables):
            block_tables[i, : len(b)] = b
        meta = AttentionMetadata(
            slot_mapping=np.array(slots),
            query_start_loc=np.cumsum([0] + [n for _, n in plan]),
            block_tables=block_tables,
            context_lens=np.array([c + n for c, n in plan]),
            block_size=bs,
        )
        k_cache, v_cache = pack_kv_blocks(k_cache, v_cache)  # into the engine's layout
        new_k = np.concatenate([k[c:] for k, (c, _) in zip(full_k, plan, strict=True)])
        new_v = np.concatenate([v[c:] for v, (c, _) in zip(full_v, plan, strict=True)])
        write_kv(k_cache, v_cache, new_k, new_v, meta.slot_mapping)
        got = paged_attention(np.concatenate(qs), k_cache, v_cache, meta)  # [N, H, D]
        for i, (q, k, v) in enumerate(zip(qs, full_k, full_v, strict=True)):
            want, _ = scaled_dot_product_attention(
                q.transpose(1, 0, 2)[None],
                k.transpose(1, 0, 2)[None],
                v.transpose(1, 0, 2)[None],
                is_causal=True,
            )  # [1, H, n, D]
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            np.testing.assert_allclose(got[start:end], want[0].transpose(1, 0, 2), rtol=1e-12, atol=1e-12)
        if all(n == 1 for _, n in plan):  # a decode step: the compiled kernel and its oracle must agree
            q = np.concatenate(qs)  # [R, H, D]
            lens = meta.context_lens.astype(np.int32)
            reference = reference_paged_decode_attention(q, k_cache, v_cache, block_tables, lens)
            np.testing.assert_allclose(reference, got, rtol=1e-12, atol=1e-12)
            decoded = paged_decode_attention(q, k_cache, v_cache, block_tables, lens)  # the engine's path
            np.testing.assert_allclose(decoded, got, rtol=1e-12, atol=1e-12)

    def test_paged_attention_equals_contiguous_attention_for_shuffled_block_tables(self) -> None:
        # A decode, a chunk ending on a block boundary, a whole prefill.
        self.check_plan([(9, 1), (5, 3), (0, 7)], bs=4, seed=0)

    @settings(max_examples=40, deadline=None)
    @given(
        plan=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=4),
        bs=st.sampled_from([1, 2, 4, 5, 16]),
        seed=st.integers(0, 2**16),
    )
    def test_paged_attention_equals_contiguous_attention_for_any_plan(
        self, plan: list[tuple[int, int]], bs: int, seed: int
    ) -> None:
        self.check_plan(plan, bs, seed)

    @settings(max_examples=40, deadline=None)
    @given(
        cached=st.lists(st.integers(0, 40), min_size=1, max_size=5),
        bs=st.sampled_from([1, 3, 4, 16]),
        seed=st.integers(0, 2**16),
    )
    def test_paged_decode_attention_equals_contiguous_attention_for_any_decode_batch(
        self, cached: list[int], bs: int, seed: int
    ) -> None:
        self.check_plan([(c, 1) for c in cached], bs, seed)


class TestCompiledLayers(unittest.TestCase):
    """The compiled small layers against their NumPy formulas evaluated in float64."""

    def test_compiled_layers_equal_the_numpy_formulas_in_float64(self) -> None:
        rng = np.random.default_rng(5)
        for dtype, rtol in ((np.float32, 2e-6), (np.float64, 1e-13)):
            for n in (1, 3, 8):
                x = (rng.standard_normal((n, 48)) * 3).astype(dtype)  # [N, C]
                w = rng.standard_normal(48).astype(dtype)
                got = compiled_rms_norm(x, w, 1e-5)
                want = rms_norm(x.astype(np.float64), w.astype(np.float64), 1e-5)
                self.assertEqual(got.dtype, np.dtype(dtype))
                np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
                # Gates far in both tails (where exp(-g) would overflow) and exactly zero.
                gate_up = (rng.standard_normal((n, 2 * 40)) * 4).astype(dtype)  # [N, 2I]
                gate_up[0, :4] = [-200.0, 200.0, 0.0, -0.0]
                got = compiled_silu_and_mul(gate_up)
                want = silu_and_mul(gate_up.astype(np.float64))
                self.assertEqual((got.shape, got.dtype), ((n, 40), np.dtype(dtype)))
                np.testing.assert_allclose(got, want, rtol=4 * rtol, atol=rtol)
                padded = np.zeros((n, 2 * 40 + 16), dtype=dtype)  # as `linear` returns a padded output
                padded[:, :80] = gate_up
                np.testing.assert_array_equal(compiled_silu_and_mul(padded[:, :80]), got)
                # q and k heads inside a fused [N, (H + 2 H_kv) D] qkv row, as the model passes them.
                h, h_kv, d = 3, 1, 8
                qkv = rng.standard_normal((n, (h + 2 * h_kv) * d)).astype(dtype)
                cos, sin = rope_cos_sin(np.arange(7, 7 + n), rope_inv_freq(d, 10000.0), dtype)  # [N, D]
                for start, heads in ((0, h), (h * d, h_kv)):
                    got = compiled_rotary(qkv, start, heads, cos, sin)
                    x64 = qkv[:, start : start + heads * d].reshape(n, heads, d).astype(np.float64)
                    want = apply_rotary(x64, cos.astype(np.float64), sin.astype(np.float64))
                    self.assertTrue(got.flags.c_contiguous)
                    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)


class TestLinear(unittest.TestCase):
    def test_both_gemm_paths_equal_the_float64_product(self) -> None:
        # Row counts around every tile height of the packed kernel (8, 4, 2, 1), output widths that are
        # and are not a multiple of its panel width, and a strided x as layers pass on.
        rng = np.random.default_rng(0)
        for c_out in (37, 64):
            w = rng.standard_normal((c_out, 19)).astype(np.float32)
            want_w = w.astype(np.float64)
            for path in ("numpy", "packed"):
                weight = LinearWeight.of(w, path)
                np.testing.assert_array_equal(weight.dense(), w)
                for n in (1, 2, 3, 7, 8, 13, 17):
                    x = rng.standard_normal((19, n)).astype(np.float32).T  # [n, 19], a strided view
                    got = linear(x, weight)
                    self.assertEqual((got.shape, got.dtype), ((n, c_out), np.dtype(np.float32)))
                    np.testing.assert_allclose(got, x.astype(np.float64) @ want_w.T, rtol=1e-5, atol=1e-5)

    def test_packed_model_picks_the_same_greedy_tokens_as_the_numpy_model(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            folder = write_random_checkpoint(Path(tmp) / "m", "llama", "tiny", seed=3)
            picks = []
            for gemm in ("numpy", "packed"):
                model = Model.load(folder, "float32", gemm)
                self.assertEqual(model.gemm_path, gemm)
                runner = ModelRunner(model, EngineConfig(block_size=4), num_blocks=8)
                reqs = [
                    FakeRequest(r, list(range(1 + i, 6 + i)), 0, [2 * i, 2 * i + 1])
                    for i, r in enumerate("ab")
                ]
                n = 5
                for _ in range(3):  # a prefill of 2 x 5 tokens, then two decode steps of 2 rows
                    logits = runner.execute_model(FakeSchedulerOutput(reqs, {r.request_id: n for r in reqs}))  # type: ignore[arg-type]
                    for row, req in enumerate(reqs):
                        req.num_computed_tokens += n
                        req.all_token_ids.append(int(np.argmax(logits[row])))
                    n = 1
                picks.append([r.all_token_ids for r in reqs])
            self.assertEqual(picks[0], picks[1])

    def test_packed_path_needs_float32(self) -> None:
        with self.assertRaisesRegex(ValueError, "float32"):
            resolve_gemm_path("packed", "float64")
        self.assertEqual(resolve_gemm_path("auto", "float64")[0], "numpy")


class TestModelRunner(EngineModelTestBase):
    def run_alone(self, model: Model, tokens: list[int]) -> np.ndarray:
        """Last-token logits of `tokens` computed in one step on a fresh runner."""
        runner = ModelRunner(model, EngineConfig(block_size=4, dtype="float64"), num_blocks=16)
        req = FakeRequest("x", list(tokens), 0, list(range(-(-len(tokens) // 4))))
        return runner.execute_model(FakeSchedulerOutput([req], {"x": len(tokens)}))[0]  # type: ignore[arg-type]

    def test_chunked_prefill_and_decode_in_flattened_batches_equal_the_full_prompt(self) -> None:
        # Three requests over shuffled blocks of 4; chunks end mid-block and exactly on block boundaries
        # (4, 12, 16), requests join and finish in different steps, then all three decode one token.
        lengths = {"a": 23, "b": 9, "c": 16}
        steps = [{"a": 4, "b": 3}, {"a": 8, "b": 6, "c": 5}, {"a": 11, "c": 11}]
        for arch in ARCHS:
            with self.subTest(arch=arch):
                model = Model.load(self.folders[arch], "float64")
                runner = ModelRunner(model, EngineConfig(block_size=4, dtype="float64"), num_blocks=20)
                free = [int(b) for b in np.random.default_rng(5).permutation(20)]
                reqs = {
                    rid: FakeRequest(
                        rid, self.prompt(n, seed=i + 10), 0, [free.pop() for _ in range(-(-n // 4))]
                    )
                    for i, (rid, n) in enumerate(lengths.items())
                }
                for step in steps:
                    out = FakeSchedulerOutput([reqs[r] for r in step], dict(step))
                    logits = runner.execute_model(out)  # type: ignore[arg-type]
                    for row, rid in enumerate(step):
                        reqs[rid].num_computed_tokens += step[rid]
                        if reqs[rid].num_computed_tokens == lengths[rid]:
                            want = self.run_alone(model, reqs[rid].all_token_ids)
                            np.testing.assert_allclose(logits[row], want, rtol=1e-9, atol=1e-9)
                for rid, req in reqs.items():  # one decode token each; "c" needs a fifth block
                    req.all_token_ids.append(int(np.argmax(self.run_alone(model, req.all_token_ids))))
                    if len(req.all_token_ids) > 4 * len(req.block_ids):
                        req.block_ids.append(free.pop())
                    self.assertEqual(req.num_computed_tokens, lengths[rid])
                out = FakeSchedulerOutput(list(reqs.values()), dict.fromkeys(reqs, 1))
                logits = runner.execute_model(out)  # type: ignore[arg-type]
                for row, req in enumerate(reqs.values()):
                    np.testing.assert_allclose(
                        logits[row], self.run_alone(model, req.all_token_ids), rtol=1e-9, atol=1e-9
                    )

    def test_a_decode_gives_the_same_bits_beside_a_prefill_as_alone(self) -> None:
        # Batch invariance: request a's decode token in a step that also prefills b equals, bit for bit,
        # its decode in a step of its own. With 8-bit activations each row of a linear layer is
        # quantized and multiplied alone, so only attention could tell the two steps apart.
        model = Model.load(self.folders["llama"], "float32", quantization="q8_0", activations="int8")
        logits = []
        for with_prefill in (False, True):
            runner = ModelRunner(model, EngineConfig(block_size=4, dtype="float32"), num_blocks=8)
            a = FakeRequest("a", self.prompt(9), 0, [5, 1, 6])
            runner.execute_model(FakeSchedulerOutput([a], {"a": 9}))  # type: ignore[arg-type]
            a.num_computed_tokens, a.all_token_ids = 9, [*a.all_token_ids, 3]
            step = FakeSchedulerOutput([a], {"a": 1})
            if with_prefill:
                b = FakeRequest("b", self.prompt(7, seed=1), 0, [0, 7])
                step = FakeSchedulerOutput([a, b], {"a": 1, "b": 7})
            logits.append(runner.execute_model(step)[0])  # type: ignore[arg-type]
        np.testing.assert_array_equal(logits[1], logits[0])

    def test_execute_model_rejects_missing_blocks_before_touching_the_cache(self) -> None:
        model = Model.load(self.folders["llama"], "float64")
        runner = ModelRunner(model, EngineConfig(block_size=4, dtype="float64"), num_blocks=4)
        req = FakeRequest("a", self.prompt(9), 0, [0, 1])  # 9 positions need 3 blocks
        with self.assertRaisesRegex(ValueError, "must cover 9 positions"):
            runner.execute_model(FakeSchedulerOutput([req], {"a": 9}))  # type: ignore[arg-type]
        self.assertTrue(all(not k.any() and not v.any() for k, v in runner.kv_caches))
        with self.assertRaisesRegex(ValueError, "0 scheduled tokens"):
            runner.execute_model(FakeSchedulerOutput([req], {"a": 0}))  # type: ignore[arg-type]
        for bad in (-1, model.config.vocab_size):  # the one check of token ids: the model trusts them
            req = FakeRequest("b", [1, bad, 2], 0, [0])
            with self.assertRaisesRegex(ValueError, str(bad)):
                runner.execute_model(FakeSchedulerOutput([req], {"b": 3}))  # type: ignore[arg-type]
        self.assertTrue(all(not k.any() and not v.any() for k, v in runner.kv_caches))

    def test_runner_refuses_a_dtype_other_than_the_models(self) -> None:
        model = Model.load(self.folders["qwen2"], "float32")
        with self.assertRaisesRegex(ValueError, "must be the model's dtype 'float32'"):
            ModelRunner(model, EngineConfig(dtype="float64"), num_blocks=4)

    def test_bytes_per_block_equals_the_allocated_buffers_per_block(self) -> None:
        model = Model.load(self.folders["qwen3"], "float32")
        runner = ModelRunner(model, EngineConfig(block_size=8, dtype="float32"), num_blocks=5)
        allocated = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
        self.assertEqual(ModelRunner.bytes_per_block(model.config, 8, "float32") * 5, allocated)
        self.assertEqual(runner.kv_caches[0][0].shape, (5, 2, 32, 8))  # [NB, H_kv, D, BS]
        self.assertEqual(runner.kv_caches[0][1].shape, (5, 2, 8, 32))  # [NB, H_kv, BS, D]


if __name__ == "__main__":
    unittest.main()
