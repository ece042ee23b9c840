"""Chat prompts: a conversation rendered by the tokenizer's chat template into an engine prompt."""


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> dict:
    """The prompt dict (`prompt` text and `prompt_token_ids`) for one conversation. Encoding adds no special
    tokens: the template writes them itself."""
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
