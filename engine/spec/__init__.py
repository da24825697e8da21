"""Speculative decoding: proposers, the verify step and the acceptance rule.

    decode.py   SpecDecoder: the speculator (propose, prepare, commit; the runner verifies)
    ngram.py    the n-gram (prompt lookup) proposer
    draft.py    the draft-model proposer
    layers.py   the early-exit (self-speculative layers) proposer
    rule.py     the acceptance rule (rejection sampling against the target distribution)
    step.py     the jitted verify step

May import: configs, models, engine's top level, engine/runner/, engine/batch/,
engine/sampling/, engine/sched/. Never serving.
"""
