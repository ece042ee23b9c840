"""Chat prompts: a conversation rendered by the tokenizer's chat template and encoded, within the engine's limits.

Invariants:
- Only the template writes control tokens: a control token spelled inside a message, a tool or a template argument
  is encoded as text (transformers' `sanitize_control_tokens`), so text a client sends cannot open or close a turn
  (unless `control_tokens_in_messages` is set). A conversation without such spellings encodes exactly as
  `apply_chat_template(..., tokenize=True)` encodes it.
- A render ends within the time and size of its `ChatSettings` or is refused naming the setting it ran into
  (`chat_sandbox`).
- Text content parts (OpenAI's `[{"type": "text", "text": ...}]`) reach a template that prints content as one
  string, joined by newlines as vLLM joins them; a template that loops over a message's content gets the parts.
  Image parts (`{"type": "image_url", "image_url": {"url": "data:..."}}`) reach a model that reads images as
  `{"type": "image"}` parts where the template loops over content (it writes the image placeholder there), each
  decoded within `ImageLimits` (`multimodal.image`; an http(s) URL fetched first, only from a host of
  `allowed_media_domains`: `multimodal.fetch`); a text-only model refuses them, naming the part. Any other
  part is refused, naming its type.
- Every refusal is a ParamError naming `messages`."""

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jinja2 import nodes

from tiffin.engine.chat_sandbox import TemplateLimit, bounded, install
from tiffin.engine.errors import ParamError
from tiffin.engine.multimodal.fetch import fetch_image
from tiffin.engine.multimodal.image import decode_data_url, decode_image
from tiffin.engine.multimodal.inputs import ImageLimits

if TYPE_CHECKING:  # transformers is imported where a tokenizer is loaded
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ChatSettings:
    """The engine's settings a render follows (EngineConfig's fields of the same names)."""

    timeout: float  # seconds
    max_chars: int  # characters the render may write, and build at once (chat_sandbox.BUILT_PER_CHAR times in all)
    control_tokens_in_messages: bool = False  # True: control tokens spelled in messages are encoded as such
    images: ImageLimits | None = None  # None: a text-only model


def render_chat(
    tokenizer: "PreTrainedTokenizerBase",
    messages: list[dict],
    add_generation_prompt: bool,
    settings: ChatSettings,
    **template_kwargs,
) -> dict:
    """The prompt of one conversation, `{"prompt": its text as its tokens spell it, "prompt_token_ids": ...}`, with
    `"multi_modal_data": {"image": [...]}` where its messages carry images."""
    images = []
    try:
        template = tokenizer.get_chat_template(None, template_kwargs.get("tools"))
        messages = _contents(messages, _loops_over_content(template), settings.images, images)
        with bounded(settings.timeout, settings.max_chars):
            ids = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                sanitize_control_tokens=not settings.control_tokens_in_messages,
                **template_kwargs,
            )
    except ParamError:
        raise
    except TemplateLimit as e:
        raise ParamError("messages", str(e)) from None
    except Exception as e:  # a template may raise on roles or content it does not accept
        raise ParamError("messages", f"the chat template failed: {_describe(e)}") from None
    rendered = {"prompt": tokenizer.decode(ids), "prompt_token_ids": ids}
    return {**rendered, "multi_modal_data": {"image": images}} if images else rendered


def _describe(error: Exception) -> str:
    """The error's message, short, and never the text of a non-text argument (a template may raise any value)."""
    message = error.args[0] if error.args and isinstance(error.args[0], str) else type(error).__name__
    return message if len(message) <= 500 else message[:500] + "..."


@functools.lru_cache(maxsize=16)
def _loops_over_content(chat_template: str) -> bool:
    """Whether the template iterates a message's content (so reads OpenAI's parts) rather than printing it."""
    for loop in install().parse(chat_template).find_all(nodes.For):
        for node in (loop.iter, *loop.iter.find_all((nodes.Getitem, nodes.Getattr))):
            key = node.arg.value if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) else None
            if key == "content" or (isinstance(node, nodes.Getattr) and node.attr == "content"):
                return True
    return False


def _contents(messages: list[dict], as_parts: bool, limits: ImageLimits | None, images: list) -> list[dict]:
    """The messages with list contents checked: text parts kept as parts, or joined into one string; image parts
    decoded into `images` (in order), each left as an `{"type": "image"}` part."""
    shaped = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts = [_part(part, f"messages[{i}].content[{j}]", limits, images) for j, part in enumerate(content)]
            if not as_parts and any(p["type"] == "image" for p in parts):
                raise ParamError("messages", "the chat template prints content as text: it cannot place images")
            message = {**message, "content": parts if as_parts else "\n".join(p["text"] for p in parts)}
        shaped.append(message)
    return shaped


def _part(part, where: str, limits: ImageLimits | None, images: list) -> dict:
    """A text part as it is, checked, or an image part decoded."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image_url":
        images.append(_image(part.get("image_url"), where, limits, len(images)))
        return {"type": "image"}
    if kind != "text":
        raise ParamError(
            "messages", f"{where}: content part type {kind!r} is not supported; only 'text' and 'image_url' parts are"
        )
    if not isinstance(part.get("text"), str):
        raise ParamError("messages", f"{where}: a text part needs 'text', a string")
    return part


def _image(value, where: str, limits: ImageLimits | None, count: int):
    """The image an `image_url` part names: a `data:` URL, or an http(s) URL on a host of `allowed_media_domains`
    (`multimodal.fetch`), decoded."""
    if limits is None:
        raise ParamError("messages", f"{where}: content part type 'image_url' needs a model that reads images")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ParamError("messages", f"{where}: an image_url part needs 'image_url': {{'url': a string}}")
    if count >= limits.limit_mm_per_prompt:
        raise ParamError("messages", f"{where}: more images than limit_mm_per_prompt={limits.limit_mm_per_prompt}")
    if url.startswith(("http://", "https://")):
        data = fetch_image(url, limits.allowed_media_domains, limits.max_image_bytes, where)
        return decode_image(data, limits.max_image_pixels, where)
    return decode_data_url(url, limits.max_image_pixels, limits.max_image_bytes, where)
