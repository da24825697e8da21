"""A step's sampled-token logprobs, as the requests that asked for them receive them.

    SampleResult (numpy, engine/sampling/sampler.py unpack)   [R] tokens, logprobs; [R, K] top ids
      + the plan and each scheduled request's sampler row
      -> {request_id: TokenLogprob(token, logprob, top n (id, logprob))}   OutputProcessor.emit

Host side, numpy only, called once per step in which some row asked for logprobs
(`BuiltStep.logprobs`). Separate from EngineCore's loop (engine/core.py) because it is a
pure function of the step's results. A verify step of speculative decoding converts its
accepted run with the same `row_logprob`, one TokenLogprob per emitted token.
"""

from __future__ import annotations

from engine.api_types import TokenLogprob
from engine.sampling.sampler import SampleResult
from engine.sched.scheduler import SchedulerOutput


def step_logprobs(plan: SchedulerOutput, result: SampleResult, rows) -> dict[str, TokenLogprob]:
    """The sampled tokens' logprobs, for the requests that asked for them. `rows[i]` is
    the sampler row of plan.scheduled[i]."""
    out = {}
    for s, r in zip(plan.scheduled, rows):
        n = s.request.sampling.logprobs
        if n is None or not s.samples:
            continue
        out[s.request.request_id] = row_logprob(result, int(r), n)
    return out


def row_logprob(result: SampleResult, row: int, n: int) -> TokenLogprob:
    """Row `row`'s sampled token, its logprob and the top `n` (id, logprob)."""
    top = [
        (int(i), float(lp)) for i, lp in zip(result.top_ids[row][:n], result.top_logprobs[row][:n])
    ]
    return TokenLogprob(int(result.tokens[row]), float(result.logprobs[row]), top)
