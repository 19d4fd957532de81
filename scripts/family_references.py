"""Write the tiny Gemma 2 / Gemma 3 / Phi-3 checkpoints and transformers' float64 greedy tokens under tests/data.

Run in a scratch environment with torch and transformers (never in CI; the tests read what it wrote):

    python scripts/family_references.py --out tests/data

For each family: a random model built by transformers (`Gemma3ForCausalLM`, `Gemma2ForCausalLM`;
6 / 4 layers, hidden 64, head_dim 32, the tiny SentencePiece vocabulary of tests/gguf_files.py) saved
with `save_pretrained` in bfloat16 (safetensors) plus a word-level tokenizer.json over the same
vocabulary, and `reference.json`: its greedy continuation of each prompt, by full recompute per token
(no cache), from the saved weights widened to float64 with eager attention. transformers computes
Gemma's RMSNorm, RoPE angles and the attention softmax in float32 even for a float64 model; those
three are patched here to run in the model's dtype, so the reference is float64 throughout. Each
prompt's smallest top-1 / top-2 logit gap is recorded (`min_gap`) for the float32 comparison.

Then the GGUF file `tests/gguf_families.family_gguf` writes for the folder is loaded with transformers'
own GGUF reader (`gguf_file=`), and its tensors must equal the folder's (transformers subtracts the 1
llama.cpp's converter added to every Gemma norm): a check that the test's GGUF files follow llama.cpp's
names and conventions. (transformers' reader maps no sliding window for phi3, so that one setting is
compared for Gemma only.)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from gguf_families import family_gguf  # noqa: E402
from gguf_files import sentencepiece_tokens  # noqa: E402

TOKENS = sentencepiece_tokens()[0]
EMBED_STD, NORM_STD = 0.05, 0.5  # a residual stream the layers, not the token embedding, dominate
COMMON = dict(
    vocab_size=len(TOKENS),
    hidden_size=64,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    query_pre_attn_scalar=32,  # llama.cpp's scale for these files: 1 / sqrt(head_dim)
    max_position_embeddings=256,
    sliding_window=6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=True,
)
FAMILIES = {
    # 6 layers: the default sliding_window_pattern 6 (5 sliding, 1 global), as llama.cpp assumes
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=6,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            num_hidden_layers=3,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            original_max_position_embeddings=256,
            tie_word_embeddings=False,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            num_hidden_layers=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attn_logit_softcapping=5.0,  # small caps so tanh bends the tiny model's scores and logits
            final_logit_softcapping=3.0,
        ),
    ),
}


def prompts() -> list[list[int]]:
    """Token ids: two prompts longer than the window sharing 16 tokens (4 blocks of 4), and a short one."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, len(TOKENS), (60,), generator=g).tolist()
    return [ids[:23], ids[:16] + ids[30:41], ids[45:49]]


def patched(mod: object, gemma: bool = True) -> None:
    norm_cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RMSNorm"))
    rope_cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("RotaryEmbedding"))

    def norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        eps = getattr(self, "eps", None) or self.variance_epsilon
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return out * ((1.0 if gemma else 0.0) + self.weight.to(x.dtype))

    def rope_forward(self: torch.nn.Module, x: torch.Tensor, position_ids: torch.Tensor, layer_type=None):
        config = self.config
        params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if params.get("rope_type") == "linear":
            inv = inv / params["factor"]
        freqs = position_ids[..., None].to(torch.float64) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
        key = mod.repeat_kv(key, module.num_key_value_groups)
        value = mod.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, key.transpose(2, 3)) * scaling
        if softcap is not None:
            w = torch.tanh(w / softcap) * softcap
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.softmax(w, dim=-1)
        return torch.matmul(w, value).transpose(1, 2).contiguous(), w

    norm_cls.forward = norm_forward
    rope_cls.forward = rope_forward
    mod.eager_attention_forward = eager


def greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], float]:
    ids = list(prompt)
    gap = math.inf
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(logits, 2)
        gap = min(gap, float(top.values[0] - top.values[1]))
        ids.append(int(top.indices[0]))
    return ids[len(prompt) :], gap


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOKENS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_family(name: str, out: Path, max_tokens: int) -> None:
    config_cls, model_cls, extra = FAMILIES[name]
    common = dict(COMMON)
    if name == "phi3":  # no Gemma keys; head_dim is hidden / heads
        for key in ("head_dim", "query_pre_attn_scalar"):
            common.pop(key)
    config = getattr(transformers, config_cls)(**(common | extra))
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # spread the logits so greedy choices are not near-ties
        for pname, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, EMBED_STD if "embed" in pname else 1.0 / math.sqrt(p.shape[1]))
            elif pname == "model.norm.weight":
                p.normal_(
                    4.0 if name != "phi3" else 5.0, NORM_STD
                )  # a final norm of about 5 widens the logits' spread
            else:
                p.normal_(0.0 if name != "phi3" else 1.0, NORM_STD)  # Gemma's norms scale by 1 + w
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)
    write_tokenizer(folder)
    patched(sys.modules[type(model).__module__], gemma=name != "phi3")
    ref = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    tokens, gaps = [], []
    for prompt in prompts():
        t, gap = greedy(ref, prompt, max_tokens)
        tokens.append(t)
        gaps.append(gap)
    reference = {"prompts": prompts(), "max_tokens": max_tokens, "tokens": tokens, "min_gap": gaps}
    (folder / "reference.json").write_text(json.dumps(reference) + "\n")
    print(name, "min gaps", [round(g, 4) for g in gaps])
    check_gguf(folder, ref)


def check_gguf(folder: Path, ref: torch.nn.Module) -> None:
    """transformers reads our GGUF file back to the folder's tensors (Gemma's norms without the added 1)."""
    with tempfile.TemporaryDirectory() as tmp:
        gguf = family_gguf(folder, Path(tmp) / "model.gguf")
        loaded = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=gguf.name, dtype=torch.float64)
        theirs = loaded.state_dict()
        for key, value in ref.state_dict().items():
            if key == "lm_head.weight" and ref.config.tie_word_embeddings:
                continue
            if not torch.equal(theirs[key], value):
                raise SystemExit(f"{folder.name}: GGUF tensor {key} differs after transformers' GGUF load")
        cfg = loaded.config
        assert folder.name == "phi3" or cfg.sliding_window == ref.config.sliding_window, (
            cfg.sliding_window,
            ref.config.sliding_window,
        )
        print(folder.name, "GGUF: transformers reads back", len(theirs), "equal tensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "data")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--max-tokens", type=int, default=10)
    args = parser.parse_args()
    for name in args.families.split(","):
        write_family(name, args.out, args.max_tokens)


if __name__ == "__main__":
    main()
