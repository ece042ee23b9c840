"""The Bento's settings: each is read from `bentoml serve ... --arg <setting>=<value>`, else the environment
variable TIFFIN_<SETTING>. The engine's are EngineConfig's fields (their defaults, or a server's own where it
differs: `_BENTO_DEFAULTS`); the service's own (model resolution, API keys, limits, the embedding model, the Batch
API's) are `_ServiceSettings`'."""

import json
import os
import re
from dataclasses import fields

from pydantic import ConfigDict, Field, create_model, field_validator, model_validator

from tiffin.engine.config import EngineConfig
from tiffin.plugin.openai.batches import BatchSettings
from tiffin.plugin.openai.protocol import MAX_POOLING_INPUTS
from tiffin.plugin.openai.tokenize import MAX_TOKENIZE_IDS

# EngineConfig fields the service sets itself: it resolves the model (a path, store tag or hub id; the checkpoint
# holds the tokenizer) and turns LoRA on when lora_roots is set. Every other field is a setting of the same name.
_SERVICE_SET = {"model", "tokenizer", "enable_lora", "lora_roots"}
_ENGINE_SETTINGS = [f for f in fields(EngineConfig) if f.name not in _SERVICE_SET]
# a server bounds its queue, each key's share of it, and shares its seats between keys; offline `LLM` use need not
_BENTO_DEFAULTS = {"max_waiting_requests": 1024, "max_waiting_per_client": 256, "fair_share": True}


class _ServiceSettings(BatchSettings):  # the Batch API's settings (tiffin.plugin.openai.batches) too
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(
        None,
        description="local HF directory, .gguf file (or a directory holding one), BentoML model tag or Hugging "
        "Face hub id (org/name); None: SmolLM2-135M-Instruct; tiffin-tiny-llama: the built-in tiny model",
    )
    served_model_name: str | None = Field(None, description="the OpenAI `model` name; default: the model's name")
    timeout: float = Field(600.0, description="seconds to the first byte of a response (BentoML traffic timeout)")
    keep_alive_timeout: float = Field(
        75.0,
        gt=0,
        description="seconds an idle client connection stays open: longer than clients keep theirs (5 in httpx "
        "and the openai SDK), so that none reuses a connection the server is closing",
    )
    load_gate: str | None = Field(None, description="test hook: weight loading waits until this path exists")
    lora_roots: str | None = Field(
        None, description="directories adapters may load from (os.pathsep-separated); set: LoRA on"
    )
    api_key: str | None = Field(
        None,
        description="set: every route but /livez and /readyz needs one of these keys (comma-separated), as "
        "`Authorization: Bearer <key>` or `x-api-key: <key>`",
    )
    admin_api_key: str | None = Field(None, description="set: LoRA load/unload need this key (it opens all routes)")
    max_request_body: int = Field(10 << 20, description="bytes; a larger request body gets 413")
    max_concurrency: int | None = Field(
        None, ge=1, description="requests served at once (more: 429); None: 4 x max_num_seqs"
    )
    max_concurrency_per_key: int | None = Field(
        None,
        ge=1,
        description="requests one API key may have served at once; None: half of max_concurrency when "
        "api_key lists several keys, else no bound of its own",
    )
    min_user_priority: int | None = Field(
        0,
        description="the most urgent `priority` a user key may ask for (lower runs first; the default lets users "
        "only lower their own); the admin key and servers without keys may ask any; None: no bound",
    )
    shutdown_grace_period: float = Field(
        25.0, description="seconds running requests may take to finish after SIGTERM, before they are failed"
    )
    tool_parser: str = Field(
        "auto", description="tool-call convention: hermes, llama3_json, or auto (from the chat template)"
    )
    response_store_max_entries: int = Field(
        1000,
        ge=0,
        description="responses the Responses API keeps for previous_response_id and GET (oldest dropped); "
        "with several API keys, each key's quota is its share of this and of response_store_max_bytes",
    )
    response_store_max_bytes: int = Field(256 << 20, ge=0, description="bytes of JSON those responses may hold")
    response_store_ttl: float = Field(3600.0, gt=0, description="seconds a stored response is kept")
    max_tokenize_ids: int = Field(
        MAX_TOKENIZE_IDS,
        ge=1,
        description="token ids one /tokenize answers or /detokenize decodes (more: 400); the default, 2^20, counts "
        "any prompt that fits a 1M-token context",
    )
    gpu_type: str | None = Field(
        None, description="GPU the Bento asks for when deployed (BentoCloud names, e.g. nvidia-l4, nvidia-a100-80gb)"
    )
    gpus: int = Field(1, ge=1, description="GPUs the Bento asks for when serving on CUDA (device cuda or gpu_type set)")
    embedding_model: str | None = Field(
        None,
        description="the embedding or reranking model served beside `model`, on its device: the same kinds of names, "
        "or tiffin-tiny-bert (a built-in tiny random BERT); none or empty: none; None: all-MiniLM-L6-v2 from PyPI "
        "(offline: none, logged), none beside the built-in tiny model",
    )
    embedding_served_model_name: str | None = Field(None, description="the embedding model's OpenAI `model` name")
    embedding_task: str = Field(
        "auto", description="the embedding model's task, as `task` is the model's: embed, classify (a reranker), auto"
    )
    embedding_pooling_type: str | None = Field(None, description="the embedding model's pooling_type (mean, cls, last)")
    embedding_dtype: str = Field("auto", description="the embedding model's dtype, as `dtype` is the model's")
    embedding_step_share: float = Field(
        0.5,
        gt=0,
        description="the two engines step in turn; while chat requests run, an embedding step takes at most this "
        "share of a chat step's time (their time per token grows by at most this share), alone it takes all",
    )

    @model_validator(mode="before")
    @classmethod
    def _environment(cls, args: dict) -> dict:
        env = {
            name: os.environ[f"TIFFIN_{name.upper()}"]
            for name in cls.model_fields
            if os.environ.get(f"TIFFIN_{name.upper()}")
        }
        if os.environ.get("TIFFIN_EMBEDDING_MODEL") == "":  # set, but empty: no embedding model
            env["embedding_model"] = ""
        return {**env, **args}

    @field_validator("speculative_config", mode="before", check_fields=False)
    @classmethod
    def _speculation(cls, value):
        """Besides a mapping, its JSON, or a method's name alone (`ngram`, `suffix`) with the defaults."""
        if not isinstance(value, str):
            return value
        return json.loads(value) if value.lstrip().startswith("{") else {"method": value.strip()}

    @field_validator(
        "kv_cache_memory",
        "kv_offload_memory",
        "max_request_body",
        "grammar_cache_bytes",
        "response_store_max_bytes",
        "batch_max_file_bytes",
        mode="before",
        check_fields=False,
    )
    @classmethod
    def _bytes(cls, value):
        """Besides a byte count, "8GiB", "512MiB" and "2GB"."""
        if not isinstance(value, str):
            return value
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*", value.lower())
        if m is None:
            raise ValueError(f"must be bytes such as 8GiB or 512MiB, got {value!r}")
        return int(float(m[1]) * (1024 if m[3] else 1000) ** " kmgt".index(m[2] or " "))

    def resources(self) -> dict | None:
        """What a deployment must provide: GPUs when the engine runs on CUDA, at least one per tensor-parallel rank of
        each data-parallel replica. `device` auto decides only at start, on whatever machine the Bento lands, so a GPU
        Bento says `device=cuda`, names its `gpu_type`, or splits the model or replicates it (`tensor_parallel_size`
        or `data_parallel_size` > 1, not on `device=cpu`)."""
        ranks = self.tensor_parallel_size * self.data_parallel_size
        split = ranks > 1 and self.device != "cpu"
        if not (self.device.startswith("cuda") or self.gpu_type or split):
            return None
        gpus = max(self.gpus, ranks)
        return {"gpu": gpus} | ({"gpu_type": self.gpu_type} if self.gpu_type else {})

    def concurrency(self) -> tuple[int, int | None]:
        """max_concurrency and max_concurrency_per_key, their defaults applied."""
        total = self.max_concurrency or 4 * self.max_num_seqs
        several_keys = len([k for k in (self.api_key or "").split(",") if k.strip()]) > 1
        return total, self.max_concurrency_per_key or (max(1, total // 2) if several_keys else None)

    def engine_kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in _ENGINE_SETTINGS} | {
            "enable_lora": self.lora_roots is not None,
            "lora_roots": self.lora_roots,
        }

    def embedding_engine_kwargs(self) -> dict:
        """The embedding engine: on the chat model's device and kernels, with one step's KV blocks (a model that
        only pools sizes its cache so). Its queue holds at least four requests of the most inputs one may have: an
        input is a sequence of a few hundred tokens at most, run in one step, far cheaper than a chat sequence."""
        waiting = self.max_waiting_requests
        return {
            "device": self.device,
            "kernel_backend": self.kernel_backend,
            "task": self.embedding_task,
            "pooling_type": self.embedding_pooling_type,
            "dtype": self.embedding_dtype,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_waiting_requests": None if waiting is None else max(waiting, 4 * MAX_POOLING_INPUTS),
            "seed": self.seed,
            "engine_stall_timeout": self.engine_stall_timeout,
        }


Settings = create_model(
    "Settings",
    __base__=_ServiceSettings,
    __doc__="Service settings; each is read from `--arg name=value`, else the env var TIFFIN_<NAME>.",
    **{
        f.name: (f.type, Field(_BENTO_DEFAULTS.get(f.name, f.default), description=f.metadata["doc"]))
        for f in _ENGINE_SETTINGS
    },
)
