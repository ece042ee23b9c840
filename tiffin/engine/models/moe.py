"""A mixture of experts in place of the MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): the Llama model of `llama.py` whose
sparse layers (`MoEConfig.sparse`) route each token through `top_k` of `num_experts` SwiGLU experts.

Routing, as transformers does it: the router (`gate`, no bias) scores the experts, a softmax in fp32 turns the
scores into probabilities, each token takes its `top_k` most probable experts, their probabilities rescaled to
sum to 1 where the config says (`norm_topk_prob`; Mixtral always). The layer's output is the weighted sum of
those experts' outputs, plus, in Qwen2-MoE, a shared expert (a dense MLP every token goes through) scaled by
`sigmoid(shared_expert_gate(x))`.

Experts from a Hugging Face checkpoint are stacked per layer, `gate_up_proj [E, 2I, H]` (each expert's gate rows,
then its up rows) and `down_proj [E, H, I]` (`Experts`), and run by `kernels.fused_moe`: on CPU (torch) its
(token, choice) pairs sorted by expert and one GEMM pair per expert that has tokens (`run_experts`, which reads
the experts' counts on the host), on the Triton backend one sorted, padded grouped GEMM pair sized by the number of
tokens alone (no host read: CUDA graphs capture it). Those of a GGUF file are each expert's pair of `Linear`s
(`LinearExperts`), stored as their `LinearMethod` stores a GGUF tensor: quantized ones kept in their blocks (on
CPU the native block GEMMs), each expert's rows a slice of the file's stacked tensor, run by `run_experts` on
every device (so no CUDA graphs for them: `graphed_decode.graph_refusal`). Either way a decode step reads its
chosen experts' weights and no others'. On CPU a decode step of GGUF experts kept in blocks runs natively
instead (`worker/cpu_decode.py`): routing and a grouped GEMM over the chosen experts a projection, with this
module's numerics. DeepSeek's routing (grouped top-k, sigmoid scores with a correction bias, a scaling factor) is
`grouped_topk`, which `deepseek.py`'s layer uses.

Tensor parallelism splits each expert's intermediate dimension, as the dense MLP's column (gate/up) and row
(down) split does; the router is replicated; the experts' partial outputs are all-reduced.
"""

import torch
from torch import nn

from tiffin import kernels
from tiffin.engine.distributed.tensor_parallel import TensorParallel
from tiffin.engine.models.config import ModelConfig
from tiffin.engine.models.layers import ACTIVATIONS, MLP, LinearFactory, prefixed
from tiffin.engine.models.llama import LlamaForCausalLM, dense_mlp
from tiffin.kernels.fused_moe import run_experts
from tiffin.kernels.lora import LoRAMetadata
from tiffin.quant.base import materialize, param, rank_slice

# a checkpoint's per-expert tensor (`experts.{e}.{name}.weight`) -> (our stacked tensor, its half of gate_up)
EXPERT_SHARDS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0),  # Mixtral's names
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
}


