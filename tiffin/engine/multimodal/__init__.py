"""Images in prompts: decoding and preprocessing (`image`), placeholders and content hashes (`inputs`), the encoder
step and its cache (`encoder`)."""
