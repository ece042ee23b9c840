"""The shapes a GGUF file's tensors must have: the dimensions its metadata declares (`Dims`), each tensor checked
against them before any is read, so that a file whose metadata and tensors disagree is refused naming the
metadata behind the dimension that differs."""

from typing import Any, NamedTuple

from gguf import Keys


class Dims(NamedTuple):
    """The model dimensions a GGUF file's metadata declares, each checked against the tensors it sizes."""

    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    context: int
    experts: int = 0  # a mixture of experts: experts a layer, of `expert_ffn` each, `experts_used` a token
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0  # Qwen2-MoE's shared expert (0: none)


def check_shapes(checkpoint: Any, dims: Dims) -> None:
    """Every weight and bias of `checkpoint` (a `GGUFCheckpoint`, untyped here as in `gguf_families`: it imports
    this module) has the shape `dims` implies; the refusal names the metadata behind each dimension that differs."""
    vocab = (dims.vocab, f"{checkpoint.key(Keys.LLM.VOCAB_SIZE)} = {dims.vocab}")
    hidden = (dims.hidden, f"{checkpoint.key(Keys.LLM.EMBEDDING_LENGTH)} = {dims.hidden}")
    ffn = (dims.ffn, f"{checkpoint.key(Keys.LLM.FEED_FORWARD_LENGTH)} = {dims.ffn}")
    source = checkpoint.head_dim_source()
    head = (dims.head_dim, f"{source} = {dims.head_dim}")
    q_label = f"{checkpoint.key(Keys.Attention.HEAD_COUNT)} × {source} = {dims.heads} × {dims.head_dim}"
    kv_label = f"{checkpoint.key(Keys.Attention.HEAD_COUNT_KV)} × {source} = {dims.kv_heads} × {dims.head_dim}"
    q, kv = (dims.heads * dims.head_dim, q_label), (dims.kv_heads * dims.head_dim, kv_label)
    # q/k norms per head (Qwen3), or over the whole projection (OLMo 2): the model's own shapes decide at load
    whole = checkpoint.tensor_shapes.get("blk.0.attn_q_norm.weight") == (q[0],) != (head[0],)
    experts = (dims.experts, f"{checkpoint.key(Keys.LLM.EXPERT_COUNT)} = {dims.experts}")
    expert_ffn = (dims.expert_ffn, f"{checkpoint.key(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH)} = {dims.expert_ffn}")
    shared_ffn = (dims.shared_ffn, f"{checkpoint.key(Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH)} = {dims.shared_ffn}")
    expected = {
        "embed_tokens": (vocab, hidden),
        "lm_head": (vocab, hidden),
        "norm": (hidden,),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
        "pre_feedforward_layernorm": (hidden,),
        "post_feedforward_layernorm": (hidden,),
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "q_norm": (q,) if whole else (head,),
        "k_norm": (kv,) if whole else (head,),
        "gate_proj": (ffn, hidden),
        "up_proj": (ffn, hidden),
        "down_proj": (hidden, ffn),
        "qkv_proj": ((q[0] + 2 * kv[0], f"{q[1]}, plus 2 × {kv[1]}"), hidden),  # fused (Phi-3)
        "gate_up_proj": ((2 * ffn[0], f"2 × {ffn[1]}"), hidden),
        "mlp.gate": (experts, hidden),  # the router
        "experts.gate_proj": (experts, expert_ffn, hidden),
        "experts.up_proj": (experts, expert_ffn, hidden),
        "experts.down_proj": (experts, hidden, expert_ffn),
        "shared_expert.gate_proj": (shared_ffn, hidden),
        "shared_expert.up_proj": (shared_ffn, hidden),
        "shared_expert.down_proj": (hidden, shared_ffn),
        "shared_expert_gate": ((1, "one output"), hidden),
    } | checkpoint.family.shapes(checkpoint, dims, hidden)
    for name, hf in checkpoint.hf_names.items():
        module, _, suffix = hf.rpartition(".")
        parent_leaf = ".".join(module.split(".")[-2:])
        want = expected.get(parent_leaf, expected.get(module.rpartition(".")[2]))[: 1 if suffix == "bias" else None]
        shape, sizes = checkpoint.tensor_shapes[name], tuple(size for size, _ in want)
        if shape != sizes:
            wrong = [label for (size, label), got in zip(want, shape) if size != got] or [l for _, l in want]
            raise checkpoint.fail(f"tensor {name!r} has shape {list(shape)}, not {list(sizes)} ({'; '.join(wrong)})")
