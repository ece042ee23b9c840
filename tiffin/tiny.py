"""Deterministic tiny Hugging Face checkpoints (llama, mistral, qwen2, qwen3) built without any download.

`make_tiny_model(path, arch, **overrides)` writes config.json (hub spelling, e.g. llama3 `rope_scaling`),
model.safetensors, generation_config.json and a byte-level BPE tokenizer trained on the Python stdlib's own
text (pydoc topics, then stdlib sources for larger vocabularies; up to ~70k tokens). len(tokenizer) equals
config vocab_size exactly.

Special tokens (ids fixed, first in the vocab):
    0 <|pad|>       pad_token
    1 <|bos|>       bos_token; the tokenizer prepends it to every encoded text (llama style)
    2 <|im_start|>  opens a chat turn
    3 <|im_end|>    closes a chat turn; the eos_token, so generation stops at the end of a turn
The chat template is ChatML: `<|bos|><|im_start|>{role}\n{content}<|im_end|>\n ...` and, with
add_generation_prompt, `<|im_start|>assistant\n`. It starts with the bos token itself, so a rendered chat
must be encoded with add_special_tokens=False (as transformers and vLLM do).
llama/mistral split text GPT-2 style with no normaliser (decode(encode(s)) == s for any s without special-token text);
qwen2/qwen3 use the Qwen pipeline transformers' Qwen2Tokenizer imposes (NFC first, so only NFC text
round-trips exactly).

Weights are random but shaped for greedy-parity testing: every parameter HF would initialise to a constant
(RMSNorm scales, q_norm/k_norm, biases) is randomised, and projections are scaled so that greedy decoding
wanders instead of looping on a token and top-1/top-2 logit gaps sit far above float32 noise (median ~0.4).
Being random, greedy output can still hit <|im_end|> (about 1/vocab per step): parity runs should ignore eos.

CLI: python -m tiffin.tiny PATH [--arch llama|mistral|qwen2|qwen3] [--seed N] [--set key=json_value ...]
"""

import argparse
import json
import pathlib
import sysconfig
import zlib

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|im_start|>", "<|im_end|>")
PAD_ID, BOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
NUM_BYTES = 256  # byte-level alphabet: every byte is a token, so any text is encodable
CORPUS_CHARS_PER_TOKEN = 256  # enough stdlib text per vocab entry for BPE to find that many merges

# transformers' Qwen2Tokenizer (forced for model_type qwen2, declared for qwen3 as on the hub) pre-tokenises
# with this pattern, whatever tokenizer.json says.
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{ part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
    max_position_embeddings=1024,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    rope_theta=10000.0,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    use_cache=True,
    bos_token_id=BOS_ID,
    eos_token_id=IM_END_ID,
    pad_token_id=PAD_ID,
    dtype="float32",
)
ARCH_CONFIGS: dict[str, dict] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        attention_bias=False,
        mlp_bias=False,
        # Small original length so the llama3 frequency rescaling changes outputs at test lengths.
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", num_key_value_heads=1, sliding_window=None
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        num_key_value_heads=4,
        tie_word_embeddings=True,
        use_sliding_window=False,
        sliding_window=None,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        head_dim=32,
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
    ),
}
_EXTRA_KEYS = {"head_dim", "rope_scaling", "sliding_window", "attention_bias", "mlp_bias"}
_GAINS = {"q_proj": 3.0, "k_proj": 3.0, "o_proj": 4.0, "down_proj": 4.0}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def make_config(arch: str = "llama", **overrides) -> dict:
    """The config.json dict for `arch` with `overrides` applied (rope_scaling=None drops the scaling)."""
    if arch not in ARCH_CONFIGS:
        raise ValueError(f"arch must be one of {sorted(ARCH_CONFIGS)}, got {arch!r}")
    config = {**_COMMON, **ARCH_CONFIGS[arch]}
    unknown = set(overrides) - set(config) - _EXTRA_KEYS
    if unknown:
        raise ValueError(f"unknown config override(s) for {arch}: {sorted(unknown)}")
    config.update(overrides)
    if config.get("rope_scaling", 0) is None:
        del config["rope_scaling"]
    if arch == "qwen2":
        config["max_window_layers"] = config["num_hidden_layers"]
    _validate(config)
    return config


def _validate(config: dict) -> None:
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
    ):
        if not isinstance(config[key], int) or isinstance(config[key], bool) or config[key] < 1:
            raise ValueError(f"{key} must be a positive integer, got {config[key]!r}")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    if "head_dim" not in config and config["hidden_size"] % heads:
        raise ValueError(f"hidden_size ({config['hidden_size']}) must be divisible by num_attention_heads ({heads})")
    if head_dim(config) % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim(config)}")
    if config["vocab_size"] < NUM_BYTES + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be >= {NUM_BYTES + len(SPECIAL_TOKENS)} (bytes + special tokens), "
            f"got {config['vocab_size']}"
        )
    if config["dtype"] not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {config['dtype']!r}")