class Experts(nn.Module):
    """`num_experts` SwiGLU MLPs stacked: `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]` (I: this rank's part of
    the intermediate size)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        dtype: torch.dtype,
        backend: str,
        tp: TensorParallel,
    ):
        super().__init__()
        size = tp.split(intermediate_size, "the experts' intermediate size (moe_intermediate_size)")
        self.gate_up_proj = param(torch.empty(num_experts, 2 * size, hidden_size, dtype=dtype))
        self.down_proj = param(torch.empty(num_experts, hidden_size, size, dtype=dtype))
        self.act_and_mul, self.backend, self.tp = ACTIVATIONS[hidden_act], backend, tp
        # pieces not loaded yet: a stacked tensor counts as loaded once all of its experts' pieces are in
        self.unloaded = {("gate_up_proj", e, s) for e in range(num_experts) for s in (0, 1)}
        self.unloaded |= {("down_proj", e, None) for e in range(num_experts)}

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """This rank's part of the experts' weighted sum (`kernels.fused_moe`)."""
        act_and_mul = lambda h: self.act_and_mul(h, self.backend)
        return kernels.fused_moe(x, self.gate_up_proj, self.down_proj, weights, experts, act_and_mul, self.backend)

    def load(self, name: str, tensor) -> list[str]:
        """Place checkpoint tensor `experts.{name}`: one expert's (`{e}.gate_proj.weight`, ...) or, fused as
        transformers holds them, all experts' (`gate_up_proj`, `down_proj`) -> the stacked tensors now complete."""
        size = self.down_proj.shape[2]
        if name in ("gate_up_proj", "down_proj"):
            full = materialize(tensor)
            if name == "gate_up_proj":
                halves = full.chunk(2, dim=1)
                full = torch.cat([rank_slice(h, 1, size, self.tp.rank, self.tp.size) for h in halves], dim=1)
            else:
                full = rank_slice(full, 2, size, self.tp.rank, self.tp.size)
            self._copy(name, getattr(self, name).data, full)
            self.unloaded = {piece for piece in self.unloaded if piece[0] != name}
            return [name]
        index, _, leaf = name.partition(".")
        leaf, _, suffix = leaf.partition(".")
        if not index.isdigit() or leaf not in EXPERT_SHARDS or suffix != "weight":
            raise ValueError(f"experts.{name}: not an expert weight tiffin reads (gate/up/down_proj or w1/w2/w3)")
        e, (stacked, shard) = int(index), EXPERT_SHARDS[leaf]
        if e >= self.gate_up_proj.shape[0]:
            raise ValueError(f"experts.{name}: expert {e} of a layer of {self.gate_up_proj.shape[0]} experts")
        target = getattr(self, stacked).data[e]
        if shard is None:
            tensor = rank_slice(tensor, 1, size, self.tp.rank, self.tp.size)
        else:
            target = target[shard * size : (shard + 1) * size]
            tensor = rank_slice(tensor, 0, size, self.tp.rank, self.tp.size)
        self._copy(f"experts.{name}", target, materialize(tensor))
        self.unloaded.discard((stacked, e, shard))
        return [] if any(piece[0] == stacked for piece in self.unloaded) else [stacked]

    @staticmethod
    def _copy(name: str, target: torch.Tensor, tensor: torch.Tensor) -> None:
        if target.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}")
        target.copy_(tensor)


def grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    num_groups: int = 1,
    topk_groups: int = 1,
    bias: torch.Tensor | None = None,
    renormalize: bool = False,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing of router `logits [T, E]` (fp32) -> each token's weights `[T, k]` (fp32) and experts
    `[T, k]`, as transformers and DeepSeek's code compute it. Scores are the logits' softmax (V2) or sigmoid (V3);
    with `num_groups` > 1 the experts form equal groups and a token picks among the experts of its `topk_groups`
    best groups only (V2 `group_limited_greedy`: a group ranks by its best score; V3 `noaux_tc`: by its two best).
    V3 chooses by the scores plus `bias` (`e_score_correction_bias`) but weights by the unbiased scores. The
    weights are renormalized to sum to 1 where `renormalize`, then multiplied by `scale` (routed_scaling_factor)."""
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if num_groups > 1:
        grouped = choice.view(len(choice), num_groups, -1)
        group_scores = grouped.topk(1 if bias is None else 2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool)
        kept.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(grouped.shape[2], dim=1), float("-inf"))
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, experts


class LinearExperts(nn.Module):
    """`num_experts` SwiGLU MLPs of a GGUF file, each its own `gate_up_proj` and `down_proj` `Linear`, stored as the
    file's type says (`linear`: the model's factory, whose method for `experts.gate_up_proj` is that of the stacked
    `experts.gate_proj` / `experts.up_proj` tensors)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        backend: str,
        linear: LinearFactory,
    ):
        super().__init__()
        sizes = [intermediate_size] * 2
        self.gate_up_proj = nn.ModuleList(
            linear("experts.gate_up_proj", hidden_size, sizes, False) for _ in range(num_experts)
        )
        self.down_proj = nn.ModuleList(
            linear("experts.down_proj", intermediate_size, [hidden_size], False) for _ in range(num_experts)
        )
        self.act_and_mul, self.backend = ACTIVATIONS[hidden_act], backend

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return run_experts(x, weights, experts, len(self.down_proj), self.expert)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj[e](self.act_and_mul(self.gate_up_proj[e](x), self.backend)).to(x.dtype)

    def load(self, name: str, tensor: torch.Tensor) -> list[str]:
        """Place a GGUF stacked tensor `experts.{gate,up,down}_proj.weight`: `[E, rows, inputs]`, or kept quantized
        `[E * rows, row_bytes]`, each expert's rows to its layer -> the parameters filled."""
        leaf, _, suffix = name.partition(".")
        if leaf not in ("gate_proj", "up_proj", "down_proj") or suffix != "weight":
            raise ValueError(f"experts.{name}: not a stacked GGUF expert weight (gate/up/down_proj.weight)")
        stacked, shard = EXPERT_SHARDS[leaf]
        layers = getattr(self, stacked)
        if tensor.shape[0] % len(layers):
            raise ValueError(f"experts.{name}: {tensor.shape[0]} rows do not split into {len(layers)} experts")
        for layer, rows in zip(layers, tensor.reshape(len(layers), -1, tensor.shape[-1])):
            layer.load("weight", rows, shard)
        return [f"{stacked}.{e}.{n}" for e, layer in enumerate(layers) for n, _ in layer.named_parameters()]


def per_expert_layers(config: ModelConfig) -> bool:
    """Whether `SparseMoE` holds its experts as a layer each (a GGUF file's: `LinearExperts`), not stacked."""
    return config.quant_config is not None and config.quant_config.name == "gguf"


class SparseMoE(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert of one layer."""

    def __init__(self, config: ModelConfig, linear: LinearFactory, backend: str, tp: TensorParallel):
        super().__init__()
        moe, hidden = config.moe, config.hidden_size
        self.top_k, self.renormalize, self.tp = moe.top_k, moe.renormalize, tp
        self.gate = linear("gate", hidden, [moe.num_experts], False)  # replicated on every rank
        self.gate.looks_up_rows = True  # a CPU prepack keeps its plain weight: the native decode step reads it
        if per_expert_layers(config):
            self.experts = LinearExperts(
                moe.num_experts, hidden, moe.intermediate_size, config.hidden_act, backend, linear
            )
        else:
            self.experts = Experts(
                moe.num_experts, hidden, moe.intermediate_size, config.hidden_act, config.dtype, backend, tp
            )
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_size:
            shared = prefixed(linear, "shared_expert.")
            self.shared_expert = MLP(hidden, moe.shared_expert_size, config.hidden_act, False, shared, backend)
            self.shared_expert_gate = linear("shared_expert_gate", hidden, [1], False)
            self.shared_expert_gate.looks_up_rows = True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's routing weights `[T, k]` (in x's dtype) and experts `[T, k]`."""
        probs = self.gate(x).softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, lora: LoRAMetadata | None = None) -> torch.Tensor:
        y = self.tp.all_reduce(self.experts(x, *self.route(x)))
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, lora)
        return y


class MoEForCausalLM(LlamaForCausalLM):
    """Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama model with `SparseMoE` as the MLP of its sparse layers."""

    checkpoint_renames = {".block_sparse_moe.": ".mlp."}  # Mixtral's checkpoint name of the layer's router+experts

    @staticmethod
    def make_mlp(config: ModelConfig, layer: int, linear: LinearFactory, backend: str, tp: TensorParallel):
        if config.moe.sparse(layer):
            return SparseMoE(config, linear, backend, tp)
        return dense_mlp(config, layer, linear, backend, tp)
