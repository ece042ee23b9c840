"""What the engine checks and builds of a request before it queues it: the prompt tokenized (text cut before
tokenizing where only a truncated part is kept, image placeholders expanded), chat conversations rendered, the
params checked against this model and engine. Thread-safe, so servers tokenize off the engine thread; none of it
touches the scheduler."""

import queue
from copy import deepcopy
from typing import NamedTuple

from tiffin.engine.chat import ChatSettings, render_chat
from tiffin.engine.chat import _contents as chat_contents  # the chat path's part checks and image decoding
from tiffin.engine.errors import ParamError
from tiffin.engine.multimodal.inputs import ImageInput, prompt_images
from tiffin.engine.pooling_params import PoolingParams
from tiffin.engine.sampling_params import SamplingParams
from tiffin.engine.truncation import cut_for_truncation


class TokenizedPrompt(NamedTuple):
    """A prompt as the engine runs it: its text (None when it came as token ids), its checked token ids (image
    placeholders expanded), their token types where it is a sentence pair for a cross-encoder (`tokenize_pair`),
    and its images (`multimodal.inputs`)."""

    text: str | None
    token_ids: list[int]
    token_type_ids: list[int] | None = None
    images: tuple[ImageInput, ...] = ()


PromptType = str | list[int] | dict | TokenizedPrompt


PromptType = str | list[int] | dict | TokenizedPrompt


