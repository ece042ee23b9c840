"""A tiny reasoning model for tests: the built-in tiny llama with a chat template that thinks as DeepSeek-R1's does,
its think markers either added tokens or plain text that BPE splits."""

import json
import pathlib

from tiffin.tiny import CHAT_TEMPLATE, make_tiny_model

THINK_START, THINK_END = "<think>", "</think>"
VOCAB_SIZE = 2048
THINK_TOKEN_IDS = (VOCAB_SIZE - 2, VOCAB_SIZE - 1)  # with marker tokens: <think>, </think>
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\n' }}",
    "{{ '<|im_start|>assistant\n' }}{%- if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\n\n</think>\n\n' }}{%- else %}{{ '<think>\n' }}{%- endif %}",
)


def make_thinking_model(path: str | pathlib.Path, marker_tokens: bool = False) -> pathlib.Path:
    """Write the checkpoint to `path`. With `marker_tokens`, the BPE's last two learned tokens (and their merges)
    give their ids to `<think>` and `</think>`, special added tokens, so the vocabulary keeps its size."""
    path = make_tiny_model(path, vocab_size=VOCAB_SIZE)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    if marker_tokens:
        tokenizer_path = path / "tokenizer.json"
        tokenizer = json.loads(tokenizer_path.read_text())
        model = tokenizer["model"]
        freed = {token for token, i in model["vocab"].items() if i in THINK_TOKEN_IDS}
        model["vocab"] = {token: i for token, i in model["vocab"].items() if token not in freed}
        model["merges"] = [m for m in model["merges"] if _merged(m) not in freed]
        tokenizer["added_tokens"] += [
            {
                "id": i,
                "content": marker,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
            for i, marker in zip(THINK_TOKEN_IDS, (THINK_START, THINK_END))
        ]
        tokenizer_path.write_text(json.dumps(tokenizer))
    return path


def _merged(merge: str | list[str]) -> str:
    return "".join(merge.split(" ") if isinstance(merge, str) else merge)
