"""The row counts CPU GEMMs run at where oneDNN keeps a kernel per row count: it builds one for each new row count
of a linear (bf16/fp16, and fp32 with weights prepacked for it) and caches it, ~0.6 MiB each per distinct layer
shape, and steps come in every size, so unpadded, a server's memory grows with the variety of its load (figures:
benchmarks/README.md)."""


def padded_tokens(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at: exact up to 8, then rounded up to one of 4 sizes per power of
    two (at most 1/4 more).

    Invariant: while the model runner pads rows (`RunnerPolicy.pad_rows`), every forward's token rows, every logits
    pass's rows and the rows of each torch-path LoRA GEMM at bf16/fp16 (`LoRAMetadata`) are one of
    `row_buckets(max_num_batched_tokens)`, fixed at engine start (warm-up builds them there). Padding
    rows belong to no sequence: slot -1 (no KV write), the base model (no adapter), outside every attention entry,
    never sampled, pooled nor returned (their logits and LoRA rows are cut before anything reads them)."""
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def row_buckets(max_rows: int) -> list[int]:
    """Every `padded_tokens` size of at most `max_rows` rows."""
    return sorted({padded_tokens(n) for n in range(1, max_rows + 1)})
