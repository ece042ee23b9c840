"""The engine: requests in, one scheduled forward per step, outputs out. No HTTP, no BentoML.

Here, the entry points (`LLM`, `LLMEngine`, `AsyncLLMEngine`) and the vocabulary every box speaks
(`EngineConfig`, `SamplingParams`, `RequestOutput`, the errors); below, one folder per box of
docs/architecture.md:
- `core/`: what runs, decided on the host: sequences, the scheduler, the KV block manager, the detokenizer.
- `worker/`: how it runs on the device: the model runner (prepare -> forward -> sample), KV cache sizing, CUDA
  graphs, warm-up, the sampler, CPU thread sizing, the tensor-parallel worker.
- `lora/`: adapters: requests, PEFT loading, the registry, device slots.
- `structured/`: structured outputs: what a request asks for, and the xgrammar backend that enforces it.
- `models/`: the model files in plain torch, their layers, the architecture registry, checkpoint loading.
- `distributed/`: the tensor-parallel rank descriptor, worker group and wire format.

Invariants kept at this level: a request that makes a step fail fails alone, the others getting what the full
batch gives them (`LLMEngine._execute`); the engine thread alone touches an `LLMEngine` (`AsyncLLMEngine`).
"""
