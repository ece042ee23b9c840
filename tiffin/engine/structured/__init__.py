"""Structured outputs: what a request's output must match (`params.StructuredOutputsParams`, checked when the
request is made) and the xgrammar backend that compiles it and masks each step's logits (`backend`).

Invariant: a JSON schema is enforced in full or refused with the keyword named (`params`).
"""
