"""Check the engine's SentencePiece tokenizer from GGUF metadata against transformers' on the same files.

transformers is not a dependency of this project: give the Python of an environment that has it
(transformers, torch, sentencepiece, gguf), and this runs `AutoTokenizer.from_pretrained(folder,
gguf_file=name)` there for each file, then compares the ids (with and without special tokens) and
the decoded text with the engine's `Tokenizer.load(file)`:

    uv run python scripts/check_gguf_sentencepiece.py --transformers-python /path/to/venv/bin/python \
        [--texts LINES.txt] [FILE.gguf ...]

Without files it writes the suite's tiny vocabulary (tests/gguf_files.py: `write_sentencepiece`) with
each setting of add_bos_token / add_eos_token / add_space_prefix and checks those; the ids the suite's
test asserts (tests/test_engine_gguf_sentencepiece.py) are printed for the default file. Prints one line
per file and text that differs; exits 1 on any difference, except on the file with add_space_prefix
false: transformers ignores that key (its GGUF builder does not read it), the engine follows llama.cpp
and adds no prefix space, so their differences there are printed as expected.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from attention_kv_caceh.engine.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's tests.gguf_files
from tests.gguf_files import write_sentencepiece

CORPUS = [
    "hello world",
    "Hello World",
    " hello  world ",
    "   three leading spaces",
    "the world\nhello\n\nworld\r\n",
    "tab\tthe",
    "12 123 31 2024",
    "日本 日本語",
    "emoji 😀👍🏽 done",
    "ünïcödé café",
    "control \x00\x01 bytes",
    "<s>hello</s>",
    "<unk> hello",
    "<|tool|>hello<|end|>",
    "hello<|tool|> world",
    "",
    " ",
    "\n",
]

_HF = r"""
import json, sys
from pathlib import Path
from transformers import AutoTokenizer
corpus = json.loads(sys.stdin.read())
out = {}
for name in sys.argv[1:]:
    path = Path(name)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    plain = [tok.encode(t, add_special_tokens=False) for t in corpus]
    out[name] = {
        "ids": [tok.encode(t) for t in corpus],
        "plain": plain,
        "decoded": [tok.decode(i, skip_special_tokens=True) for i in plain],
    }
print(json.dumps(out))
"""


def ours(path: Path) -> dict[str, list[object]]:
    tok = Tokenizer.load(path)
    plain = [tok.encode(t, add_special_tokens=False) for t in CORPUS]
    return {
        "ids": [tok.encode(t) for t in CORPUS],
        "plain": list(plain),
        "decoded": [tok.decode(i) for i in plain],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--transformers-python", required=True, help="python of an environment with transformers"
    )
    parser.add_argument(
        "files", nargs="*", type=Path, help="GGUF files (default: the suite's tiny vocabulary)"
    )
    parser.add_argument("--texts", type=Path, help="a UTF-8 file whose lines are checked too")
    args = parser.parse_args()
    if args.texts is not None:
        CORPUS.extend(args.texts.read_text(encoding="utf-8").splitlines())
    with tempfile.TemporaryDirectory() as tmp:
        files: list[Path] = [f.resolve() for f in args.files]
        expected: set[Path] = set()  # files where transformers is known to differ
        if not files:
            settings = [{}, {"add_bos_token": False}, {"add_eos_token": True}, {"add_space_prefix": True}]
            settings += [{"add_space_prefix": False}]
            for i, flags in enumerate(settings):
                folder = Path(tmp) / f"sp{i}"
                folder.mkdir()
                files.append(write_sentencepiece(folder / "sp.gguf", **flags))
                if flags == {"add_space_prefix": False}:
                    expected.add(files[-1])
                print(f"{files[-1]}: {flags or 'no flags'}")
        run = subprocess.run(
            [args.transformers_python, "-c", _HF, *map(str, files)],
            input=json.dumps(CORPUS),
            capture_output=True,
            text=True,
            check=False,
        )
        if run.returncode:
            print(run.stderr, file=sys.stderr)
            return 1
        reference = json.loads(run.stdout.strip().splitlines()[-1])
        failed = False
        for file in files:
            mine, theirs = ours(file), reference[str(file)]
            wrong = [
                (kind, text, mine[kind][i], theirs[kind][i])
                for kind in ("ids", "plain", "decoded")
                for i, text in enumerate(CORPUS)
                if mine[kind][i] != theirs[kind][i]
            ]
            note = " (expected: transformers ignores add_space_prefix)" if file in expected else ""
            print(f"{file}: {len(CORPUS)} texts, {len(wrong)} differences{note}")
            for kind, text, a, b in wrong:
                print(f"  {kind} {text!r}: engine {a!r}, transformers {b!r}")
            failed = failed or (bool(wrong) and file not in expected)
        if not args.files:
            print("ids of the default file, for the suite's test:")
            for text, ids in zip(CORPUS, reference[str(files[0])]["ids"], strict=True):
                print(f"  {text!r}: {ids},")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
