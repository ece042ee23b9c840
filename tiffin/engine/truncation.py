"""Prompts to pool that truncation will cut: only the part of a long text it keeps is tokenized."""


def cut_for_truncation(tokenizer, text: str, keep: int, max_token_chars: int) -> str:
    """`text`, or a part of it, from the side truncation to `keep` tokens keeps (the tokenizer's
    `truncation_side`), whose tokens are the same as the text's on that side as far as `keep` tokens reach, so
    tokenizing it then truncating gives what tokenizing all of `text` then truncating would. Its size starts at
    `keep` (and a margin) times `max_token_chars`, the most characters a token stands for, and grows while it holds
    too few tokens (much whitespace, which tokens skip); it is taken only once its tokens show that the kept ones lie
    in words (the pre-tokenizer's pieces) at least two before the cut, which is all the cut can change. A slow
    (Python) tokenizer, which has no words to show, and one whose pieces do not reach, get the whole text."""
    keep_start = tokenizer.truncation_side == "right"
    size = (keep + 8) * max_token_chars
    if not getattr(tokenizer, "is_fast", False):
        return text
    while size < len(text):
        piece = text[:size] if keep_start else text[-size:]
        words = tokenizer(piece, add_special_tokens=False).word_ids()
        if len(words) > keep + 2:
            first, last = (words[keep - 1], words[-1]) if keep_start else (words[0], words[-keep])
            if None not in (first, last) and last - first >= 2:
                return piece
            if words[0] == words[-1]:  # one piece: no pre-tokenizer splits this text
                return text
        size *= 4
    return text
