"""Multi-LoRA serving: PEFT adapters loaded from local directories, held in a host LRU cache, installed into a
fixed number of device slots, and applied per token as a delta on each base projection's output.

- `LoRARequest` (vLLM's shape) names an adapter per request. `LoRAModel` is a parsed, validated adapter; its
  `identity` is a hash of the files' content, used for device slots, the scheduler's adapter count and the
  prefix-cache key, so a name re-pointed at new weights can never reuse stale KV or slots.
- `LoRARegistry` (owned by the LLMEngine) is the one record of which adapters exist: ids, names, directories,
  and the host cache of parsed ones. The serving layers ask it; nothing else keeps a list.
- `LoRASlots` (`slots.py`, owned by the ModelRunner) installs the adapters a step uses into device slots.

Removing an adapter only unregisters it: sequences already running hold their `LoRAModel` and finish with it;
its slot is reused once no step needs it.

Every read of an adapter's files, the first and each one after an eviction from the host cache, resolves them
inside `lora_roots` when those are set, and a re-read must find the very directory (device and inode) and
content (`identity`) that were first read: swapping the directory or its files afterwards cannot change what a
name serves.
"""
