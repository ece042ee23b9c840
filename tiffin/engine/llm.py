"""The offline entry point, shaped like vLLM's `LLM`."""

from tqdm.auto import tqdm

from tiffin.engine.config import EngineConfig
from tiffin.engine.llm_engine import LLMEngine, PromptType, TokenizedPrompt
from tiffin.engine.lora.request import LoRARequest
from tiffin.engine.outputs import RequestOutput
from tiffin.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **kwargs):
        self.llm_engine = LLMEngine(EngineConfig(model=str(model), **kwargs))
        self._counter = 0

    def shutdown(self) -> None:
        """End the engine's worker processes (tensor parallelism); they also end when this object is collected."""
        self.llm_engine.shutdown()

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
        if isinstance(prompts, (str, dict, TokenizedPrompt)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        engine, ids = self.llm_engine, []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                ids.append(str(self._counter))
                self._counter += 1
                engine.add_request(ids[-1], prompt, p or SamplingParams(), lora)
        except ValueError as e:
            engine.abort_request(ids)
            raise ValueError(f"prompt {len(ids) - 1}: {e}") from e
        return self._run(ids, use_tqdm)

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

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm) as bar:
            while self.llm_engine.has_unfinished_requests():
                for out in self.llm_engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update()
        return [finished[i] for i in ids]
