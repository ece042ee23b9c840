"""Structured outputs: what a request's output must match (`params.StructuredOutputsParams`, checked when the
request is made, within `limits`; `formats` are enforced as patterns) and the xgrammar backend that compiles it
and masks each step's logits (`backend`).

Invariants: a JSON schema is enforced in full or refused with the keyword named (`params`); a spec past `limits`
is refused naming the limit before anything recursive or costly reads it; compiles run on a bounded pool and
queue, and the cache stays within its bytes (`backend`); every constrained output is well-formed UTF-8, so its
text is what the grammar matched (`utf8`).
"""
