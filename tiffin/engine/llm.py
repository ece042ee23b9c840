"""The offline entry point, shaped like vLLM's `LLM`.

One call takes any number of prompts. The engine's serving bounds (max_waiting_requests, the grammars compiling at
once), which a server answers with 429, are backpressure here: every prompt is checked first (a bad one raises,
naming it, before any request is queued), then requests are queued as the engine makes room, between its steps."""

from collections import deque
from typing import NamedTuple

from tqdm.auto import tqdm

from tiffin.engine.config import EngineConfig
from tiffin.engine.data_parallel import make_engine
from tiffin.engine.errors import ParamError, QueueFull
from tiffin.engine.input_processor import PromptType, TokenizedPrompt
from tiffin.engine.lora.request import LoRARequest
from tiffin.engine.outputs import PoolingRequestOutput, RequestOutput
from tiffin.engine.pooling_params import PoolingParams
from tiffin.engine.sampling_params import SamplingParams
from tiffin.engine.scoring import cosine_scores, score_pairs


class _Queued(NamedTuple):
    """A checked request of a call, waiting for room in the engine."""

    index: int  # its prompt's, in the call
    request_id: str
    prompt: TokenizedPrompt
    params: SamplingParams | PoolingParams
    lora: LoRARequest | None


class LLM:
    def __init__(self, model: str, **kwargs):
        self.llm_engine = make_engine(EngineConfig(model=str(model), **kwargs))
        self._counter = 0

    def shutdown(self) -> None:
        """End the engine's worker processes (tensor parallelism); they also end when this object is collected."""
        self.llm_engine.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights too (level 2) until `wake_up` (tiffin.engine.sleep_mode)."""
        self.llm_engine.sleep(level)

    def wake_up(self) -> None:
        self.llm_engine.wake_up()

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (False, changing nothing, while requests hold blocks)."""
        return self.llm_engine.reset_prefix_cache()

    def update_weights(self, path: str) -> None:
        """Serve the weights of the checkpoint at `path`, which must match the served one's architecture and shapes
        (checked first: a mismatch raises ValueError and the old weights stay)."""
        self.llm_engine.update_weights(path)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. `lora_request`: one adapter for all
        prompts or one (or None: the base model) per prompt. An invalid prompt raises ValueError before any
        request is queued."""
        params = SamplingParams() if sampling_params is None else sampling_params
        return self._run(self._add(prompts, params, lora_request), use_tqdm)

    def encode(
        self,
        prompts: PromptType | list[PromptType],
        pooling_params: PoolingParams | list[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pool every prompt (a pooling model's task by default); outputs come back in input order."""
        pooling_params = pooling_params or PoolingParams(self.llm_engine.pooling_task)
        return self._run(self._add(prompts, pooling_params, lora_request), use_tqdm)

    def embed(
        self,
        prompts: PromptType | list[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.embed`: each prompt's embedding, `outputs.embedding`."""
        params = pooling_params or PoolingParams("embed", truncate_prompt_tokens=truncate_prompt_tokens)
        return self.encode(prompts, params, use_tqdm)

    def score(
        self,
        data_1: str | list[str],
        data_2: str | list[str],
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.score`: `outputs.score` of each (text_1, text_2) pair, one text against many or two lists
        pairwise; a cross-encoder's relevance, or an embedding model's cosine similarity."""
        pairs, engine = score_pairs(data_1, data_2), self.llm_engine
        params = PoolingParams(engine.pooling_task, truncate_prompt_tokens=truncate_prompt_tokens)
        if engine.task == "classify":
            return self.encode([engine.tokenize_pair(a, b, params) for a, b in pairs], params, use_tqdm)
        firsts, seconds = zip(*pairs)
        embeddings = self.encode([*firsts, *seconds], params, use_tqdm)
        return cosine_scores([str(i) for i in range(len(pairs))], embeddings[: len(pairs)], embeddings[len(pairs) :])

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered by the tokenizer's chat template
        (`LLMEngine.render_chat`: within the engine's chat template limits, control tokens in messages as text)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = chat_template_kwargs or {}
        prompts = [self.llm_engine.render_chat(c, add_generation_prompt, **kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add(self, prompts, params, lora_request) -> list[_Queued]:
        """Check every prompt with its params (one for all, or one each) and adapter, and give it a request id;
        an invalid prompt raises ValueError, naming it, before any request is queued."""
        if isinstance(prompts, (str, dict, TokenizedPrompt)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        engine, queued = self.llm_engine, []
        limit = engine.config.max_waiting_requests
        for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras)):
            try:
                prompt, p, _ = engine.check_request(prompt, p)
                n = getattr(p, "n", 1)
                if limit is not None and n > limit:  # it would never find room
                    raise ValueError(f"a request of {n} sequences never fits max_waiting_requests={limit}")
            except ValueError as e:
                raise _named(i, e) from e
            queued.append(_Queued(i, str(self._counter), prompt, p, lora))
            self._counter += 1
        return queued

    def _run(self, queued: list[_Queued], use_tqdm: bool) -> list[RequestOutput | PoolingRequestOutput]:
        """Queue the requests as the engine makes room and step it until every one has finished; their outputs in
        input order. Whatever raises aborts the call's requests left in the engine."""
        engine, finished = self.llm_engine, {}
        waiting = deque(queued)
        try:
            with tqdm(total=len(queued), desc="Generating", disable=not use_tqdm) as bar:
                while waiting or engine.has_unfinished_requests():
                    self._admit(waiting)
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update()
        except BaseException:
            engine.abort_request([q.request_id for q in queued])
            raise
        return [finished[q.request_id] for q in queued]

    def _admit(self, waiting: deque[_Queued]) -> None:
        """Queue waiting requests, in order, until none is left or the engine is full (QueueFull) while it holds
        requests, whose steps make room. An idle engine is full only of compiles an earlier call left: wait for one."""
        engine = self.llm_engine
        while waiting:
            q = waiting[0]
            try:
                engine.add_request(q.request_id, q.prompt, q.params, q.lora)
            except QueueFull:
                if engine.has_unfinished_requests():
                    return
                if not engine.grammars().wait_for_room():  # not the compile queue: stepping would not help
                    raise
                continue
            except ValueError as e:  # e.g. an adapter that cannot load
                raise _named(q.index, e) from e
            waiting.popleft()


def _named(index: int, e: ValueError) -> ValueError:
    """`e` as raised for the call's prompt `index`."""
    message = f"prompt {index}: {e}"
    return ParamError(e.param, message) if isinstance(e, ParamError) else ValueError(message)
