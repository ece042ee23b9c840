"""The synchronous engine: requests in, one scheduled forward per `step()`, RequestOutputs out.

A step that raises is retried on halves of its batch until each failing request runs alone: only those fail
(their outputs carry `error`), the others sample exactly what the full batch would have given them. When
every request of a batch fails alone and a one-token probe forward fails too, the engine itself is broken:
`step()` raises EngineDeadError. A speculative proposer that raises fails nobody: the step runs without
proposals."""

import dataclasses
import functools
import logging
import os
import queue
import threading
import traceback
from concurrent.futures import FIRST_COMPLETED, wait
from copy import deepcopy

from tiffin.engine.config import EngineConfig
from tiffin.engine.core.detokenizer import IncrementalDetokenizer
from tiffin.engine.core.scheduler import Scheduler, SchedulerOutput
from tiffin.engine.core.sequence import Sequence
from tiffin.engine.core.thinking import ThinkingState
from tiffin.engine.core.window_blocks import new_block_manager
from tiffin.engine.distributed.join import batches_in_flight
from tiffin.engine.errors import EngineDeadError, ParamError, QueueFull
from tiffin.engine.input_processor import InputProcessor, PromptType
from tiffin.engine.lora.peft import parse_roots
from tiffin.engine.lora.registry import LoRARegistry
from tiffin.engine.lora.request import LoRAModel, LoRARequest
from tiffin.engine.models.bert import with_token_types
from tiffin.engine.models.config import resolve_dtype
from tiffin.engine.models.loader import checkpoint_signature, get_model_config
from tiffin.engine.models.source import eos_token_ids, load_tokenizer, resolve_model_path
from tiffin.engine.multimodal.inputs import ImageLimits
from tiffin.engine.outputs import EngineStats, PoolingRequestOutput, RequestOutput
from tiffin.engine.pipelined import BatchQueue
from tiffin.engine.pooling_params import PoolingParams
from tiffin.engine.reasoning import opens_thinking, resolve_reasoning_parser
from tiffin.engine.request_state import Request, decode_logprobs
from tiffin.engine.sampling_params import SamplingParams
from tiffin.engine.sleep_mode import SleepMode
from tiffin.engine.spec_decode import make_proposer
from tiffin.engine.spec_decode.draft import load_draft
from tiffin.engine.structured.backend import GrammarBackend, GrammarState
from tiffin.engine.worker.model_runner import ModelRunner
from tiffin.engine.worker.sampler import SamplerOutput

# what a pooling sequence carries as its SamplingParams: it never samples
_POOLING_SAMPLING = SamplingParams(temperature=0, max_tokens=1)
# A prompt longer than this many characters per token of the context is refused before tokenizing: no token of
# the vocabulary is longer, with room for normalizers that shrink text (NFC composes up to 3 characters into 1).
PROMPT_CHARS_SLACK = 4
# A prompt given as token ids opens a thinking block if the text of this many last tokens does (a chat template's
# generation prompt is a few tokens; decoding the whole prompt each request would cost more than its markers need).
THINKING_PROMPT_TAIL = 32

logger = logging.getLogger(__name__)


