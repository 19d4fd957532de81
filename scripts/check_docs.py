"""Run every command the README and docs/ mark runnable, in order, in a fresh copy of the repository.

    uv run python scripts/check_docs.py              # every marked block
    uv run python scripts/check_docs.py --list       # only list them
    uv run python scripts/check_docs.py --keep       # keep the temporary copy and print its path

Markers: a fenced ```bash block is run when the line just before its fence is `<!-- runnable -->` or
`<!-- runnable timeout=SECONDS -->` (default 300 s). Every other bash block must be preceded by
`<!-- not-run: why -->` (tests/test_docs.py checks that each block has exactly one marker). Files are
taken in the order of DOC_FILES, so README.md's `make-model` runs before the docs that use its model.
The copy holds the tracked and untracked, not ignored files (`git ls-files`), so it starts without
`.venv`, `results/` and `models/`, as a fresh clone does. Each block runs with `bash -e -o pipefail`
from the copy's root; its output is printed only when it fails. Exit status: 0 when every block
passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = (
    "README.md",
    "docs/lab.md",
    "docs/kernels.md",
    "docs/engine.md",
    "docs/serving.md",
    "docs/files.md",
    "docs/results.md",
)
DEFAULT_TIMEOUT_S = 300
_MARKER = re.compile(r"^<!--\s*(runnable(?:\s+timeout=(\d+))?|not-run:\s*\S.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its text and the marker before it."""

    path: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    runnable: bool
    not_run: bool
    timeout_s: int


def parse_blocks(path: str, text: str) -> list[Block]:
    """Every fenced block of a Markdown text, with the marker on the line before its fence (if any)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)", lines[i])
        if not fence:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        body = "\n".join(lines[start + 1 : i])
        marker = _MARKER.match(lines[start - 1]) if start > 0 else None
        runnable = bool(marker and marker.group(1).startswith("runnable"))
        timeout = int(marker.group(2)) if marker and marker.group(2) else DEFAULT_TIMEOUT_S
        not_run = bool(marker and marker.group(1).startswith("not-run"))
        blocks.append(Block(path, start + 1, fence.group(1), body, runnable, not_run, timeout))
        i += 1
    return blocks


def runnable_blocks(root: Path = ROOT) -> list[Block]:
    """The runnable blocks of DOC_FILES, in order."""
    found: list[Block] = []
    for name in DOC_FILES:
        found += [b for b in parse_blocks(name, (root / name).read_text(encoding="utf-8")) if b.runnable]
    return found


def fresh_copy(destination: Path) -> None:
    """Copy the tracked and untracked, not ignored files of the repository into destination."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the runnable blocks, run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = parser.parse_args()
    blocks = runnable_blocks()
    if args.list:
        for b in blocks:
            print(f"{b.path}:{b.line} (timeout {b.timeout_s} s)\n{b.text}\n")
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="check-docs-"))
    fresh_copy(workdir)
    print(f"fresh copy: {workdir}")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}  # the copy gets its own .venv
    failures = 0
    for b in blocks:
        first = b.text.strip().splitlines()[0]
        start = time.perf_counter()
        try:
            done = subprocess.run(
                ["bash", "-e", "-o", "pipefail", "-c", b.text],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=b.timeout_s,
            )
            status, output = str(done.returncode), done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            status = f"timeout after {b.timeout_s} s"
            output = "".join(x.decode() if isinstance(x, bytes) else x for x in (exc.stdout, exc.stderr) if x)
        seconds = time.perf_counter() - start
        ok = status == "0"
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {b.path}:{b.line}  {seconds:6.1f} s  {first[:90]}")
        if not ok:
            print(f"     exit {status}; last output:\n" + "\n".join(output.splitlines()[-30:]))
    print(f"{len(blocks) - failures} of {len(blocks)} blocks passed")
    if args.keep:
        print(f"kept {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
