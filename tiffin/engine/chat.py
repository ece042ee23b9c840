"""Chat prompts: a conversation rendered by the tokenizer's chat template into an engine prompt."""


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> dict:
    """The prompt dict for one conversation, left for the engine to tokenize (bounded, off its step loop) without
    special tokens: the template writes them itself."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return {"prompt": text, "add_special_tokens": False}
