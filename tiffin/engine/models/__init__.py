"""The models in plain torch, their shared layers, the architecture registry (the only place that names
architectures) and checkpoint loading (Hugging Face safetensors, GGUF).

A model sees one flattened batch and its metadata, never requests; how a weight is stored (plain, AWQ, GPTQ,
GGUF) is its `Linear`'s method, not the model's business. Adding an architecture: its line in
`registry.ARCHITECTURES`, and a model file when it is a new family (docs/architecture.md).
"""
