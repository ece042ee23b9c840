"""AsyncLLMEngine's pooling calls: `encode` one prompt to its pooled output, `score` pairs of texts (a
cross-encoder's classify task on each pair, else the cosine of their embeddings, each text embedded once)."""

import asyncio
import uuid

from tiffin.engine.errors import EngineError
from tiffin.engine.input_processor import PromptType
from tiffin.engine.outputs import PoolingRequestOutput
from tiffin.engine.pooling_params import PoolingParams
from tiffin.engine.scoring import cosine_scores, score_pairs


class AsyncPooling:
    """Holds `engine`, `task`, `tokenizing` and `add_request` (AsyncLLMEngine's)."""

    async def encode(
        self, prompt: PromptType, pooling_params: PoolingParams | None = None, request_id: str | None = None
    ) -> PoolingRequestOutput:
        """Pool one prompt (the model's task by default): its finished output. Refused as `add_request` refuses;
        EngineError when the engine failed it. Cancelling the call aborts the request."""
        params = pooling_params or PoolingParams(self.engine.pooling_task)
        stream = await self.add_request(request_id or uuid.uuid4().hex, prompt, params)
        try:
            async for out in stream:
                if out.finished:
                    return out
        finally:
            stream.close()
        raise EngineError(f"request {stream.request_id} ended without a result")

    async def score(
        self, text_1: str | list[str], text_2: str | list[str], truncate_prompt_tokens: int | None = None
    ) -> list[float]:
        """`LLM.score`'s scores of the pairs, all requests at once: the first failure cancels (aborts) the rest."""
        pairs = score_pairs(text_1, text_2)
        params = PoolingParams(self.engine.pooling_task, truncate_prompt_tokens=truncate_prompt_tokens)
        if self.task == "classify":
            prompts = [await self.tokenizing.run(self.engine.tokenize_pair, a, b, params) for a, b in pairs]
            return [o.outputs.score for o in await self._encode_all(prompts, params)]
        firsts, seconds = zip(*pairs)
        unique = list(dict.fromkeys([*firsts, *seconds]))  # one text against many: embedded once
        embedded = dict(zip(unique, await self._encode_all(unique, params)))
        outputs = cosine_scores(
            list(map(str, range(len(pairs)))), [embedded[a] for a in firsts], [embedded[b] for b in seconds]
        )
        return [o.outputs.score for o in outputs]

    async def _encode_all(self, prompts: list[PromptType], params: PoolingParams) -> list[PoolingRequestOutput]:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.encode(p, params)) for p in prompts]
        except ExceptionGroup as failed:  # the first failure, as a single call would raise it
            raise failed.exceptions[0] from None
        return [t.result() for t in tasks]
