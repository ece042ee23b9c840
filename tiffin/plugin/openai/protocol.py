"""The OpenAI request bodies and their validation into `SamplingParams`.

Invariants:
- Validation errors carry the OpenAI `param` they concern: a refusal beyond the field types is an `APIError`
  (OpenAI's error shape, `APIError.body()`); a field-type error is pydantic's, which the app answers the same way.
- Numbers and booleans are strict: a string is never coerced into one, and a JSON integer is a valid float.
- Every string in a body is valid Unicode: a JSON-escaped lone surrogate is refused before it reaches the
  tokenizer or a JSON response. No field nests objects and arrays deeper than json_values.MAX_DEPTH.
- A field sent as null means its default; unknown fields are ignored."""

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, Strict, model_validator

from tiffin.engine.errors import ParamError
from tiffin.engine.pooling_params import PoolingParams
from tiffin.engine.sampling_params import SamplingParams
from tiffin.plugin.openai.json_values import check_value
from tiffin.plugin.openai.structured import ResponseFormat, request_structured_outputs
from tiffin.plugin.openai.tools import ChatTool, ToolChoice, ToolParser

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # accepts JSON integers, not strings or booleans
Bool = Annotated[bool, Strict()]
Name = Annotated[str, Strict(), Field(max_length=256)]  # echoed back in errors: kept short
Text = Annotated[str, Strict()]
# Inputs one embeddings request may hold (OpenAI's own bound), and documents or pairs one score or rerank request:
# each is an engine request, queued at once.
MAX_POOLING_INPUTS = 2048


class APIError(Exception):
    """A refused or failed request, answered with `status` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def renamed(self, names: dict[str, str]) -> "APIError":
        """This refusal of a chat request made from another API's request, naming that API's field (`names`: chat
        field -> its name there)."""
        name = names.get(self.param)
        if name is None:
            return self
        prefixed = self.message.startswith(self.param)
        message = name + self.message.removeprefix(self.param) if prefixed else f"{name}: {self.message}"
        return APIError(self.status, message, self.type, name, self.code)


def image_url_part(url: Any, where: str, param: str) -> dict:
    """An image of another API's request (a Response's `input_image`, a Messages `image` block) as the chat
    `image_url` part it stands for: one path decodes and checks every API's images (`engine.chat`)."""
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{where}: an image needs its URL, a non-empty string (a data: URL)", param=param)
    return {"type": "image_url", "image_url": {"url": url}}


def bad_request(e: ValueError) -> APIError:
    """A refused request as a 400, naming the parameter at fault when validation raised a ParamError."""
    return APIError(400, str(e), param=e.param if isinstance(e, ParamError) else None)


class _Body(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _valid_values(cls, body):
        """Every field within tiffin.plugin.openai.json_values's bounds (nesting, valid Unicode), before anything
        that recurses reads it."""
        for key, value in body.items() if isinstance(body, dict) else ():
            try:
                check_value(value, key)
            except ValueError as e:
                raise APIError(400, str(e), param=key) from None
        return body


class StreamOptions(BaseModel):
    include_usage: Bool = False


class SamplingRequest(_Body):
    """Fields shared by /completions and /chat/completions (null means the default)."""

    model_config = ConfigDict(extra="ignore")
    model: Name | None = None
    n: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, float] | None = None
    user: Name | None = None
    stream: Bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: Bool | None = None
    min_tokens: Int | None = None
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: Bool | None = None
    skip_special_tokens: Bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json | regex | choice | grammar | json_object
    priority: Int | None = None  # scheduling_policy priority: lower first
    prompt_logprobs: Int | None = None  # the prompt tokens' logprobs and top k (not streamed, as vLLM's)
    thinking_token_budget: Int | None = Field(  # the issue tracker's and Dynamo's name too
        None, validation_alias=AliasChoices("thinking_token_budget", "max_thinking_tokens")
    )

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, tool_parser: ToolParser | None = None
    ) -> SamplingParams:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs is not available with stream: true", param="prompt_logprobs")
        given = {k: v for k, v in self.model_dump(include=_SAMPLING_FIELDS).items() if v is not None}
        try:
            structured = request_structured_outputs(
                self.response_format, self.structured_outputs, *self._tool_request(), tool_parser
            )
            return SamplingParams(**given, max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured)
        except ValueError as e:
            raise bad_request(e) from None

    def _tool_request(self) -> tuple:
        """(tools, tool_choice, parallel_tool_calls) where the endpoint takes tools."""
        return None, None, True

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_SAMPLING_FIELDS = {
    "n",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "priority",
    "prompt_logprobs",
    "thinking_token_budget",
}
# apply_chat_template's own arguments, which chat_template_kwargs (variables for the template) may not set
_TEMPLATE_ARGUMENTS = frozenset(
    "conversation messages tools documents chat_template add_generation_prompt continue_final_message tokenize "
    "sanitize_control_tokens padding truncation max_length return_tensors return_dict return_assistant_tokens_mask "
    "tokenizer_kwargs".split()
)


