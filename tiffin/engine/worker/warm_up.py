"""Work done at start so that serving never pays a first-use cost: every Triton kernel variant compiled, and on
CPU every padded GEMM size built by oneDNN."""

from collections.abc import Iterable

import numpy as np
import torch

from tiffin.engine.models.linear import Embedding, Linear
from tiffin.engine.worker import pipeline_stage
from tiffin.engine.worker.batch import synthetic_step
from tiffin.kernels.lora import LoRAMetadata, lora_apply
from tiffin.kernels.quant import DENSE_MIN_TOKENS
from tiffin.kernels.row_buckets import row_buckets


@torch.inference_mode()
def warm_up_triton(runner) -> None:
    """Launch every Triton kernel variant serving can through `runner`'s model. Variants follow a step's sizes:
    quantized GEMM tiles and split-K by token count (every count up to the dense path's dequantize, per distinct layer);
    attention by batch and token counts as Triton specializes them (1, a multiple of 16, other) and, for
    decode-only steps, KV splits, which follow the batch size and the longest context. The steps run the model on
    the runner's own KV cache, so a quantized one (`kv_cache_dtype`) warms its quantized write and attention
    variants. With `enable_lora`, the LoRA kernels too (`warm_up_lora`). Tensor-parallel ranks run the same steps
    (the smallest SM count of theirs), their forwards' all-reduces meeting; a later pipeline stage runs its layers
    on zeros, sent nothing."""
    # here, not at the top: a torch-backend process never imports triton
    from tiffin.kernels.triton_attention import MIN_SPLIT_TOKENS
    from tiffin.kernels.triton_common import MAX_SPLITS, num_sms

    c = runner.config
    most = min(c.max_num_seqs, c.max_num_batched_tokens)
    long = min(runner.max_model_len - 1, MIN_SPLIT_TOKENS * MAX_SPLITS)  # context for the most KV splits
    # every batch size whose programs may not fill the GPU twice (KV splits vary), then one of each
    # specialization class; programs >= sequences, so larger batches never split
    sms = num_sms(runner.device) if runner.group is None else runner.group.agree_min(num_sms(runner.device))
    sizes = sorted({*range(1, 2 * sms + 1), 16, 17, 32, 33} & set(range(1, most + 1)))
    contexts = sorted({1, min(long, MIN_SPLIT_TOKENS + 1), long})  # no split, two, as many as fit
    steps = [[(1, 1)] * (d - 1) + [(ctx, 1)] for d in sizes for ctx in contexts]
    for tokens in (16, 17, 32, 33):  # prefill chunks, prefills after a cached prefix, mixed steps
        for seqs in (1, 2, 16):
            if seqs <= c.max_num_seqs and tokens <= c.max_num_batched_tokens and tokens // seqs > 1:
                n, extra = divmod(tokens, seqs)
                steps.append([(0, n + extra)] + [(0, n)] * (seqs - 1))
                steps.append([(1, n + extra)] + [(1, 1)] * (seqs - 1))
    steps.append([(0, min(c.max_num_batched_tokens, runner.max_model_len))])
    for step in steps:
        inputs = runner.prepare(synthetic_step(step, runner.block_size, runner.num_blocks))
        received = pipeline_stage.stage_input(runner, len(inputs.input_ids))  # a later pipeline stage's input
        staged = () if received is None else (None, received.unbind(0))
        runner.model(inputs.input_ids, inputs.positions, inputs.attn, *staged)
    for layer in distinct_linears(runner.model):
        if hasattr(layer, "qweight"):
            x = torch.zeros(DENSE_MIN_TOKENS, layer.input_size, dtype=runner.model_config.dtype, device=runner.device)
            for m in range(1, DENSE_MIN_TOKENS + 1):  # the fused GEMM's tiles and splits, then the dense path's
                layer.method.apply(layer, x[:m])
    if runner.lora_slots is not None:
        warm_up_lora(runner)


@torch.inference_mode()
def warm_up_lora(runner) -> None:
    """Launch every LoRA shrink/expand variant a step can reach, on the empty (zeroed) slots: per distinct adapter
    layer and tile class of the largest slot group (`_block_m`: up to 16, 32, more tokens), the fewest programs (one
    slot, the class's fewest tokens) and the most (every slot, its most tokens). Split-K falls as programs grow, so
    the two bound the choices between; each runs at a token count divisible by 16 and one not (the stride of the
    split-K partials)."""
    slots, most = runner.lora_slots, runner.config.max_num_batched_tokens
    layers = {(a.a.shape, a.b.shape, tuple(a.offsets)): a for a in (m.adapters for m in slots.layers.values())}
    cases = set()
    for lo, hi in ((1, 16), (17, 32), (33, most)):
        for group, used in ((lo, 1), (min(hi, most - slots.max_loras + 1), slots.max_loras)):
            first, even = group + used - 1, -(-(group + used - 1) // 16) * 16  # the group, a token on each other slot
            if group >= lo:
                cases |= {(group, used, t) for t in (first, even, even + 1) if t <= most}
    for group, used, tokens in sorted(cases):
        token_slots = np.full(tokens, -1)  # the tokens past the groups run the base model
        token_slots[: group + used - 1] = np.r_[np.zeros(group, int), np.arange(1, used)]
        md = LoRAMetadata.build(token_slots, runner.device, slots.dtype)
        for layer in layers.values():
            x = torch.zeros(tokens, layer.input_size, dtype=slots.dtype, device=runner.device)
            y = torch.zeros(tokens, layer.b.shape[2], dtype=runner.model_config.dtype, device=runner.device)
            lora_apply(x, layer.a, layer.b, y, layer.offsets, md, layer.backend)


@torch.inference_mode()
def warm_padded_sizes(
    model: torch.nn.Module, model_config, max_tokens: int, max_logits: int, threads: Iterable[int]
) -> None:
    """Run each distinct projection at every `row_buckets(max_tokens)` size, and the logits head at every size up to
    `max_logits` rows (a step's sampling rows), at each of the thread counts `threads` (oneDNN builds a kernel per
    row count and thread count), so that a fresh server holds them already: left to first use, the sizes above
    1,024 rows (steps of many prompts) kept adding ~0.6 MiB each per shape for thousands of requests (issue #50;
    benchmarks/README.md). Prompt logprobs' logits passes, larger than `max_logits`, build theirs on first use.
    CPU only (`RunnerPolicy.pad_rows`); torch's thread count is left as it was."""
    dtype, before = model_config.dtype, torch.get_num_threads()
    inputs = [(layer, torch.zeros(max_tokens, layer.input_size, dtype=dtype)) for layer in distinct_linears(model)]
    hidden = torch.zeros(min(max_logits, max_tokens), model_config.hidden_size, dtype=dtype)
    try:
        for count in threads:
            torch.set_num_threads(count)
            for layer, x in inputs:
                for m in row_buckets(len(x)):
                    layer.method.apply(layer, x[:m])
            for m in row_buckets(len(hidden)) if model_config.task == "generate" else ():
                model.compute_logits(hidden[:m])
    finally:
        torch.set_num_threads(before)


def distinct_linears(model: torch.nn.Module) -> list[Linear]:
    """One projection layer (not the embedding) per distinct (method, input size, output size)."""
    layers = {}
    for layer in model.modules():
        if isinstance(layer, Linear) and not isinstance(layer, Embedding):
            layers.setdefault((type(layer.method), layer.input_size, layer.output_size), layer)
    return list(layers.values())
