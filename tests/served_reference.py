"""What a served tiny model must answer: greedy texts from one EngineCore, and the check that
a server's OpenAI completions (plain and streamed, concurrently) equal them. Shared by the
tests that serve the tiny model through Ray Serve and as separate processes."""

from __future__ import annotations

import collections
import concurrent.futures


def greedy_reference(model, engine_opts: dict, prompts: list[str], max_tokens: list[int]):
    """(texts, token counts, identity) of one EngineCore serving `model` greedily."""
    from configs.engine_config import EngineConfig
    from engine.api_types import EngineRequest
    from engine.core import EngineCore
    from engine.sampling.params import SamplingParams

    core = EngineCore(model, EngineConfig(model="tiny", **engine_opts))
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        sp = SamplingParams(temperature=0.0, max_tokens=m)
        core.add_request(EngineRequest(f"r{i}", core.tokenizer.encode(p), sp))
    ids = collections.defaultdict(list)
    while core.has_unfinished():
        for out in core.step():
            ids[out.request_id] += out.new_token_ids
    n = len(prompts)
    texts = [core.tokenizer.decode(ids[f"r{i}"], skip_special_tokens=True) for i in range(n)]
    return texts, [len(ids[f"r{i}"]) for i in range(n)], core.identity


def check_completions(client, prompts, max_tokens, texts, lengths, identity) -> None:
    """Every prompt completed plain and streamed, all at once, through the `openai` client:
    each text equals the engine's, with its token count and the served revision."""

    def complete(i: int, stream: bool):
        kwargs = dict(model=identity.name, prompt=prompts[i], max_tokens=max_tokens[i])
        if stream:
            chunks = client.completions.create(**kwargs, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices), None
        full = client.completions.create(**kwargs, temperature=0)
        return full.choices[0].text, full

    jobs = [(i, stream) for stream in (False, True) for i in range(len(prompts))]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: complete(*job), jobs))
    for (i, _), (text, full) in zip(jobs, results):
        # NOTE: a reply that ends inside a UTF-8 character: the server's incremental
        # detokenizer holds the partial bytes back, a one-shot decode shows U+FFFD for them.
        assert text == texts[i].rstrip("\ufffd"), (prompts[i], text, texts[i])
        if full is not None:
            assert full.usage.completion_tokens == lengths[i]
            assert full.model_extra["pagedjax"]["versions"]["revision"] == identity.revision