def checked_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs, refused (400) when one would set an argument of apply_chat_template's own or
    is not a name a template can read."""
    refused = sorted(_TEMPLATE_ARGUMENTS.intersection(kwargs or ())) or [
        k for k in kwargs or () if not k.isidentifier()
    ]
    if refused:
        message = f"chat_template_kwargs may not set {refused[0]!r}: a field of its own, fixed, or not a name"
        raise APIError(400, message, param="chat_template_kwargs")
    return dict(kwargs or {})


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16  # null: up to the context length
    logprobs: Int | None = None
    echo: Bool | None = None
    suffix: str | None = None
    best_of: Int | None = None

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts to complete: a text, a list of texts, one token-id list or a list of them."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return [self.prompt] if isinstance(self.prompt[0], int) else self.prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the chat template
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = None
    top_logprobs: Int | None = None
    add_generation_prompt: Bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: Bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. enable_thinking

    def _tool_request(self) -> tuple:
        return self.tools, self.tool_choice, self.parallel_tool_calls

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def logprobs_count(self) -> int | None:
        """Top alternatives each token lists; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict[str, Any]:
        return checked_template_kwargs(self.chat_template_kwargs)


class LoadLoRAAdapterRequest(_Body):
    lora_name: Annotated[str, Strict()]
    lora_path: Annotated[str, Strict(), Field(max_length=4096)]


class UnloadLoRAAdapterRequest(_Body):
    lora_name: Annotated[str, Strict()]


class PoolingRequest(_Body):
    """Fields shared by /embeddings, /score and /rerank (null means the default)."""

    model_config = ConfigDict(extra="ignore")
    model: Name | None = None
    truncate_prompt_tokens: Int | None = None  # vLLM's: keep this many tokens of a longer input, -1 the model's limit

    def pooling_params(self, task: str, **fields) -> PoolingParams:
        try:
            return PoolingParams(task=task, truncate_prompt_tokens=self.truncate_prompt_tokens, **fields)
        except ValueError as e:
            raise bad_request(e) from None


def _bounded(items: list, field: str) -> list:
    if not items:
        raise APIError(400, f"{field} must not be empty", param=field)
    if len(items) > MAX_POOLING_INPUTS:
        raise APIError(400, f"{field} holds {len(items)} items; at most {MAX_POOLING_INPUTS}", param=field)
    return items


class EmbeddingRequest(PoolingRequest):
    """OpenAI's `input`, or vLLM's chat-style `messages` (one conversation, one embedding: the way images reach
    CLIP and SigLIP), one of them."""

    input: Text | list[Text] | list[Int] | list[list[Int]] | None = None
    messages: list[dict[str, Any]] | None = None
    encoding_format: Literal["float", "base64"] | None = None  # base64: little-endian float32, as OpenAI sends it
    dimensions: Int | None = None
    user: Name | None = None
    normalize: Bool | None = None  # vLLM's; None: as the model was trained

    @model_validator(mode="after")
    def _one_input(self):
        if (self.input is None) == (self.messages is None):
            raise APIError(
                400, "give 'input' (texts or token ids) or 'messages' (a conversation), one of them", param="input"
            )
        return self

    def inputs(self) -> list[str] | list[list[int]]:
        """The texts or token-id lists to embed: a text, a list of texts, one token-id list or a list of them."""
        if isinstance(self.input, str):
            return [self.input]
        _bounded(self.input, "input")
        return [self.input] if isinstance(self.input[0], int) else self.input

    def params(self) -> PoolingParams:
        return self.pooling_params("embed", normalize=self.normalize, dimensions=self.dimensions)


class ScoreRequest(PoolingRequest):
    """vLLM's /score: `text_1` against each of `text_2` (one text_1 for all), or pairwise (lists of one length)."""

    text_1: Text | list[Text]
    text_2: Text | list[Text]

    def texts(self) -> tuple[list[str], list[str]]:
        """(text_1s, text_2s): one text_1 for every text_2, or as many."""
        firsts = _bounded([self.text_1] if isinstance(self.text_1, str) else self.text_1, "text_1")
        seconds = _bounded([self.text_2] if isinstance(self.text_2, str) else self.text_2, "text_2")
        if len(firsts) not in (1, len(seconds)):
            message = f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}: one text_1, or as many as text_2"
            raise APIError(400, message, param="text_2")
        return firsts, seconds


class RerankDocument(BaseModel):
    text: Text


class RerankRequest(PoolingRequest):
    """The rerank shape of Jina, Cohere and vLLM: `documents` ranked by relevance to `query`."""

    query: Text
    documents: list[Text | RerankDocument]
    top_n: Int | None = None  # None or 0: every document
    return_documents: Bool | None = None  # None: true, as Jina and vLLM (Cohere's v1 default is false)

    def texts(self) -> list[str]:
        if self.top_n is not None and self.top_n < 0:
            raise APIError(400, f"top_n must be >= 0, got {self.top_n}", param="top_n")
        return [d if isinstance(d, str) else d.text for d in _bounded(self.documents, "documents")]