class LLMEngine(InputProcessor, SleepMode):
    def __init__(self, config: EngineConfig):
        """`config.model` may be a hub id; the engine's config holds the local path it resolved to."""
        config = dataclasses.replace(config, model=resolve_model_path(config.model, config.revision))
        self.config = config
        self.model_config = get_model_config(config.model, config.task, config.pooling_type, config.quantization)
        self.task = self.model_config.task  # "generate", "embed" or "classify": its requests' default
        # what requests it takes (vLLM's supported tasks): a decoder that generates also embeds, beside its generations
        self.pooling_task = "classify" if self.task == "classify" else "embed"  # of pooling requests saying none
        self.supported_tasks = (
            (self.task, "embed") if self.model_config.pooler and self.task == "generate" else (self.task,)
        )
        self.model_config.dtype = resolve_dtype(config.dtype, self.model_config.dtype, config.torch_device)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        # render_chat's copies, one per render at once: a copy takes ~0.2 s, so the first is made here, not in a chat
        self._chat_tokenizers = queue.SimpleQueue()
        self._chat_tokenizers.put(deepcopy(self.tokenizer))
        self.max_model_len = self.model_config.max_model_len(config.max_model_len)
        self.image_limits = ImageLimits.of(config, self.model_config.multimodal)  # None: a text-only model
        # the most characters one token stands for (its vocabulary's longest string: a byte-level token's characters
        # are its bytes, at least its text's characters), once per tokenizer: it bounds the text a prompt cut to
        # n tokens needs (cut_for_truncation)
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()))
        self.max_prompt_chars = PROMPT_CHARS_SLACK * self.max_model_len * self.max_token_chars
        self.eos_token_ids = frozenset(eos_token_ids(config.model, self.tokenizer))
        # the think markers of a reasoning model (None: it does not think)
        self.reasoning = resolve_reasoning_parser(
            config.reasoning_parser, getattr(self.tokenizer, "chat_template", None)
        )
        # what a spent thinking budget forces: the end marker's ids, encoded alone
        self.think_end_ids = (
            None if self.reasoning is None else self.tokenizer.encode(self.reasoning.end, add_special_tokens=False)
        )
        spec = config.speculative_config
        # a draft model's weights load first: the target sizes its KV pool with the draft's (`ModelRunner.start`)
        draft = (
            load_draft(spec, config, self.model_config, self.max_model_len)
            if spec is not None and spec.method == "draft_model"
            else None
        )
        self.model_runner = ModelRunner(
            config, self.model_config, self.max_model_len, set(self.eos_token_ids), draft=draft
        )
        self.weight_bytes = sum(p.nbytes for p in self.model_runner.model.parameters())
        self.weights_signature = checkpoint_signature(config.model)  # what `update_weights` checks against
        slots = self.model_runner.lora_slots
        roots = None if config.lora_roots is None else parse_roots(config.lora_roots)
        self.lora_registry = (
            None
            if slots is None
            else LoRARegistry(functools.partial(slots.load, roots=roots), config.max_cpu_loras or config.max_loras)
        )
        # an encoder's KV depends on the tokens after it: never a prefix to reuse
        prefix_caching = config.enable_prefix_caching and self.model_config.causal
        runner = self.model_runner
        self.block_manager = new_block_manager(
            runner.num_blocks, config.block_size, prefix_caching, runner.num_host_blocks, runner.kv_window
        )
        self.scheduler = Scheduler(config, self.block_manager, self.max_model_len)
        self.proposer = None if spec is None else make_proposer(spec, config, self.model_runner, draft)
        self.batches = BatchQueue(self, batches_in_flight(config)) if config.pipeline_parallel_size > 1 else None
        self.requests: dict[str, Request] = {}
        self.num_prompt_tokens = 0
        self.num_pooling_requests = self.num_pooling_tokens = 0
        self.last_step_tokens = 0
        self._failed: list[str] = []  # requests failed during this step
        self._proposer_errors: set[tuple] = set()  # (type, file, line) of the proposer failures logged
        self._grammar_backend: GrammarBackend | None = None  # made for the first structured-outputs request
        self._grammar_backend_lock = threading.Lock()
        self.check_invariants = os.environ.get("TIFFIN_CHECK_INVARIANTS") == "1"  # after every step (tests set it)

    def _check_queue_room(self, n: int, client: str | None) -> None:
        own_limit = self.config.max_waiting_per_client if client is not None else None
        if own_limit is not None and n > own_limit:
            raise ParamError("n", f"n={n} sequences never fit max_waiting_per_client={own_limit}")
        waiting, limit = len(self.scheduler.waiting), self.config.max_waiting_requests
        if limit is not None and waiting + n > limit:
            raise QueueFull(f"{waiting} sequences are waiting (max_waiting_requests={limit}); retry later")
        if own_limit is not None and (own := sum(s.client == client for s in self.scheduler.waiting)) + n > own_limit:
            raise QueueFull(f"{own} of this client's sequences are waiting (max_waiting_per_client={own_limit})")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        lora_request: LoRARequest | LoRAModel | None = None,
        client: str | None = None,
    ) -> None:
        """Queue a request, run with the adapter of `lora_request` if given (loaded now unless cached; a
        `load_lora` result is taken as is). `params`: SamplingParams to generate, PoolingParams to embed or score
        (default: the model's task). Raises ValueError, leaving the engine untouched, if the request is invalid,
        not the model's task, or can never fit in the context or the KV cache; QueueFull if max_waiting_requests
        sequences wait already, or max_waiting_per_client of `client`'s; EngineAsleep while it sleeps. A
        `TokenizedPrompt` (what `tokenize` returns) is not tokenized again. `client`: who sent it, for fair share
        (None: anonymous)."""
        self.check_awake()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        (text, token_ids, token_types, images), params, max_tokens = self.check_request(prompt, params)
        pooling = params if isinstance(params, PoolingParams) else None
        n = 1 if pooling else params.n
        self._check_queue_room(n, client)
        lora = None if lora_request is None else self._loras().resolve(lora_request)
        if pooling and images and self.task == "generate":  # a dual encoder (CLIP, SigLIP) pools its images
            raise ParamError("multi_modal_data", "images are served in generation requests only")
        if pooling:
            seq_ids = token_ids if token_types is None else with_token_types(token_ids, token_types)
            pooled = {"pooling_params": pooling, "client": client, "images": images}
            seq = Sequence(request_id, 0, seq_ids, _POOLING_SAMPLING, max_tokens, lora=lora, **pooled)
            self.scheduler.add(seq)
            self.requests[request_id] = Request(request_id, text, token_ids, [seq])
            self.num_pooling_requests += 1
            self.num_pooling_tokens += len(token_ids)
            return
        grammar = None if params.structured_outputs is None else self.grammars().compile(params.structured_outputs)
        opened = self.reasoning is not None and opens_thinking(
            text if text is not None else self.tokenizer.decode(token_ids[-THINKING_PROMPT_TAIL:]), self.reasoning
        )
        seqs = [
            Sequence(
                request_id,
                i,
                token_ids,
                params,
                max_tokens,
                self.eos_token_ids,
                lora,
                None if grammar is None else GrammarState(grammar, self.config.grammar_compile_timeout),
                IncrementalDetokenizer(self.tokenizer, token_ids, params),
                client=client,
                images=images,
            )
            for i in range(params.n)
        ]
        for seq in seqs:
            seq.thinking = self._thinking(opened, params, seq.grammar)
            self.scheduler.add(seq)
        self.requests[request_id] = Request(request_id, text, token_ids, seqs)
        self.num_prompt_tokens += len(token_ids)

    def _thinking(self, opened: bool, params: SamplingParams, grammar: GrammarState | None) -> ThinkingState | None:
        """A sequence's thinking state (tiffin.engine.core.thinking): none for a model that does not think, nor
        when a grammar governs the output from its first token (the prompt did not open a thinking block)."""
        if self.reasoning is None or (grammar is not None and not opened):
            return None
        return ThinkingState(self.reasoning, self.think_end_ids, opened, params.thinking_token_budget, grammar)

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; return the outputs of requests that changed (failed ones included). Under
        pipeline parallelism, start a batch or finish the oldest in flight (`pipelined`)."""
        failed = self._fail_broken_grammars()
        if self.batches is not None:
            return failed + self.batches.step()
        scheduler_output = self.schedule_step()
        if not scheduler_output.seqs:
            self._wait_for_grammars()
            return failed
        return failed + self.finish_step(*self._execute(scheduler_output))

    def schedule_step(self, budget: int | None = None) -> SchedulerOutput:
        """The next step's sequences (`budget`: `Scheduler.schedule`'s), with their proposals and the block copies
        due before it."""
        scheduler_output = self.scheduler.schedule(budget)
        self.last_step_tokens = sum(scheduler_output.num_scheduled_tokens)
        if scheduler_output.seqs:  # else the copies wait for a step that runs
            if self.proposer is not None:
                self._speculate(scheduler_output)
            scheduler_output.copies = self.block_manager.take_copies()
        return scheduler_output

    def finish_step(self, scheduler_output: SchedulerOutput, sampled: SamplerOutput) -> list[RequestOutput]:
        """Advance what ran (`scheduler_output`) by what it sampled; the outputs of the requests that changed."""
        if not scheduler_output.seqs:
            self._probe()
        seqs = self.scheduler.update(
            scheduler_output,
            sampled.token_ids,
            sampled.pooled,
            sampled.accepted,
            sampled.logprobs,
            sampled.prompt_logprobs,
        )
        for seq in seqs:
            decode_logprobs(seq, self.tokenizer)
        changed, self._failed = [*self._failed, *(s.request_id for s in seqs)], []
        if self.check_invariants:
            sched = self.scheduler
            self.block_manager.check_invariants([*sched.running, *sched.waiting, *sched.swapped])
        return [self._output(self.requests[rid]) for rid in dict.fromkeys(changed) if rid in self.requests]

    def _speculate(self, scheduler_output: SchedulerOutput) -> None:
        """Proposals for the step's decodes, unless too many sequences run; with structured outputs, only as many
        as the grammar takes; while thinking, none past a forced token or while the grammar waits."""
        limit = self.config.spec_batch_limit()
        decodes = [] if limit is not None and len(self.scheduler.running) >= limit else scheduler_output.decodes()
        if not decodes:
            return
        try:
            self.proposer.propose(decodes)
        except Exception as e:
            self._proposer_failed(decodes, e)
            return
        for seq in decodes:
            if seq.thinking is not None and (cap := seq.thinking.max_proposals(seq.num_output_tokens)) is not None:
                del seq.spec_token_ids[cap:]
            if seq.grammar is not None and seq.spec_token_ids:
                synced = seq.grammar.sync(seq.output_token_ids)
                del seq.spec_token_ids[seq.grammar.accepted_prefix(seq.spec_token_ids) if synced else 0 :]
        self.scheduler.schedule_proposals(scheduler_output)

    def _proposer_failed(self, decodes: list[Sequence], error: Exception) -> None:
        """Proposals only save time: when proposing raises, the step's decodes run without any, emitting what they
        would have. Logged once per place that raised (a failing draft could otherwise log every step). Every
        step tries again: a failure may come from one request's input, which will finish, and a failed round costs
        only its own time (the draft proposer starts its shadows over)."""
        for seq in decodes:  # a proposer may have set some before it raised
            seq.spec_token_ids, seq.spec_probs = [], None
        frame = traceback.extract_tb(error.__traceback__)[-1]
        where = (type(error), frame.filename, frame.lineno)
        if where not in self._proposer_errors:
            self._proposer_errors.add(where)
            logger.error("proposer failed, step runs without proposals (logged once per raising line)", exc_info=error)

    def _execute(self, scheduler_output: SchedulerOutput) -> tuple[SchedulerOutput, SamplerOutput]:
        """Run `scheduler_output`; if it raises, run each half (recursively) and fail the requests that fail alone.
        Returns what ran and what it sampled, in `scheduler_output` order."""
        try:
            return scheduler_output, self.model_runner.execute(scheduler_output)
        except EngineDeadError:  # a tensor-parallel rank is gone: no retry can succeed
            raise
        except Exception as e:
            if len(scheduler_output.seqs) == 1:
                self._fail(scheduler_output.seqs[0].request_id, e)
                return SchedulerOutput(), SamplerOutput([], [])
        ran, sampled = SchedulerOutput(), SamplerOutput([], [])
        mid = len(scheduler_output.seqs) // 2
        for part in (range(mid), range(mid, len(scheduler_output.seqs))):
            alive = [i for i in part if not scheduler_output.seqs[i].finished]  # not a failed request's other samples
            if alive:
                part_ran, part_sampled = self._execute(scheduler_output.select(alive))
                for seq, num_new in zip(part_ran.seqs, part_ran.num_scheduled_tokens):
                    ran.add(seq, num_new)
                sampled.token_ids += part_sampled.token_ids
                sampled.accepted += part_sampled.accepted
                sampled.logprobs += part_sampled.logprobs
                sampled.prompt_logprobs += part_sampled.prompt_logprobs
                sampled.pooled += part_sampled.pooled
        return ran, sampled

    def _fail(self, request_id: str, error: Exception) -> None:
        logger.error("request %s failed in the engine", request_id, exc_info=error)
        request = self.requests[request_id]
        request.error = f"{type(error).__name__}: {error}"
        for seq in request.seqs:
            if not seq.finished:
                self.block_manager.forget_uncomputed(seq)
                self.scheduler.finish(seq, "abort")
        self._failed.append(request_id)

    def _probe(self) -> None:
        """Every request of the step failed: a one-token forward on a block of its own tells whether the
        requests or the engine are at fault."""
        seq = Sequence("probe", 0, [0], SamplingParams(temperature=0, max_tokens=1), 1)
        if not self.block_manager.allocate_slots(seq, 1):
            return
        probe = SchedulerOutput(copies=self.block_manager.take_copies())  # before its forward writes the block
        probe.add(seq, 1)
        try:
            self.model_runner.execute(probe)
        except Exception as e:
            raise EngineDeadError(f"the engine cannot run a forward: {type(e).__name__}: {e}") from e
        finally:
            self.block_manager.free_seq(seq)

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

    def grammars(self) -> GrammarBackend:
        """The structured-outputs backend, made for the first request that needs one; safe from any thread (a
        server compiles a request's grammar before handing the request to the engine)."""
        with self._grammar_backend_lock:
            if self._grammar_backend is None:
                self._grammar_backend = GrammarBackend(
                    self.tokenizer,
                    self.model_config.vocab_size,
                    self.eos_token_ids,
                    cache_bytes=self.config.grammar_cache_bytes,
                )
            return self._grammar_backend

    def _fail_broken_grammars(self) -> list[RequestOutput]:
        """Finish the waiting sequences whose grammar failed to compile: only their requests fail."""
        broken = [s for s in self.scheduler.waiting if s.grammar is not None and s.grammar.error]
        for seq in broken:
            self.scheduler.finish(seq, "error", seq.grammar.error)
        return [self._output(self.requests[rid]) for rid in dict.fromkeys(s.request_id for s in broken)]

    def _wait_for_grammars(self) -> None:
        """Nothing could run: if that is for grammars still compiling, wait for one instead of spinning."""
        pending = {s.grammar.compiled for s in self.scheduler.waiting if s.grammar is not None and not s.grammar.ready}
        if pending:
            wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)

    def _loras(self) -> LoRARegistry:
        if self.lora_registry is None:
            raise ValueError("LoRA adapters need an engine built with enable_lora=True")
        return self.lora_registry

    def shutdown(self) -> None:
        """End the engine's worker processes (tensor parallelism); the engine cannot step afterwards."""
        self.model_runner.shutdown()

    def failure(self) -> str | None:
        """Why the engine cannot step, found without stepping: a tensor-parallel worker that died or failed."""
        group = self.model_runner.group
        return None if group is None else group.broken

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        bm, runner = self.block_manager, self.model_runner
        host_bytes = sum(
            pool.num_used_blocks * spec.bytes_per_block
            for pool, spec in ((bm.tier, runner.tier_spec), (bm.swap, runner.kv_spec))
            if pool is not None
        )
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_used=bm.num_used_blocks,
            kv_bytes_per_token=runner.kv_spec.bytes_per_token,
            host_kv_bytes_used=host_bytes,
            num_preemptions=self.scheduler.num_preemptions,
            swapped_out_seqs=self.scheduler.num_swapped_out,
            swapped_in_seqs=self.scheduler.num_swapped_in,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            host_tier_hits=bm.host_tier_hits,
            host_tier_evictions=0 if bm.tier is None else bm.tier.evictions,
            prefill_tokens=self.scheduler.num_prefill_tokens,
            prompt_tokens=self.num_prompt_tokens,
            pooling_requests=self.num_pooling_requests,
            pooling_tokens=self.num_pooling_tokens,
            generation_tokens=self.scheduler.num_generated_tokens,
            spec_drafts=self.scheduler.spec_drafts,
            spec_draft_tokens=self.scheduler.spec_draft_tokens,
            spec_accepted_tokens=self.scheduler.spec_accepted_tokens,
            spec_accepted_per_pos=tuple(self.scheduler.spec_accepted_per_pos.tolist()),
            weight_bytes=self.weight_bytes,
        )

    def _output(self, request: Request) -> RequestOutput | PoolingRequestOutput:
        output = request.snapshot()
        if output.finished:
            del self.requests[request.request_id]
        return output
