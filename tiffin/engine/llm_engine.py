"""The synchronous engine: requests in, one scheduled forward per `step()`, RequestOutputs out."""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer

from tiffin.engine.block_manager import BlockManager
from tiffin.engine.config import EngineConfig
from tiffin.engine.detokenizer import IncrementalDetokenizer
from tiffin.engine.lora import LoRAModel, LoRARegistry, LoRARequest
from tiffin.engine.model_runner import ModelRunner
from tiffin.engine.models.config import DTYPES
from tiffin.engine.models.registry import get_model_config
from tiffin.engine.outputs import CompletionOutput, EngineStats, Logprob, RequestOutput
from tiffin.engine.sampling_params import ParamError, SamplingParams
from tiffin.engine.scheduler import Scheduler
from tiffin.engine.sequence import Sequence

PromptType = str | list[int] | dict


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = get_model_config(config.model)
        if config.dtype != "auto":  # the user's dtype overrides the checkpoint's
            self.model_config.dtype = DTYPES[config.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self.max_model_len = self._max_model_len()
        self.eos_token_ids = frozenset(self._eos_token_ids())
        self.model_runner = ModelRunner(config, self.model_config, self.max_model_len, set(self.eos_token_ids))
        self.weight_bytes = sum(p.nbytes for p in self.model_runner.model.parameters())
        slots = self.model_runner.lora_slots
        self.lora_registry = (
            None if slots is None else LoRARegistry(slots.load, config.max_cpu_loras or config.max_loras)
        )
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.num_prompt_tokens = self.num_generation_tokens = 0

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        lora_request: LoRARequest | LoRAModel | None = None,
    ) -> None:
        """Queue a request, run with the adapter of `lora_request` if given (loaded now unless cached; a
        `load_lora` result is taken as is). Raises ValueError, leaving the engine untouched, if the request is
        invalid or can never fit in the context or the KV cache."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        max_tokens = self._check_lengths(len(token_ids), params)
        lora = None if lora_request is None else self._loras().resolve(lora_request)
        seqs = [Sequence(request_id, i, token_ids, params, max_tokens, self.eos_token_ids) for i in range(params.n)]
        for seq in seqs:
            seq.lora, seq.cache_key = lora, b"" if lora is None else lora.identity
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params)
            seq.logprobs = [] if params.logprobs is not None else None
            self.scheduler.add(seq)
        self.requests[request_id] = Request(request_id, text, token_ids, seqs)
        self.num_prompt_tokens += len(token_ids)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; return the outputs of requests that changed."""
        sched = self.scheduler.schedule()
        if not sched.seqs:
            return []
        sampled = self.model_runner.execute(sched)
        logprobs = dict(zip((s.seq_id for s in sched.sampling_seqs), sampled.logprobs))
        seqs = self.scheduler.update(sched, sampled.token_ids)
        self.num_generation_tokens += len(seqs)
        for seq in seqs:
            self._add_logprobs(seq, logprobs[seq.seq_id])
        return [self._output(self.requests[rid]) for rid in dict.fromkeys(s.request_id for s in seqs)]

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Finish these requests (unknown ids are ignored) and free their blocks; returns their final outputs."""
        outputs = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(rid)
            if request is not None:
                for seq in request.seqs:
                    if not seq.finished:
                        self.scheduler.finish(seq, "abort")
                outputs.append(self._output(request))
        return outputs

    def add_lora(self, lora: LoRARequest | LoRAModel) -> bool:
        """Register and cache an adapter (a request is loaded now; a `load_lora` result is taken as is) ahead of
        its requests. False if it was already cached; ValueError if it cannot be served or its id or name is
        taken."""
        return self._loras().add(lora)

    def load_lora(self, lora_request: LoRARequest) -> LoRAModel:
        """Read and check an adapter without touching engine state: safe from any thread, so a server can load
        adapters while the engine steps, then `add_lora` the result."""
        return self._loras().load(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter; its requests in flight finish with it. False if it was not registered."""
        return self._loras().remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters in the host cache."""
        return self._loras().cached_ids()

    def _loras(self) -> LoRARegistry:
        if self.lora_registry is None:
            raise ValueError("LoRA adapters need an engine built with enable_lora=True")
        return self.lora_registry

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            prompt_tokens=self.num_prompt_tokens,
            generation_tokens=self.num_generation_tokens,
            weight_bytes=self.weight_bytes,
        )

    def _add_logprobs(self, seq: Sequence, logprobs: dict[int, Logprob] | None) -> None:
        if logprobs is not None:
            for token_id, lp in logprobs.items():
                lp.decoded_token = self.tokenizer.decode([token_id])
            seq.logprobs.append(logprobs)

    def _output(self, request: Request) -> RequestOutput:
        """A snapshot, safe to hand to another thread. While a sequence runs, its text holds back a tail that
        may still become a stop string, so text streamed from successive outputs is never taken back."""
        outputs = [
            CompletionOutput(
                s.index,
                s.detokenizer.stream_text(s.finished),
                s.output_token_ids,
                s.finish_reason,
                s.stop_reason,
                None if s.logprobs is None else list(s.logprobs),
            )
            for s in request.seqs
        ]
        finished = request.finished
        if finished:
            del self.requests[request.request_id]
        return RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            outputs,
            finished,
            request.seqs[0].num_cached_tokens,
        )

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if token_ids is None:
                if not isinstance(text, str):
                    raise ParamError("prompt", "prompt dict needs 'prompt' (a string) or 'prompt_token_ids'")
                token_ids = self.tokenizer.encode(text)
        elif isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, prompt
        if not isinstance(token_ids, (list, tuple)) or not token_ids:
            raise ParamError("prompt", "prompt must be a non-empty string or a non-empty list of token ids")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
            raise ParamError("prompt", f"prompt token ids must be integers in [0, {vocab})")
        return text, list(token_ids)

    def _check_lengths(self, prompt_len: int, params: SamplingParams) -> int:
        """max_tokens for this request, or ValueError if the context or the KV cache can never hold it."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ParamError("prompt", f"prompt has {prompt_len} tokens, the model's maximum context length is {limit}")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = min(limit, capacity) - prompt_len
        if prompt_len + max_tokens > limit:
            raise ValueError(
                f"this model's maximum context length is {limit} tokens, but {prompt_len + max_tokens} were "
                f"requested ({prompt_len} in the prompt, {max_tokens} max_tokens)"
            )
        if max_tokens < 1 or prompt_len + max_tokens > capacity:
            raise ValueError(
                f"request needs {prompt_len + max_tokens} tokens of KV cache; the whole cache holds {capacity}"
            )
        return max_tokens

    def _max_model_len(self) -> int:
        mc = self.model_config
        limit = mc.max_position_embeddings
        if mc.sliding_window:  # attention here is full; beyond the window it would differ from the model's
            limit = min(limit, mc.sliding_window)
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's limit of {limit}")
        return self.config.max_model_len

    def _eos_token_ids(self) -> set[int]:
        ids = set()
        gen_config = Path(self.config.model) / "generation_config.json"
        if gen_config.exists():
            eos = json.loads(gen_config.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids
