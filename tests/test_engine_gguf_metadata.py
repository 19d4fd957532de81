"""The lazy GGUF header reader (model_executor/gguf_metadata.py) against the `gguf` library's own GGUFReader.

Oracle: GGUFReader on files written by GGUFWriter (every value type, arrays of numbers and strings,
nested arrays, tensors of several GGML types) and on the project's real model: the same keys, value
types, values, tensor names, types, dims, offsets and bytes. Malformed files: one CheckpointError,
one line, naming the file and the offending value.
"""

from __future__ import annotations

import struct
import tempfile
import unittest
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from attention_kv_caceh.model_executor.checkpoint import CheckpointError
from attention_kv_caceh.model_executor.gguf_metadata import GGUFFile, open_gguf
from attention_kv_caceh.model_executor.model_source import resolve_model

T = GGMLQuantizationType
V = GGUFValueType
_PSEUDO = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # GGUFReader's own fields

SCALARS: dict[str, tuple[Any, GGUFValueType]] = {
    "t.u8": (250, V.UINT8),
    "t.i8": (-120, V.INT8),
    "t.u16": (65000, V.UINT16),
    "t.i16": (-32000, V.INT16),
    "t.u32": (4_000_000_000, V.UINT32),
    "t.i32": (-2_000_000_000, V.INT32),
    "t.u64": (2**63 + 5, V.UINT64),
    "t.i64": (-(2**62), V.INT64),
    "t.f32": (1.5, V.FLOAT32),
    "t.f64": (-2.25e300, V.FLOAT64),
    "t.bool": (True, V.BOOL),
    "t.false": (False, V.BOOL),
    "t.str": ("héllo ▁ 日本 \U0001f600\n", V.STRING),
    "t.empty_str": ("", V.STRING),
}


def flatten(value: Any) -> Any:
    """GGUFReader's `contents()` flattens nested arrays into one list."""
    if isinstance(value, list) and any(isinstance(v, list) for v in value):  # pyright: ignore[reportUnknownVariableType]
        return [x for v in value for x in flatten(v)]  # pyright: ignore[reportUnknownVariableType]
    return value


