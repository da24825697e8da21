"""The notebook API.

    from engine import LLM, SamplingParams
    llm = LLM("smollm2-135m")                      # or a GGUF path / HF directory / "tiny"
    outs = llm.generate(["Hello", [{"role": "user", "content": "Hi!"}]],
                        SamplingParams(temperature=0, max_tokens=32))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[0].metrics.ttft_s
    for delta in llm.generate_stream("Tell me a story"): print(delta.new_text, end="")

A string prompt is used as is (BOS added if the tokenizer adds one); a list of chat messages
gets the model's chat template; a list of ints is used as token ids.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterator, Sequence

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest, RequestMetrics, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.sharding import create_engine, loader_shardings

log = logging.getLogger(__name__)

Prompt = str | list[dict] | list[int]


@dataclasses.dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    metrics: RequestMetrics | None


class LLM:
    # mesh: None (one device), "model:4", "data:2,model:4" (engine/sharding.py)
    def __init__(
        self,
        model="smollm2-135m",
        *,
        mesh: str | None = None,
        warmup: bool = False,
        impl: str = "auto",
        compilation_cache_dir: str | None = None,
        **engine_options,
    ):
        """`warmup=False` (the default) compiles each step program on first use, so a first
        `generate` compiles only the few shapes it reaches (seconds) instead of the engine's
        whole shape set (minutes for a real model on CPU): what a notebook wants. Every
        program compiled is kept in JAX's persistent compilation cache
        (`compilation_cache_dir`, default engine/compilation_cache.py; "" turns it off), so
        the next `LLM(...)` on this machine loads it instead. `warmup=True` builds every
        program up front (a server's choice: no compile while serving)."""
        from engine.compilation_cache import enable as enable_compilation_cache
        from models.registry import load_model

        enable_compilation_cache(compilation_cache_dir)  # before anything compiles
        t0 = time.perf_counter()
        # `model` may also be an already loaded models.registry.LoadedModel (tests, notebooks
        # that build several engines over one set of weights).
        # With a mesh, each param shard goes straight to its devices.
        shardings_for = None if mesh is None else loader_shardings(mesh)
        self.model = (
            load_model(model, shardings_for=shardings_for) if isinstance(model, str) else model
        )
        name = model if isinstance(model, str) else self.model.identity.name
        self.config = EngineConfig(model=name, **engine_options)
        self.engine = create_engine(self.model, self.config, impl=impl, mesh=mesh)
        self.tokenizer = self.model.tokenizer
        self._ids = itertools.count()
        log.info("LLM(%s) ready in %.1fs", model, time.perf_counter() - t0)
        if warmup:
            from engine.warmup import warmup as run_warmup

            for engine in getattr(self.engine, "replicas", [self.engine]):  # data replicas
                run_warmup(engine)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            text = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return [int(t) for t in prompt]

    def _add(self, prompt: Prompt, params: SamplingParams, priority: int, tenant: str) -> str:
        rid = f"llm-{next(self._ids)}"
        self.engine.add_request(
            EngineRequest(rid, self.encode_prompt(prompt), params, priority=priority, tenant=tenant)
        )
        return rid

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int = 0,
        tenant: str = "default",
    ) -> list[CompletionOutput]:
        """Runs all prompts together (continuous batching); returns outputs in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
            )
        ids = [self._add(p, sp, priority, tenant) for p, sp in zip(prompts, params)]
        results = {rid: CompletionOutput(rid, [], "", [], None, None, None) for rid in ids}
        for rid in ids:
            results[rid].prompt_token_ids = []
        while self.engine.has_unfinished():
            for out in self.engine.step():
                self._accumulate(results.get(out.request_id), out)
        return [results[rid] for rid in ids]

    def generate_stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        priority: int = 0,
        tenant: str = "default",
    ) -> Iterator[RequestOutput]:
        """Yields this request's deltas as they come (other requests keep running)."""
        rid = self._add(prompt, sampling_params or SamplingParams(), priority, tenant)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    @staticmethod
    def _accumulate(res: CompletionOutput | None, out: RequestOutput) -> None:
        if res is None:
            return
        res.text += out.new_text
        res.token_ids += out.new_token_ids
        if out.logprobs is not None:
            res.logprobs = (res.logprobs or []) + out.logprobs
        if out.finished:
            res.finish_reason, res.metrics = out.finish_reason, out.metrics

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def stats(self) -> dict:
        return self.engine.stats()

    def reload_model(self, model) -> None:
        """New weights of the same architecture (a LoadedModel); clears the prefix cache."""
        self.engine.reload_model(model)
        self.model, self.tokenizer = model, model.tokenizer