def head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def param_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of the checkpoint (lm_head absent when tied)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_size = config["num_attention_heads"] * head_dim(config)
    kv_size = config["num_key_value_heads"] * head_dim(config)
    qkv_bias = config["model_type"] == "qwen2" or config.get("attention_bias", False)
    o_bias = config["model_type"] != "qwen2" and config.get("attention_bias", False)
    mlp_bias = config.get("mlp_bias", False)
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        for name, out, inp, bias in (
            ("q_proj", q_size, hidden, qkv_bias),
            ("k_proj", kv_size, hidden, qkv_bias),
            ("v_proj", kv_size, hidden, qkv_bias),
            ("o_proj", hidden, q_size, o_bias),
        ):
            shapes[f"{p}self_attn.{name}.weight"] = (out, inp)
            if bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        if config["model_type"] == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (head_dim(config),)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim(config),)
        for name, out, inp in (("gate_proj", inter, hidden), ("up_proj", inter, hidden), ("down_proj", hidden, inter)):
            shapes[f"{p}mlp.{name}.weight"] = (out, inp)
            if mlp_bias:
                shapes[f"{p}mlp.{name}.bias"] = (out,)
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def _init(name: str, shape: tuple[int, ...], config: dict, seed: int) -> torch.Tensor:
    # One generator per tensor, seeded by its name: a tensor does not change when others are added.
    # (The CPU generator keeps only 32 seed bits, so seed and name are hashed together.)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    hidden = config["hidden_size"]
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return 2.0 * (1.0 + 0.1 * x)  # q/k are RMS-normalised, so attention sharpness (see below) is set here
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * x
    if name.endswith(".bias"):
        return 0.2 * x  # larger shared offsets (v especially) pull greedy decoding into loops
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return x * (2.0 / hidden**0.5)  # logit std ~2: top-1/top-2 gaps far above fp32 noise
    # Fan-in scale keeps a projection's output at its input's magnitude. On top: sharper attention (q, k)
    # makes outputs depend on particular earlier positions rather than a context average, and larger
    # writes to the residual (o, down) let context outweigh the current token's embedding; without both,
    # greedy decoding falls into one-token loops, worst with tied embeddings (the current token's
    # embedding then scores itself highest).
    gain = _GAINS.get(name.rsplit(".", 2)[-2], 1.0)
    return x * (gain / shape[1] ** 0.5)


def make_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    dtype = DTYPES[config["dtype"]]
    return {
        name: _init(name, shape, config, seed).to(dtype).contiguous() for name, shape in param_shapes(config).items()
    }


def stdlib_corpus(num_chars: int) -> list[str]:
    """pydoc's topic text, then stdlib .py sources in sorted path order, until `num_chars` are collected."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    topics = root / "pydoc_data" / "topics.py"
    texts = [topics.read_text(encoding="utf-8")]
    total = len(texts[0])
    # test/ holds deliberately malformed files; site-packages is not the stdlib and varies per venv.
    sources = sorted(
        p for p in root.rglob("*.py") if p.relative_to(root).parts[0] not in ("test", "site-packages") and p != topics
    )
    for path in sources:
        if total >= num_chars:
            break
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(texts[-1])
    return texts


def train_tokenizer(vocab_size: int, qwen: bool = False):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` tokens (special tokens included).

    qwen=True builds the pipeline transformers' Qwen2Tokenizer rebuilds on load (NFC, Qwen split regex)
    so tokenizer.json and AutoTokenizer agree; otherwise GPT-2 style byte-level splitting, no normaliser.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if qwen:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_corpus(vocab_size * CORPUS_CHARS_PER_TOKEN), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab_size {vocab_size} is more than BPE can learn from the stdlib text (reached {tok.get_vocab_size()})"
        )
    bos = SPECIAL_TOKENS[BOS_ID]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, BOS_ID)]
    )
    return tok


def _write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_tokenizer(path: pathlib.Path, vocab_size: int, qwen: bool, max_length: int) -> None:
    """This module's tokenizer of exactly `vocab_size` tokens (Qwen's pipeline with `qwen`), its files written to
    `path`: for the tiny checkpoints here and those tests write with transformers."""
    train_tokenizer(vocab_size, qwen).save(str(path / "tokenizer.json"))
    _write_json(
        path / "tokenizer_config.json",
        {
            # unk_token null: Qwen2Tokenizer would otherwise add an <|endoftext|> unk beyond vocab_size.
            "tokenizer_class": "Qwen2Tokenizer" if qwen else "PreTrainedTokenizerFast",
            "unk_token": None,
            "bos_token": SPECIAL_TOKENS[BOS_ID],
            "eos_token": SPECIAL_TOKENS[IM_END_ID],
            "pad_token": SPECIAL_TOKENS[PAD_ID],
            "model_max_length": max_length,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
        },
    )


def make_tiny_model(path: str | pathlib.Path, arch: str = "llama", seed: int = 0, **config_overrides) -> pathlib.Path:
    """Write a tiny HF checkpoint for `arch` to `path`; same arguments give byte-identical files."""
    if not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise ValueError(f"seed must be an integer in [0, 2**31), got {seed!r}")
    config = make_config(arch, **config_overrides)
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    qwen = config["model_type"] in ("qwen2", "qwen3")
    write_tokenizer(path, config["vocab_size"], qwen, config["max_position_embeddings"])
    _write_json(path / "config.json", config)
    _write_json(
        path / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": IM_END_ID, "pad_token_id": PAD_ID}
    )
    save_file(make_weights(config, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _parse_set(item: str) -> tuple[str, object]:
    key, sep, value = item.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {item!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a deterministic tiny HF model directory.")
    parser.add_argument("path")
    parser.add_argument("--arch", default="llama", choices=sorted(ARCH_CONFIGS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--set",
        dest="overrides",
        type=_parse_set,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, VALUE parsed as JSON (e.g. hidden_size=512)",
    )
    args = parser.parse_args(argv)
    print(make_tiny_model(args.path, args.arch, args.seed, **dict(args.overrides)))


if __name__ == "__main__":
    main()
