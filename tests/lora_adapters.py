"""Test helpers: random PEFT LoRA adapters for a local base model, written by PEFT itself, and PEFT's own greedy
generation as the reference."""

import json
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

# name -> LoraConfig kwargs: different ranks and targets, one rsLoRA, one with rank/alpha patterns
ADAPTERS = {
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all-rslora-r16": dict(
        r=16,
        lora_alpha=6,
        use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp-patterns": dict(
        r=4,
        lora_alpha=8,
        target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"],
        rank_pattern={"layers.1.mlp.gate_proj": 12, "k_proj": 2},
        alpha_pattern={"down_proj": 3},
    ),
}


def make_adapter(base: str | Path, out: str | Path, seed: int, model=None, scale: float = 1.0, **lora_kwargs) -> Path:
    """Write a PEFT adapter for `base` with every LoRA weight random (B nonzero, unlike PEFT's init), sized so
    that the adapter changes greedy outputs."""
    model = model or AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                fan_in = p.shape[1] if p.dim() == 2 else 1
                p.copy_(torch.randn(p.shape, generator=g) * scale / fan_in**0.5)
    peft_model.save_pretrained(out)
    peft_model.unload()  # give `model` back without LoRA layers
    return Path(out)


def set_config(path: Path, **changes) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))


class PeftReference:
    """One transformers model holding every adapter; greedy generation with a chosen one, eos disabled."""

    def __init__(self, base_model, adapters: dict[str, Path]):
        base_model.generation_config.eos_token_id = None
        names = list(adapters)
        self.model = PeftModel.from_pretrained(base_model, str(adapters[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(str(adapters[name]), adapter_name=name)
        self.model.eval()
        self.memo: dict[tuple, list[int]] = {}

    def generate(self, prompt: list[int], adapter: str | None, max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), adapter, max_new_tokens)
        if key not in self.memo:
            self.memo[key] = self._generate(prompt, adapter, max_new_tokens)
        return self.memo[key]

    @torch.inference_mode()
    def _generate(self, prompt: list[int], adapter: str | None, max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        kwargs = dict(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
        )
        if adapter is None:
            with self.model.disable_adapter():
                out = self.model.generate(**kwargs)
        else:
            self.model.set_adapter(adapter)
            out = self.model.generate(**kwargs)
        return out[0, len(prompt) :].tolist()
