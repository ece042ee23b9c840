"""Engine settings: what the user chooses. Torch-free, so that the Bento derives its settings from these fields
when `bentoml build` imports the service."""

import re
from dataclasses import dataclass, field

from tiffin.engine.reasoning import REASONING_PARSERS
from tiffin.engine.speculative_config import SpeculativeConfig

DTYPE_NAMES = ("float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
KV_OFFLOAD_DTYPES = ("auto", "int8")
PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
ROUTER_POLICIES = ("cache_aware", "least_loaded", "round_robin")


def _setting(default, doc: str):
    return field(default=default, metadata={"doc": doc})


@dataclass
class EngineConfig:
    """Each field's `metadata["doc"]` says what it sets; the Bento's settings and their docs are built from them."""

    model: str = field(
        metadata={
            "doc": "local Hugging Face model directory, .gguf file (or a directory holding one), or Hugging Face hub "
            "id (org/name)"
        }
    )
    revision: str | None = _setting(None, "hub revision (branch, tag or commit) of a hub id; default: main")
    tokenizer: str | None = _setting(None, "tokenizer directory; default: the model's")
    dtype: str = _setting(
        "auto",
        "float32, bfloat16 or float16; auto: the checkpoint's (fp32 ones in bf16 on CUDA, 16-bit ones in fp32 on a"
        " CPU without a GEMM of their type)",
    )
    device: str = _setting("auto", "cpu, cuda or cuda:<index>; auto: cuda when available")
    block_size: int = _setting(16, "tokens per KV cache block")
    num_kv_blocks: int | None = _setting(None, "KV cache blocks; default: what kv_cache_memory holds")
    kv_cache_memory: int | None = _setting(
        None, "bytes of KV cache; default: what gpu_memory_utilization leaves on CUDA, a quarter of free RAM on CPU"
    )
    kv_cache_dtype: str = _setting(
        "auto",
        "what the KV cache stores: auto (the model's dtype), int8 or fp8_e4m3 (fp8, as vLLM names it) / fp8_e5m2 (a "
        "byte per value and a scale per token and KV head: about half a bf16 cache's bytes)",
    )
    kv_offload_memory: int = _setting(
        0,
        "bytes of host memory holding prefix-cache blocks evicted from the KV pool (least recently used dropped "
        "first); a request whose prefix is found there has it copied back instead of recomputed. 0: off. Each "
        "tensor-parallel rank holds this much for its share of the KV",
    )
    kv_offload_dtype: str = _setting(
        "auto",
        "what the kv_offload_memory tier stores: auto (the KV cache's format, lossless) or int8 (kv_cache_dtype "
        "int8's format, quantized on the way out and dequantized on the way back: about 1.9x a bf16 cache's blocks, "
        "3.8x an fp32 one's, in the same bytes; a quantized KV cache's blocks are stored as they are)",
    )
    preemption_mode: str = _setting(
        "recompute",
        "what a request preempted for want of KV blocks loses: recompute (its blocks are freed and its tokens "
        "computed again when it resumes) or swap (its blocks are copied to host memory, swap_space, and back when it "
        "resumes; recompute when that is full)",
    )
    swap_space: float = _setting(
        4.0, "GiB of host memory for swapped-out requests' KV blocks (preemption_mode swap; per tensor-parallel rank)"
    )
    scheduling_policy: str = _setting(
        "fcfs",
        "which waiting request runs first: fcfs (arrival order) or priority (lower SamplingParams.priority first, "
        "arrival order within a level; preemption takes the lowest priority's latest request first)",
    )
    fair_share: bool = _setting(
        False,
        "share the running seats equally between clients (a request's `client`: the server's API key), whatever "
        "priorities they ask for, so that one client's burst cannot starve another's requests; a priority orders a "
        "client's own requests",
    )
    reasoning_parser: str | None = _setting(
        "auto",
        "the think markers of a reasoning model (deepseek_r1, qwen3, mistral), for thinking budgets and for splitting "
        "reasoning from the answer; auto: from the chat template where it shows exactly one kind; None or none: none",
    )
    gpu_memory_utilization: float = _setting(0.9, "share of the GPU's memory for weights, activations and KV cache")
    max_num_seqs: int = _setting(256, "sequences one step may batch")
    max_num_batched_tokens: int = _setting(4096, "tokens one step may compute, prefill chunks and decodes together")
    max_model_len: int | None = _setting(None, "context length; default: the model's")
    kernel_backend: str = _setting("auto", "torch or triton; auto: triton on CUDA, torch on CPU")
    quantization: str | None = _setting(
        None,
        "the checkpoint's quantization, as vLLM's setting: None reads it from the checkpoint; fp8 quantizes a bf16 / "
        "fp16 / fp32 checkpoint's linear weights to FP8 as they load (e4m3, a scale per output channel)",
    )
    cpu_quant_compute: str = _setting(
        "native",
        "quantized weights (GGUF, AWQ, GPTQ, compressed-tensors; FP8 always runs bf16 dot products) on CPU: native "
        "(kernels on the stored blocks; decode-sized inputs quantized per block of 32 to 15 bits, prompt-sized "
        "ones in bf16 dot products where the CPU has them), "
        "int8 (the same kernels with activations in int8 per block of 32, llama.cpp's scheme: its answers, which "
        "may differ from the model's), or exact (dequantized, then multiplied in the model dtype: transformers' "
        "numerics, several times slower); W8A8 checkpoints whose weights have a scale a row (compressed-tensors "
        "int-quantized, int8 activations) run their format's int8 activations per token in native and int8 alike",
    )
    enforce_eager: bool = _setting(
        False, "no CUDA graphs: decode steps launch every kernel from Python (graphs are captured on CUDA only)"
    )
    enable_prefix_caching: bool = _setting(True, "reuse the KV blocks of prompt prefixes seen before")
    prefill_first: bool = _setting(
        True,
        "a step that admits waiting requests runs their prefills without the running decodes (never two such steps "
        "in a row): new requests get their first token a step sooner",
    )
    seed: int = _setting(0, "seed of the random stream shared by requests that set none")
    task: str = _setting(
        "auto",
        "generate, embed or classify; auto: what the architecture serves (a *ForCausalLM generates, BertModel and "
        "a bare decoder such as Qwen3Model embed, a *ForSequenceClassification cross-encoder classifies). embed on a "
        "*ForCausalLM checkpoint serves it as an embedding model (Qwen3-Embedding)",
    )
    pooling_type: str | None = _setting(
        None,
        "mean, cls or last: how an embedding model pools; default: sentence-transformers' files, else the "
        "architecture's",
    )
    enable_lora: bool = _setting(False, "serve LoRA adapters")
    max_loras: int = _setting(4, "adapters resident at once in device slots: the most one step may mix")
    max_lora_rank: int = _setting(16, "the largest adapter rank accepted")
    max_cpu_loras: int | None = _setting(None, "adapters cached in host memory (LRU); default max_loras")
    lora_roots: str | None = _setting(None, "directories adapters may be read from (os.pathsep-separated); None: any")
    tensor_parallel_size: int = _setting(
        1, "devices (processes) one model is split across: GPUs on CUDA (one per rank), gloo processes on CPU"
    )
    pipeline_parallel_size: int = _setting(
        1,
        "stages the model's decoder layers are split into (contiguous layers each, the embedding on the first, the "
        "norm and head on the last), each stage tensor_parallel_size processes: gloo on CPU, NCCL on CUDA (a GPU "
        "each, consecutive from the configured one, decode graphs captured per stage)",
    )
    pipeline_layer_partition: str | None = _setting(
        None,
        "layers per pipeline stage, comma-separated (4,5,5; vLLM's VLLM_PP_LAYER_PARTITION); default: an even split, "
        "the extra layers on the stages before the last",
    )
    pipeline_batches_in_flight: int | None = _setting(
        None,
        "batches the pipeline's stages work on at once (each stage on another, the CPUs split between the stages); "
        "default pipeline_parallel_size; 1: one batch traverses the stages per step, the stages taking turns",
    )
    distributed_executor_backend: str = _setting(
        "mp",
        "how the ranks beyond the engine's run: mp, processes of this host; ray, actors of a Ray cluster placed by a "
        "placement group (one bundle per rank; the group may span nodes; CPU ranks only so far)",
    )
    ray_address: str | None = _setting(
        None,
        "the Ray cluster the ray executor joins when this process has not joined one (ray.init's address: auto, "
        "host:port; None: RAY_ADDRESS, else a new local cluster)",
    )
    nnodes: int = _setting(
        1,
        "nodes the mp executor's ranks span (vLLM's --nnodes): each node runs world size / nnodes consecutive ranks, "
        "node 0 the engine's (ranks 0..), the others each a headless `tiffin worker` process; CPU ranks only so far",
    )
    node_rank: int = _setting(0, "this node's index among nnodes (vLLM's --node-rank); the engine runs on node 0")
    master_addr: str = _setting(
        "127.0.0.1",
        "rank 0's node's address (vLLM's --master-addr), where every rank joins the group; with nnodes > 1 node 0's "
        "ranks bind it, so it must be an address of the engine's node that the other nodes reach",
    )
    master_port: int = _setting(
        29501,
        "the port of the group's rendezvous at master_addr (vLLM's --master-port; nnodes > 1); the next port is the "
        "side channel the headless nodes' ranks dial",
    )
    data_parallel_size: int = _setting(
        1,
        "engine replicas, each a process of its own (with its own tensor/pipeline-parallel group, devices and KV "
        "pool: on CUDA replica r starts at GPU r x tensor_parallel_size x pipeline_parallel_size), behind one "
        "router (router_policy); on CPU the replicas share the cores, each taking an equal part of the threads",
    )
    data_parallel_backend: str = _setting(
        "mp",
        "how data-parallel replicas run: mp, processes of this host; ray, actors of a Ray cluster (ray_address), "
        "one-CPU bundles of one placement group spread across its nodes (CPU replicas of one rank each so far)",
    )
    router_policy: str = _setting(
        "cache_aware",
        "which replica serves a request (data_parallel_size > 1): cache_aware (the one holding the longest prefix of "
        "its prompt's blocks, as its KV events report, unless it is loaded router_balance_threshold tokens beyond the "
        "least loaded; with no hit, the least loaded replica holding its adapter), least_loaded (fewest tokens in "
        "flight) or round_robin",
    )
    router_balance_threshold: int = _setting(
        8192,
        "tokens (prompts and outputs of its requests in flight) by which cache_aware's choice may be loaded beyond the "
        "least loaded replica before the request goes to the least loaded one instead (SGLang's balance threshold)",
    )
    data_parallel_max_restarts: int = _setting(
        3,
        "times a data-parallel replica that died is started again within 10 minutes (its requests in flight fail; it "
        "rejoins with an empty prefix cache); 0: never",
    )
    kv_events_endpoint: str | None = _setting(
        None,
        "ZMQ endpoint to publish KV-cache events on in vLLM's format (block stored / removed / all cleared, msgpack, "
        "tiffin.engine.kv_events), e.g. tcp://*:5557; replica r of a data-parallel engine binds the port + r. "
        "None: off",
    )
    kv_events_topic: str = _setting("", "the ZMQ topic of the KV-event messages (kv_events_endpoint)")
    distributed_timeout: float = _setting(
        300.0, "seconds a tensor-parallel collective may wait for a rank before the engine fails, naming it"
    )
    speculative_config: SpeculativeConfig | None = _setting(
        None,
        "speculative decoding (a dict of SpeculativeConfig's fields): method ngram, suffix or draft_model (with a "
        "draft `model`), num_speculative_tokens, prompt_lookup_max/min, disable_by_batch_size (auto: 4 on CPU, "
        "64 on CUDA); None: off",
    )
    max_n: int = _setting(64, "samples one request may ask for")
    limit_mm_per_prompt: int = _setting(4, "images one request may carry (a vision-language model)")
    max_image_pixels: int = _setting(
        16_777_216, "pixels (width x height) an image may declare; larger ones are refused before decoding"
    )
    max_image_bytes: int = _setting(20 << 20, "bytes of one encoded image (a data: URL's payload)")
    allowed_media_domains: str | None = _setting(
        None, "hosts whose http(s) image URLs a request may name (comma-separated); None: none (data: URLs only)"
    )
    encoder_cache_bytes: int = _setting(128 << 20, "image embeddings kept by content hash (LRU) for reuse")
    max_waiting_requests: int | None = _setting(
        None,
        "sequences queued beyond the running batch (a request with n counts n); more are refused (a server's 429; the "
        "offline LLM waits for room); None: no bound",
    )
    max_waiting_per_client: int | None = _setting(
        None,
        "sequences one client (a server's API key) may have queued beyond the running batch (n counts n); more are "
        "refused (a 429), so that one key cannot fill max_waiting_requests; anonymous requests are not bound by it; "
        "None: no bound",
    )
    grammar_compile_timeout: float = _setting(
        5.0,
        "seconds a structured-outputs request's schema or grammar may take to be checked, and then to be compiled; "
        "past either, the request is refused (400) naming this setting. A compile cannot be interrupted: it "
        "finishes in the background, on its own thread, and is cached",
    )
    grammar_cache_bytes: int = _setting(
        256 << 20,
        "bytes of compiled structured-outputs grammars kept for reuse (least recently used dropped first); a grammar "
        "that compiles to more than this is refused (400)",
    )
    chat_template_timeout: float = _setting(
        1.0,
        "seconds the chat template (code from the model's files) may take to render one conversation; a longer "
        "render is stopped there and its request refused",
    )
    chat_template_max_chars: int | None = _setting(
        None,
        "characters a chat template render may write, and the longest string it may build on the way (everything "
        "it builds together: 8 times this); more is refused before it is built. None: the longest prompt the "
        "context holds, the most the engine tokenizes",
    )
    control_tokens_in_messages: bool = _setting(
        False,
        "encode a control token spelled inside a chat message (`<|im_end|>`) as that control token, so that a "
        "message can close its turn and open others; False: as the text it is, only the chat template writes them",
    )

    engine_stall_timeout: float | None = _setting(
        120.0,
        "seconds one engine step may run while requests are in flight (the engine watchdog); past it the requests "
        "in flight fail with EngineStalled, /livez and /readyz turn 503 naming the stall, until the step ends. "
        "It bounds one step, not a request: a step computes at most max_num_batched_tokens tokens, milliseconds on "
        "a GPU but up to tens of seconds for a multi-billion-parameter model on a few CPU cores, hence the generous "
        "default (raise it for a large model on a slow CPU). 0 or None: off. Served engines (AsyncLLMEngine) only: "
        "the offline LLM steps in its caller's thread",
    )

    idle_sleep_seconds: float | None = _setting(
        None,
        "seconds without requests after which a served engine goes to sleep by itself (`idle_sleep_level`; "
        "llama.cpp's --sleep-idle-seconds), woken by the next request, which waits for the wake; None: never",
    )
    idle_sleep_level: int = _setting(1, "how deep an idle engine sleeps: 1 frees the KV cache, 2 the weights too")
    asleep_request_wait: float = _setting(
        0.0,
        "seconds a request arriving while the engine sleeps by `sleep` (not idle sleep) waits for `wake_up` before it "
        "is refused with EngineAsleep (a server's 503 naming the state); 0: refused at once",
    )

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig(**self.speculative_config)
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_loras",
            "max_lora_rank",
            "max_n",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pipeline_batches_in_flight is not None and self.pipeline_batches_in_flight < 1:
            raise ValueError(f"pipeline_batches_in_flight must be >= 1, got {self.pipeline_batches_in_flight}")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.cpu_quant_compute not in ("native", "int8", "exact"):
            raise ValueError(f"cpu_quant_compute must be 'native', 'int8' or 'exact', got {self.cpu_quant_compute!r}")
        if self.kv_cache_dtype == "fp8":  # vLLM's name for it
            self.kv_cache_dtype = "fp8_e4m3"
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_offload_dtype not in KV_OFFLOAD_DTYPES:
            raise ValueError(
                f"kv_offload_dtype must be one of {list(KV_OFFLOAD_DTYPES)}, got {self.kv_offload_dtype!r}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {list(PREEMPTION_MODES)}, got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        if self.reasoning_parser == "none":  # as an environment variable says None
            self.reasoning_parser = None
        if self.reasoning_parser not in (None, "auto", *REASONING_PARSERS):
            raise ValueError(
                f"reasoning_parser must be 'auto', None or one of {list(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.kv_offload_memory < 0 or self.swap_space < 0:
            raise ValueError("kv_offload_memory and swap_space must be >= 0")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got {self.device!r}")
        for name in ("distributed_executor_backend", "data_parallel_backend"):
            if getattr(self, name) not in ("mp", "ray"):
                raise ValueError(f"{name} must be 'mp' or 'ray', got {getattr(self, name)!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1:
            self._check_nodes()
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be one of {list(ROUTER_POLICIES)}, got {self.router_policy!r}")
        if self.data_parallel_max_restarts < 0:
            raise ValueError(f"data_parallel_max_restarts must be >= 0, got {self.data_parallel_max_restarts}")
        if self.router_balance_threshold < 0:
            raise ValueError(f"router_balance_threshold must be >= 0, got {self.router_balance_threshold}")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")
        if self.grammar_compile_timeout <= 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, got {self.grammar_compile_timeout}")
        if self.grammar_cache_bytes < 1:
            raise ValueError(f"grammar_cache_bytes must be >= 1, got {self.grammar_cache_bytes}")
        if self.chat_template_timeout <= 0:
            raise ValueError(f"chat_template_timeout must be > 0 seconds, got {self.chat_template_timeout}")
        if self.chat_template_max_chars is not None and self.chat_template_max_chars < 1:
            raise ValueError(f"chat_template_max_chars must be >= 1, got {self.chat_template_max_chars}")
        for name in ("max_waiting_requests", "max_waiting_per_client"):
            if (value := getattr(self, name)) is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.engine_stall_timeout is not None and self.engine_stall_timeout < 0:
            raise ValueError(f"engine_stall_timeout must be >= 0 (0 or None: off), got {self.engine_stall_timeout}")
        if self.idle_sleep_seconds is not None and self.idle_sleep_seconds <= 0:
            raise ValueError(f"idle_sleep_seconds must be > 0 (None: never), got {self.idle_sleep_seconds}")
        if self.idle_sleep_level not in (1, 2) or self.asleep_request_wait < 0:
            raise ValueError("idle_sleep_level must be 1 or 2 and asleep_request_wait >= 0")
        if self.idle_sleep_seconds and self.speculative_config and self.speculative_config.method == "draft_model":
            raise ValueError("idle_sleep_seconds does not cover a draft model (speculative_config draft_model) yet")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    def _check_nodes(self) -> None:
        size = self.tensor_parallel_size * self.pipeline_parallel_size
        if self.distributed_executor_backend != "mp":
            raise ValueError("nnodes > 1 is the mp executor's multi-node mode: the ray executor places ranks itself")
        if size % self.nnodes:
            raise ValueError(
                f"nnodes {self.nnodes} must divide tensor_parallel_size x pipeline_parallel_size ({size}): each node "
                "runs as many ranks"
            )
        if self.node_rank:
            raise ValueError(
                f"node_rank {self.node_rank}: the engine runs on node 0; start the other nodes' ranks with "
                "`tiffin worker --node-rank N --master-addr ... --master-port ...`"
            )
        if self.data_parallel_size > 1:
            raise ValueError("nnodes > 1 with data_parallel_size > 1 is not supported")
        if not 1 <= self.master_port < 65535:
            raise ValueError(f"master_port must be in [1, 65535), got {self.master_port}")

    def spec_batch_limit(self) -> int | None:
        """The running sequences from which no proposals are made (None: any number)."""
        limit = self.speculative_config.disable_by_batch_size
        return (4 if self.torch_device.type == "cpu" else 64) if limit == "auto" else limit

    @property
    def torch_device(self):
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