def write_every_type(path: Path) -> Path:
    writer = GGUFWriter(str(path), "llama")
    for key, (value, kind) in SCALARS.items():
        writer.add_key_value(key, value, kind)
    for kind, dtype in ((V.UINT8, np.uint8), (V.INT16, np.int16), (V.UINT32, np.uint32), (V.INT64, np.int64)):
        writer.add_key_value(f"a.{kind.name}", [int(x) for x in np.arange(5, dtype=dtype)], V.ARRAY, kind)
    writer.add_key_value("a.f32", [0.5, -1.25, 3.0], V.ARRAY, V.FLOAT32)
    writer.add_key_value("a.f64", [0.1, 1e-300], V.ARRAY, V.FLOAT64)
    writer.add_key_value("a.bool", [True, False, True], V.ARRAY, V.BOOL)
    writer.add_key_value("a.str", ["a", "", "▁b", "<0x0A>", "日本", "\U0001f600"], V.ARRAY, V.STRING)
    writer.add_array("a.nested", [[1, 2], [3, 4, 5]])
    writer.add_array("a.nested_str", [["x", "yz"], ["w"]])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 8)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 5, 4)).astype(np.float16))
    for qtype in (T.Q8_0, T.Q4_0, T.Q4_1):
        values = rng.standard_normal((4, 64)).astype(np.float32)
        writer.add_tensor(qtype.name.lower(), quantize(values, qtype), raw_dtype=qtype)
    # a K-quant (gguf has no quantizer for it): raw blocks, two super-blocks of 210 bytes a row
    writer.add_tensor("q6_k", rng.integers(0, 256, (3, 420), dtype=np.uint8), raw_dtype=T.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class OracleTest(unittest.TestCase):
    def assert_same_as_reader(self, path: Path) -> None:
        ours, reader = GGUFFile(path), GGUFReader(path)
        self.assertEqual(ours.keys, [k for k in reader.fields if k not in _PSEUDO])
        for key in ours.keys:
            field = reader.fields[key]
            with self.subTest(key=key):
                self.assertEqual(ours.types(key), list(field.types))
                self.assertEqual(flatten(ours.value(key)), field.contents())
        self.assertEqual(ours.version, int(reader.fields["GGUF.version"].contents()))
        self.assertEqual((ours.alignment, ours.data_offset), (reader.alignment, reader.data_offset))
        self.assertEqual(len(ours.tensors), len(reader.tensors))
        for mine, theirs in zip(ours.tensors, reader.tensors, strict=True):
            with self.subTest(tensor=theirs.name):
                self.assertEqual(mine.name, theirs.name)
                self.assertEqual(mine.tensor_type, theirs.tensor_type)
                self.assertEqual(list(mine.dims), theirs.shape.tolist())
                self.assertEqual(
                    (mine.offset, mine.n_bytes, mine.n_elements),
                    (theirs.data_offset, theirs.n_bytes, theirs.n_elements),
                )
                self.assertEqual((mine.data.dtype, mine.data.shape), (theirs.data.dtype, theirs.data.shape))
                self.assertEqual(mine.data.tobytes(), np.asarray(theirs.data).tobytes())

    def test_every_value_type_and_tensor_type_as_the_library_reads_it(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_every_type(Path(tmp) / "all.gguf")
            self.assert_same_as_reader(path)
            ours = GGUFFile(path)
            for key, (value, _) in SCALARS.items():
                self.assertEqual(ours.value(key), value)  # each value exact in its type
            self.assertEqual(ours.value("a.nested"), [[1, 2], [3, 4, 5]])  # kept nested here
            self.assertEqual(ours.value("a.nested_str"), [["x", "yz"], ["w"]])
            scores = ours.array("a.f32")
            assert scores is not None
            self.assertEqual(scores.dtype, np.float32)
            self.assertEqual(scores.tolist(), [0.5, -1.25, 3.0])
            self.assertFalse(scores.flags.writeable)
            self.assertIsNone(ours.array("a.str"))
            self.assertIsNone(ours.value("absent"))
            self.assertEqual(ours.types("absent"), [])

    def test_the_real_model_as_the_library_reads_it(self) -> None:
        self.assert_same_as_reader(resolve_model("smollm2").path)

    def test_open_gguf_parses_a_file_version_once(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = write_every_type(Path(tmp) / "all.gguf")
            self.assertIs(open_gguf(path), open_gguf(path))


class MalformedTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls._tmp = tempfile.TemporaryDirectory()
        cls.root = Path(cls._tmp.name)
        writer = GGUFWriter(str(cls.root / "good.gguf"), "llama")
        writer.add_string("dup.a", "x")
        writer.add_string("dup.b", "y")
        writer.add_array("names", ["one", "two", "three"])
        writer.add_tensor("w", np.ones((2, 32), dtype=np.float32))
        writer.add_tensor("v", np.ones((32,), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        cls.good = cls.root / "good.gguf"
        cls.data = cls.good.read_bytes()
        cls.reader = GGUFReader(cls.good)

    @classmethod
    def tearDownClass(cls) -> None:
        cls._tmp.cleanup()

    def refused(self, data: bytes, name: str) -> str:
        """The one-line message of the CheckpointError reading `data` raises, which names the file."""
        path = self.root / name
        path.write_bytes(data)
        with self.assertRaises(CheckpointError) as caught:
            GGUFFile(path)
        message = str(caught.exception)
        self.assertTrue(message.startswith(f"{path}: "), message)
        self.assertEqual(len(message.splitlines()), 1, message)
        return message

    def patched(self, offset: int, raw: bytes) -> bytes:
        return self.data[:offset] + raw + self.data[offset + len(raw) :]

    def tensor_field_offset(self, index: int) -> int:
        """Byte offset of tensor `index`'s u64 data offset in its info (the info's last 8 bytes)."""
        field = self.reader.tensors[index].field
        return field.offset + sum(int(p.nbytes) for p in field.parts) - 8

    def test_the_good_file_reads(self) -> None:
        self.assertEqual(GGUFFile(self.good).value("names"), ["one", "two", "three"])

    def test_every_truncation_of_the_header_and_data(self) -> None:
        for size in range(len(self.data)):  # every cut, the header's bytes and the tensors'
            with self.subTest(size=size):
                message = self.refused(self.data[:size], "cut.gguf")
                self.assertTrue("truncated" in message or "not a GGUF file" in message, message)

    def test_bad_magic_version_and_byte_order(self) -> None:
        self.assertIn("b'GGML'", self.refused(self.patched(0, b"GGML"), "magic.gguf"))
        self.assertIn("version 7", self.refused(self.patched(4, struct.pack("<I", 7)), "v7.gguf"))
        self.assertIn("version 1 ", self.refused(self.patched(4, struct.pack("<I", 1)), "v1.gguf"))
        self.assertIn("big-endian", self.refused(self.patched(4, struct.pack(">I", 3)), "be.gguf"))

    def test_a_string_past_the_end(self) -> None:
        message = self.refused(self.patched(24, struct.pack("<Q", 10**12)), "long.gguf")
        self.assertIn(f"{10**12:,}", message)

    def test_a_huge_count(self) -> None:
        self.assertIn(f"{2**40:,}", self.refused(self.patched(16, struct.pack("<Q", 2**40)), "keys.gguf"))

    def test_an_unknown_value_type(self) -> None:
        at = 24 + 8 + len("general.architecture")
        message = self.refused(self.patched(at, struct.pack("<I", 99)), "vtype.gguf")
        self.assertIn("99", message)
        self.assertIn("general.architecture", message)

    def test_a_duplicate_key_and_tensor(self) -> None:
        at = self.data.index(b"dup.b")
        self.assertIn("'dup.a'", self.refused(self.patched(at, b"dup.a"), "dupkey.gguf"))
        at = self.data.index(struct.pack("<Q", 1) + b"v")
        self.assertIn("'w'", self.refused(self.patched(at + 8, b"w"), "duptensor.gguf"))

    def test_unaligned_and_out_of_file_tensor_offsets(self) -> None:
        at = self.tensor_field_offset(1)
        offset = int(self.reader.tensors[1].field.parts[-1][0])
        self.assertIn(
            f"{offset + 4:,}", self.refused(self.patched(at, struct.pack("<Q", offset + 4)), "unaligned.gguf")
        )
        far = 1 << 30
        self.assertIn("'v'", self.refused(self.patched(at, struct.pack("<Q", far)), "far.gguf"))

    def test_too_many_dimensions(self) -> None:
        at = self.reader.tensors[0].field.offset + 8 + len("w")  # after the name "w"
        self.assertIn("5 dimensions", self.refused(self.patched(at, struct.pack("<I", 5)), "dims.gguf"))

    def test_an_unknown_tensor_type(self) -> None:
        at = self.tensor_field_offset(0) - 4
        self.assertIn("200", self.refused(self.patched(at, struct.pack("<I", 200)), "ttype.gguf"))

    def test_a_key_that_is_not_utf8(self) -> None:
        at = self.data.index(b"dup.a")
        self.assertIn("UTF-8", self.refused(self.patched(at, b"\xff"), "utf8.gguf"))

    def test_a_bad_alignment(self) -> None:
        writer = GGUFWriter(str(self.root / "align.gguf"), "llama")
        writer.add_uint32("general.alignment", 48)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        with self.assertRaises(CheckpointError) as caught:
            GGUFFile(self.root / "align.gguf")
        self.assertIn("48", str(caught.exception))


if __name__ == "__main__":
    unittest.main()
