"""vLLM's /tokenize and /detokenize: a prompt or a conversation as the token ids a model reads, and ids back to text.

Invariants:
- A conversation is rendered exactly as /chat/completions renders it (`serving.render_chat`) and a text encoded
  as the engine encodes a prompt, within the same text limits (a 400 past them). Unlike a prompt to run, neither
  is refused for exceeding the context, as in vLLM: /tokenize is how a client learns that a prompt does not fit
  (`count` against `max_model_len`). A text of no tokens is a 400, as the engine refuses every empty prompt.
- /detokenize decodes at most as many ids as the longest text the engine tokenizes has characters, each in the
  model's vocabulary, else a 400 naming `tokens`.
- At most `max_ids` token ids (the `max_tokenize_ids` setting) go into or come out of one request: a longer
  text is a 400 naming `prompt` or `messages`, more ids one naming `tokens`.
- Tokenizing, decoding, checking the ids and encoding the answer run off the event loop: a million ids (and their
  strings) are tens of megabytes of JSON, seconds of work that would stall every stream and probe.
- Any model tokenizes, an embedding model too (the router's `tokenize` task); a LoRA adapter's name tokenizes as
  its base model, whose tokenizer it shares."""

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Response
from pydantic import ConfigDict, Field, model_validator

from tiffin.plugin.openai.encoding import dumps, json_bytes_response
from tiffin.plugin.openai.protocol import APIError, Bool, ChatMessage, Int, Name, Text, _Body, checked_template_kwargs
from tiffin.plugin.openai.routing import Serving
from tiffin.plugin.openai.serving import render_chat
from tiffin.plugin.openai.tools import ChatTool

if TYPE_CHECKING:  # torch, which `bentoml build` need not import
    from tiffin.engine.async_llm_engine import AsyncLLMEngine


class TokenizeRequest(_Body):
    """vLLM's two shapes in one: a `prompt`, or chat `messages` with the chat fields. A null field means its
    default: `add_special_tokens` is true for a prompt and false for messages (their template writes them)."""

    model_config = ConfigDict(extra="ignore")
    model: Name | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: Bool | None = None
    return_token_strs: Bool | None = None
    add_generation_prompt: Bool | None = None  # None: true
    continue_final_message: Bool | None = None
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_shape(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            field = "prompt" if self.messages is None else "messages"
            raise APIError(400, "give either prompt or messages", param=field)
        if self.continue_final_message and self.add_generation_prompt is not False:
            message = "continue_final_message continues the last message: it needs add_generation_prompt false"
            raise APIError(400, message, param="continue_final_message")
        checked_template_kwargs(self.chat_template_kwargs)
        return self


class DetokenizeRequest(_Body):
    model_config = ConfigDict(extra="ignore")
    model: Name | None = None
    tokens: list[Int]


# ids one /tokenize answers or /detokenize decodes, by default: above the longest context of the models served
# (1M tokens), so that any prompt that fits is counted; an answer of as many ids is about 8 MB of JSON (and 20 MB
# with their strings), a few tenths of a second to encode on a worker thread
MAX_TOKENIZE_IDS = 1 << 20


async def tokenize(serving: Serving, req: TokenizeRequest, max_ids: int = MAX_TOKENIZE_IDS) -> Response:
    engine = serving.engine
    if req.messages is None:
        token_ids = await _encode(engine, req.prompt, req.add_special_tokens is not False, "prompt")
    else:
        kwargs = {**(req.chat_template_kwargs or {}), "continue_final_message": bool(req.continue_final_message)}
        generation_prompt = req.add_generation_prompt is not False
        rendered = await render_chat(engine, req.messages, generation_prompt, req.tools, fit_context=False, **kwargs)
        token_ids = rendered.token_ids
        if req.add_special_tokens:  # vLLM's way: the rendered text encoded as a prompt, with the tokenizer's own
            token_ids = await _encode(engine, rendered.text, True, "messages")
    if len(token_ids) > max_ids:
        field = "prompt" if req.messages is None else "messages"
        message = f"{field} is {len(token_ids)} tokens; /tokenize answers at most {max_ids} (max_tokenize_ids)"
        raise APIError(400, message, param=field)

    def answer() -> bytes:
        strs = engine.tokenizer.convert_ids_to_tokens(token_ids) if req.return_token_strs else None
        return dumps(
            {"count": len(token_ids), "max_model_len": engine.max_model_len, "tokens": token_ids, "token_strs": strs}
        )

    return json_bytes_response(await asyncio.to_thread(answer))


async def detokenize(serving: Serving, req: DetokenizeRequest, max_ids: int = MAX_TOKENIZE_IDS) -> Response:
    engine = serving.engine.engine
    limit, why = min((engine.max_prompt_chars, "as a prompt's characters"), (max_ids, "max_tokenize_ids"))
    if len(req.tokens) > limit:
        raise APIError(400, f"tokens holds {len(req.tokens)} ids; at most {limit}, {why}", param="tokens")
    vocab = engine.model_config.vocab_size

    def answer() -> bytes:
        wrong = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if wrong is not None:
            raise APIError(400, f"tokens: {wrong} is not a token id of this model, in [0, {vocab})", param="tokens")
        return dumps({"prompt": engine.tokenizer.decode(req.tokens)})

    return json_bytes_response(await asyncio.to_thread(answer))


async def _encode(engine: "AsyncLLMEngine", text: str, add_special_tokens: bool, field: str) -> list[int]:
    """The text's token ids, however many; a refusal is a 400 naming `field`."""
    prompt = {"prompt": text, "add_special_tokens": add_special_tokens}
    try:
        return (await engine.tokenize(prompt, fit_context=False)).token_ids
    except ValueError as e:
        raise APIError(400, str(e), param=field) from None
