"""How a step runs on the device: `ModelRunner` turns a `SchedulerOutput` into one flattened forward and samples
(`batch`: the step as host arrays, then as `ModelInput`), with what it decides at start chosen by `policy`:
KV cache sizing and storage (`kv_cache`), padded decode steps and their CUDA graphs (`cuda_graphs`), warm-up,
CPU thread sizing; under tensor parallelism, rank 0 sends each step to the other ranks' runners (`tp_worker`).

Invariants: only the runner builds tensors whose shape changes per step; a CUDA graph's inputs live in
persistent buffers filled in place; the KV pool is sized after a profiling step (graphs captured, the sampler's
worst case) whose KV and graphs are freed first; a step's host -> device traffic is one pinned copy (`Upload`),
its device -> host traffic the sampled tokens (and one logprobs table when asked), besides the KV blocks a step
moves to or from the host tiers (`ModelRunner.copy_blocks`, from `kv_copies`).
"""
