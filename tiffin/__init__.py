"""tiffin: a vLLM-class LLM engine packaged as a BentoML backend."""
