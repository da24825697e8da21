"""Structured output (llguidance): the constraint a request puts on its output, and its mask.

    output.py    StructuredOutput: the request's constraint, validated on creation
    matcher.py   one request's grammar matcher; a step's token bitmask
    vocab.py     the tokenizer as llguidance sees it
    mask.py      apply_token_bitmask: the bitmask applied to logits (jitted)

May import: configs, engine's top level. Never serving.
"""
