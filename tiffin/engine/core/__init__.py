"""What runs, decided on the host: `Sequence`s, the `Scheduler` (each step's batch), the `BlockManager` (the KV
blocks and the prefix cache), `kv_offload` (the host tiers' bookkeeping and a step's copies) and the
`IncrementalDetokenizer`. Nothing here touches a tensor.

Invariants, each kept where its docstring says:
- A block is referenced or free, never both; a prefix-cache hit never covers a sequence's last token; a sequence
  holds device or swap blocks, never both (`BlockManager`; `check_invariants` asserts them, after every step when
  TIFFIN_CHECK_INVARIANTS=1).
- A step's copies take effect offloads first, then loads, then the forward; host blocks they touch are not
  reused before they are taken (`kv_offload`).
- A step never exceeds `max_num_batched_tokens` / `max_num_seqs`; running sequences are served before waiting
  ones, swapped and waiting ones in arrival order; a step never mixes more LoRA adapters than device slots
  (`Scheduler`).
- One place decides a sequence stops (`Scheduler._check_stop`).
- Streamed text never takes back what it sent (`IncrementalDetokenizer`).
"""