class InputProcessor:
    """A mixin of `LLMEngine`: it reads the engine's `config`, `model_config`, `tokenizer`, `max_model_len`,
    `max_prompt_chars`, `max_token_chars`, `image_limits`, `task`, `pooling_task`, `supported_tasks`,
    `block_manager` (capacity) and `_chat_tokenizers` (a queue of tokenizer copies)."""

    def check_request(
        self, prompt: PromptType, params: SamplingParams | PoolingParams | None = None
    ) -> tuple[TokenizedPrompt, SamplingParams | PoolingParams, int]:
        """What `add_request` checks of a request, raising as it does, without touching the engine: the prompt
        tokenized (`add_request` takes it as is), the params (default: the model's task) and its max_tokens."""
        params = params or (SamplingParams() if self.task == "generate" else PoolingParams(self.pooling_task))
        self._check_params(params)
        pooling = params if isinstance(params, PoolingParams) else None
        prompt = self.tokenize(prompt, pooling)
        n = len(prompt.token_ids)
        return prompt, params, self._check_capacity(n) if pooling else self._check_lengths(n, params)

    def tokenize(
        self, prompt: PromptType, pooling: PoolingParams | None = None, fit_context: bool = True
    ) -> TokenizedPrompt:
        """The prompt's text and token ids, checked; thread-safe, so servers tokenize off the engine thread.
        ParamError for a bad prompt, and for text too long for the context, refused before tokenizing it. A dict
        prompt may say `add_special_tokens: False` (a rendered chat template). A prompt to pool (`pooling`) may
        fill the context, and is cut to `pooling.truncate_prompt_tokens` when it asks. Without `fit_context` its
        tokens may exceed the context (a prompt only counted, never run): only the text limit bounds them."""
        token_types, keep, images = None, self._truncation(pooling), ()
        if isinstance(prompt, TokenizedPrompt):
            text, token_ids, token_types, images = prompt
        elif isinstance(prompt, dict):
            text, token_ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
            if token_ids is None and not isinstance(text, str):
                raise ParamError("prompt", "prompt dict needs 'prompt' (a string) or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text, token_ids = prompt, None
        else:
            text, token_ids = None, prompt
        if token_ids is None:
            if keep is None and len(text) > self.max_prompt_chars:
                raise ParamError(
                    "prompt",
                    f"prompt has {len(text)} characters, more than the model's maximum context length of "
                    f"{self.max_model_len} tokens can hold",
                )
            try:
                special = not isinstance(prompt, dict) or prompt.get("add_special_tokens", True)
                cut = {} if keep is None else {"truncation": True, "max_length": keep}
                # of a long text to cut, only the part whose tokens truncation keeps is tokenized
                piece = text if keep is None else cut_for_truncation(self.tokenizer, text, keep, self.max_token_chars)
                token_ids = self.tokenizer.encode(piece, add_special_tokens=special, **cut)
            except Exception as e:  # e.g. a lone surrogate, which no encoding can represent
                raise ParamError("prompt", f"prompt cannot be tokenized: {e}") from None
        if not isinstance(token_ids, (list, tuple)) or not token_ids:
            raise ParamError("prompt", "prompt must be a non-empty string or a non-empty list of token ids")
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is not None or (self.image_limits and not isinstance(prompt, TokenizedPrompt)):  # placeholders checked
            token_ids, images = prompt_images(
                token_ids, data or {}, self.model_config.multimodal, self.image_limits, self.tokenizer
            )
        if keep is not None and len(token_ids) > keep:
            right = self.tokenizer.truncation_side == "right"
            token_ids = token_ids[:keep] if right else token_ids[-keep:]
            token_types = token_types and (token_types[:keep] if right else token_types[-keep:])
        text_prompt = getattr(self.model_config.multimodal, "text_prompt", None)  # a dual encoder's text rule
        if text_prompt is not None and not images:
            token_ids = text_prompt(list(token_ids))
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
            raise ParamError("prompt", f"prompt token ids must be integers in [0, {vocab})")
        if fit_context and len(token_ids) >= self.max_model_len + (pooling is not None):  # room for a token
            raise ParamError(
                "prompt",
                f"prompt has {len(token_ids)} tokens, the model's maximum context length is {self.max_model_len}"
                + ("; truncate_prompt_tokens cuts longer prompts" if pooling else ""),
            )
        if pooling and len(token_ids) > self.config.max_num_batched_tokens:  # a pooled prompt runs in one step
            raise ParamError(
                "prompt",
                f"prompt has {len(token_ids)} tokens; a prompt to pool runs in one step of at most "
                f"max_num_batched_tokens={self.config.max_num_batched_tokens}",
            )
        return TokenizedPrompt(text, list(token_ids), token_types, images)

    def tokenize_messages(self, messages: list, pooling: PoolingParams) -> TokenizedPrompt:
        """vLLM's chat-style embedding input (`messages` on /v1/embeddings) as one prompt to pool: the text parts
        (and string contents) joined by newlines, the image parts decoded and checked as chat images are; no chat
        template is applied, so a text embeds as the same text given as a prompt does. Thread-safe; ParamError
        naming `messages`."""
        if not isinstance(messages, list) or not messages:
            raise ParamError("messages", "messages must be a non-empty list of messages")
        images, texts = [], []
        for i, message in enumerate(chat_contents(messages, True, self.image_limits, images)):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, (str, list)):
                raise ParamError("messages", f"messages[{i}]: a message needs 'content', a string or a list of parts")
            texts += [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]
        prompt = {"prompt": "\n".join(texts), **({"multi_modal_data": {"image": images}} if images else {})}
        try:
            return self.tokenize(prompt, pooling)
        except ParamError as e:
            if e.param != "multi_modal_data":
                raise
            raise ParamError("messages", str(e)) from None

    def tokenize_pair(self, text_1: str, text_2: str, pooling: PoolingParams | None = None) -> TokenizedPrompt:
        """A sentence pair as a cross-encoder reads it ([CLS] a [SEP] b [SEP] for BERT, with token types), checked as
        `tokenize` checks a prompt; thread-safe."""
        for name, text in (("text_1", text_1), ("text_2", text_2)):
            if not isinstance(text, str) or len(text) > self.max_prompt_chars:
                raise ParamError(name, f"{name} must be a string the context can hold")
        keep = self._truncation(pooling)
        cut = {} if keep is None else {"truncation": True, "max_length": keep}
        encoded = self.tokenizer([text_1], [text_2], **cut)  # as a batch: a lone "" text_2 would read as no pair
        types = encoded.get("token_type_ids")
        pair = TokenizedPrompt(None, encoded["input_ids"][0], None if types is None else types[0])
        return self.tokenize(pair, pooling or PoolingParams(self.pooling_task))

    def _truncation(self, pooling: PoolingParams | None) -> int | None:
        """How many tokens a prompt to pool keeps (None: all, refused past the context)."""
        keep = None if pooling is None else pooling.truncate_prompt_tokens
        if keep is not None and keep > self.max_model_len:
            raise ParamError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens {keep} exceeds the model's maximum context length {self.max_model_len}",
            )
        return self.max_model_len if keep == -1 else keep

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, fit_context: bool = True, **template_kwargs
    ) -> TokenizedPrompt:
        """One conversation rendered within the chat template limits (tiffin.engine.chat; chat_template_max_chars
        defaults to the longest prompt `tokenize` takes) and checked as `tokenize` checks a prompt (`fit_context` as
        there); thread-safe: each render takes a copy of the tokenizer of its own, since encoding control tokens as
        text sets a flag on it for that encode. ParamError when it cannot be rendered or does not fit."""
        try:
            tokenizer = self._chat_tokenizers.get_nowait()
        except queue.Empty:
            tokenizer = deepcopy(self.tokenizer)
        config = self.config
        max_chars = config.chat_template_max_chars or self.max_prompt_chars
        settings = ChatSettings(
            config.chat_template_timeout, max_chars, config.control_tokens_in_messages, self.image_limits
        )
        try:
            rendered = render_chat(tokenizer, messages, add_generation_prompt, settings, **template_kwargs)
        finally:
            self._chat_tokenizers.put(tokenizer)
        return self.tokenize(rendered, fit_context=fit_context)

    def _check_params(self, params: SamplingParams | PoolingParams) -> None:
        """What the params cannot know: the task, limits and size of this model and engine."""
        if isinstance(params, PoolingParams):
            return self._check_pooling(params)
        if "generate" not in self.supported_tasks:
            raise ParamError("model", f"this model serves {self.task!r} (pooling) requests; it cannot generate")
        vocab = self.model_config.vocab_size
        if params.top_k > vocab:
            raise ParamError("top_k", f"top_k must be at most the vocabulary size {vocab}, got {params.top_k}")
        if params.n > self.config.max_n:
            raise ParamError("n", f"n must be at most max_n={self.config.max_n}, got {params.n}")

    def _check_pooling(self, params: PoolingParams) -> None:
        if params.task not in self.supported_tasks:
            tasks = " and ".join(map(repr, self.supported_tasks))
            raise ParamError("task", f"this model serves {tasks} requests, not {params.task!r}")
        size = getattr(self.model_config.multimodal, "embedding_size", None) or self.model_config.hidden_size
        if params.dimensions is not None and params.dimensions > size:
            raise ParamError("dimensions", f"dimensions must be at most the model's {size}, got {params.dimensions}")

    def _check_capacity(self, prompt_len: int) -> int:
        """A prompt to pool (checked against the context by `tokenize`) must fit in the KV cache; 1, its max_tokens."""
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if prompt_len > capacity:
            raise ValueError(f"request needs {prompt_len} tokens of KV cache; the whole cache holds {capacity}")
        return 1

    def _check_lengths(self, prompt_len: int, params: SamplingParams) -> int:
        """max_tokens for this request, or ValueError if the context or the KV cache can never hold it."""
        limit = self.max_model_len
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
