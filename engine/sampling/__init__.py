"""Sampling: the request's parameters, the device sampler, the logprobs a request receives.

    params.py    SamplingParams: validated on creation (a token is sampled per these)
    sampler.py   SamplingTensors (host rows), sample (the jitted sampler), penalties
    logprobs.py  a step's sampled-token logprobs -> each request's TokenLogprob (numpy)

May import: configs, engine's top level, engine/structured/, engine/sched/ (logprobs.py).
"""
