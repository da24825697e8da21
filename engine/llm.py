"""The notebook API, shaped like vLLM's offline `LLM` so a vLLM user's first tries work.

    from engine import LLM, SamplingParams
    llm = LLM("smollm2-135m")                      # or a GGUF path / HF directory / "tiny"
    llm = LLM("smollm2-135m", quantization="int8", kv_dtype="int8")   # int8 weights + KV
    outs = llm.generate(["Hello", {"prompt": "Hi"}, {"prompt_token_ids": [1, 2, 3]}],
                        SamplingParams(temperature=0, max_tokens=32, n=2))
    outs[0].prompt, outs[0].prompt_token_ids, outs[0].outputs[1].text, .token_ids, .finish_reason
    outs[0].text, outs[0].metrics.ttft_s          # flat fields: the first completion
    llm.chat([{"role": "user", "content": "Hi!"}])  # one conversation, or a list of them
    out = llm.chat(messages, tools=[{"type": "function", "function": {...}}],
                   tool_choice="required")   # out[0].outputs[0].tool_calls: parsed calls
    llm = LLM("smollm2-135m", max_loras=4, max_lora_rank=16)         # multi-LoRA serving
    llm.load_adapter("sql", "/path/to/peft_dir"); llm.generate(prompts, params, adapter="sql")
    for delta in llm.generate_stream("Tell me a story"): print(delta.new_text, end="")

Prompts: a string is used as is (BOS added if the tokenizer adds one); a list of chat messages
gets the model's chat template; a list of ints is token ids; `{"prompt": str}` and
`{"prompt_token_ids": [...]}` are vLLM's dict prompts.

Everything a caller gets wrong fails before work starts: unknown or mistyped engine options
before the model loads, bad prompts and sampling params before any request is added. What a
caller abandons is cancelled: closing (or breaking out of) a `generate_stream` aborts its
request, and a `generate` that raises aborts every request it added.

Differences from vLLM kept on purpose: `.logprobs` is a list of TokenLogprob (sampled token,
its logprob, the top-N) rather than a list of dicts; `mesh="data:2,model:4"` is the general
form of `tensor_parallel_size`; `gpu_memory_utilization` sizes the KV pool from what the
device reports after the weights are loaded (on CPU, which reports nothing, it is ignored
with a warning and `kv_cache_bytes` is used).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence

from configs.engine_config import EngineConfig
from engine.api_types import (
    AdapterRef,
    CompletionOutput,
    EngineRequest,
    GenerateOutput,
    RequestOutput,
)
from engine.chat.reasoning import get_reasoning_format
from engine.chat.setup import ChatOptions
from engine.chat.tool_parsers import get_format
from engine.errors import InvalidRequestError
from engine.factory import create_engine
from engine.llm_chat import chat_setup, split_completion, template_messages
from engine.llm_options import (
    check_engine_options,
    check_fraction,
    describe,
    mesh_from,
    with_memory_fraction,
)
from engine.lora.adapters import UnknownAdapterError
from engine.parallel.sharding import loader_shardings
from engine.sampling.params import SamplingParams

log = logging.getLogger(__name__)

Prompt = str | list[dict] | list[int] | dict
PROMPT_TYPES = (
    "a str, a list of chat messages ({'role', 'content'} dicts), a list of token ids (int), "
    "or a dict with 'prompt' or 'prompt_token_ids'"
)


@dataclasses.dataclass(frozen=True)
class ResolvedPrompt:
    text: str | None  # None when given as token ids
    token_ids: list[int]


class LLM:
    # mesh: None (one device), "model:4", "data:2,model:4", "expert:2" (MoE models): see
    # engine/parallel/sharding.py
    def __init__(
        self,
        model="smollm2-135m",
        *,
        mesh: str | None = None,
        tensor_parallel_size: int | None = None,
        gpu_memory_utilization: float | None = None,
        warmup: bool = False,
        impl: str = "auto",
        compilation_cache_dir: str | None = None,
        tool_call_parser: str = "",
        reasoning_parser: str = "",
        **engine_options,
    ):
        """`warmup=False` (the default) compiles each step program on first use, so a first
        `generate` compiles only the few shapes it reaches (seconds) instead of the engine's
        whole shape set (minutes for a real model on CPU): what a notebook wants. Every
        program compiled is kept in JAX's persistent compilation cache
        (`compilation_cache_dir`, default engine/runner/compilation_cache.py: ~/.cache/pagedjax/xla;
        "" turns it off), so the next `LLM(...)` on this machine loads it.
        `warmup=True` builds every program up front (a server's choice: no compile while
        serving): 2 per decode-only shape and 1 per prefill shape of the engine's shape set
        (`max_step_shapes`, engine/runner/shapes.py; 48 programs for 32 shapes), several minutes
        on a 2-core CPU the first time, seconds once they are in the cache. NOTE: the
        default stays False because a notebook's first cell runs a handful of shapes, not
        the whole set; a later shape costs one compile stall in that call, not an error.
        Built programs are not run: on XLA:CPU each one's first execution still sets up its
        dot calls (0.2-0.7 s); `engine.runner.warmup.warmup(engine, execute=True)` runs them too.
        `tool_call_parser` (hermes | llama3_json | mistral; "" = from the chat template) and
        `reasoning_parser` (qwen3 | deepseek_r1; "" = off) are the server's flags of the same
        names: how `chat` splits its output (engine/chat/)."""
        from engine.runner.compilation_cache import enable as enable_compilation_cache
        from models.registry import load_model
        from models.source import check_model_source

        enable_compilation_cache(compilation_cache_dir)  # before anything compiles
        t0 = time.perf_counter()
        mesh = mesh_from(mesh, tensor_parallel_size)
        check_engine_options(engine_options)
        check_fraction(gpu_memory_utilization)
        if tool_call_parser:
            get_format(tool_call_parser)  # ValueError naming the known ones, before loading
        if reasoning_parser:
            get_reasoning_format(reasoning_parser)
        # `model` may also be an already loaded models.registry.LoadedModel (tests, notebooks
        # that build several engines over one set of weights).
        if isinstance(model, str):
            check_model_source(model)
        name = model if isinstance(model, str) else model.identity.name
        config = EngineConfig(model=name, **engine_options)  # range errors before loading
        # With a mesh, each param shard goes straight to its devices. `quantization="int8"`
        # (or "w8a8") loads the weights quantized (models/quant.py).
        shardings_for = None if mesh is None else loader_shardings(mesh)
        self.model = (
            load_model(
                model,
                dtype=config.dtype,
                shardings_for=shardings_for,
                quantization=config.quant_config,
            )
            if isinstance(model, str)
            else model
        )
        if gpu_memory_utilization is not None:
            config = with_memory_fraction(config, gpu_memory_utilization)
        self.config = config
        self.engine = create_engine(self.model, self.config, impl=impl, mesh=mesh)
        self.tokenizer = self.model.tokenizer
        self.chat_options = ChatOptions.for_tokenizer(
            self.tokenizer, tool_call_parser, reasoning_parser
        )
        self._ids = itertools.count()
        log.info("LLM(%s) ready in %.1fs", name, time.perf_counter() - t0)
        if warmup:
            from engine.runner.warmup import warmup as run_warmup

            for engine in getattr(self.engine, "replicas", [self.engine]):  # data replicas
                run_warmup(engine)

    # ---- prompts ---------------------------------------------------------------------------
    def get_tokenizer(self):
        """The model's tokenizer (encode, decode, apply_chat_template, eos_token_ids)."""
        return self.tokenizer

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        return self.resolve_prompt(prompt).token_ids

    def resolve_prompt(self, prompt: Prompt, where: str = "prompt") -> ResolvedPrompt:
        """Text and token ids of one prompt; TypeError/InvalidRequestError naming `where`."""
        if isinstance(prompt, str):
            return ResolvedPrompt(prompt, self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            return self._resolve_dict(prompt, where)
        if isinstance(prompt, (list, tuple)) and prompt:
            if all(isinstance(m, dict) for m in prompt):
                _check_messages(prompt, where)
                text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
                return ResolvedPrompt(text, self.tokenizer.encode(text, add_special_tokens=False))
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return ResolvedPrompt(None, [int(t) for t in prompt])
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise InvalidRequestError(where, prompt, "must not be empty")
        raise TypeError(f"{where}: expected {PROMPT_TYPES}; got {describe(prompt)}")

    def _resolve_dict(self, prompt: dict, where: str) -> ResolvedPrompt:
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return self.resolve_prompt(prompt["prompt"], where)
        if keys == {"prompt_token_ids"}:
            return self.resolve_prompt(list(prompt["prompt_token_ids"]), where)
        raise TypeError(
            f"{where}: a dict prompt holds exactly one of 'prompt' (str) or "
            f"'prompt_token_ids' (list of int); got keys {sorted(keys)}"
        )

    # ---- generation ------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable = False,
        priority: int = 0,
        tenant: str = "default",
        adapter: str | None | Sequence[str | None] = None,
    ) -> list[GenerateOutput]:
        """Runs all prompts together (continuous batching); returns one result per prompt, in
        order. `sampling_params.n` > 1 adds n requests per prompt; they share the prompt's
        KV pages through the prefix cache, and with a seed, completion i uses seed + i.
        `adapter`: a loaded LoRA adapter's name for every prompt, or a list (one per
        prompt); None = the base model. Each result's `.adapter` names what answered."""
        prompts = _as_prompt_list(prompts)
        resolved = [self.resolve_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        params = _params_per_prompt(sampling_params, len(prompts))
        return self._generate_resolved(resolved, params, use_tqdm, priority, tenant, adapter)

    def _generate_resolved(
        self, resolved: list[ResolvedPrompt], params, use_tqdm, priority, tenant, adapter
    ) -> list[GenerateOutput]:
        adapters = self._adapters_per_prompt(adapter, len(resolved))
        results = [
            GenerateOutput(
                "", r.text, r.token_ids, [CompletionOutput(i) for i in range(sp.n)], adapter=a
            )
            for r, sp, a in zip(resolved, params, adapters)
        ]
        completion_of: dict[str, CompletionOutput] = {}
        try:
            for res, sp in zip(results, params):
                name = None if res.adapter is None else res.adapter.name
                for c in res.outputs:
                    sp_i = _nth(sp, c.index)
                    c.request_id = self._add(res.prompt_token_ids, sp_i, priority, tenant, name)
                    completion_of[c.request_id] = c
                res.request_id = res.outputs[0].request_id
            self._run_until_done(completion_of, use_tqdm)
        except BaseException:  # also KeyboardInterrupt: leave nothing running behind
            for rid, c in completion_of.items():
                if c.finish_reason is None:
                    self.engine.abort_request(rid)
            raise
        return results

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable = False,
        priority: int = 0,
        tenant: str = "default",
        adapter: str | None | Sequence[str | None] = None,
        tools: Sequence[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
        chat_template_kwargs: dict | None = None,
        max_thinking_tokens: int | None = None,
    ) -> list[GenerateOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, each
        rendered with the model's chat template and a generation prompt.

        Tools and reasoning as in OpenAI's chat completions (checked, rendered, constrained
        and parsed by engine/chat/, as the HTTP API does): `tools` [{"type": "function",
        "function": {"name", "description", "parameters"}}], `tool_choice` none | auto |
        required | {"type": "function", "function": {"name": N}} (required / named: decoding
        is constrained so every call parses and validates), assistant messages with
        `tool_calls` and `tool` messages in the history. Each completion then carries
        `.tool_calls` (ToolCall: id, name, arguments as JSON text), `.content`,
        `.reasoning_content` (with a reasoning_parser) and `.message` (the OpenAI assistant
        message); finish_reason is "tool_calls" when it stopped after calls."""
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
            conversations = [list(messages)]
        elif isinstance(messages, (list, tuple)) and messages:
            conversations = [list(m) if isinstance(m, (list, tuple)) else m for m in messages]
        else:
            raise TypeError(
                f"messages: expected a list of {{'role', 'content'}} dicts or a list of such "
                f"lists; got {describe(messages)}"
            )
        for i, conv in enumerate(conversations):
            if not isinstance(conv, list) or not conv:
                raise TypeError(f"messages[{i}]: expected a non-empty list of message dicts")
            _check_messages(conv, f"messages[{i}]")
        setup = chat_setup(
            self.chat_options,
            tools,
            tool_choice,
            parallel_tool_calls,
            chat_template_kwargs,
            max_thinking_tokens,
        )
        if setup is None:
            return self.generate(
                conversations,
                sampling_params,
                use_tqdm=use_tqdm,
                priority=priority,
                tenant=tenant,
                adapter=adapter,
            )
        resolved = [
            self._chat_prompt(setup, c, f"messages[{i}]") for i, c in enumerate(conversations)
        ]
        params = [setup.sampling(p) for p in _params_per_prompt(sampling_params, len(resolved))]
        results = self._generate_resolved(resolved, params, use_tqdm, priority, tenant, adapter)
        for res in results:
            for c in res.outputs:
                split_completion(c, setup)
        return results

    def _chat_prompt(self, setup, conversation: list[dict], where: str) -> ResolvedPrompt:
        """The conversation through `setup`: the template sees the tools (or the fallback
        instructions), token ids as the HTTP API computes them."""
        messages = template_messages(conversation, where)
        rendered, kwargs = setup.render_inputs(messages)
        text = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, **kwargs)
        return ResolvedPrompt(text, setup.prompt_ids(self.tokenizer, messages))

    def generate_stream(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        *,
        priority: int = 0,
        tenant: str = "default",
        adapter: str | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields this request's deltas as they come (other requests keep running). Validates
        now; the request is added at the first `next()`. Closing the generator (break, del,
        an exception in the loop body) before the last delta aborts the request."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        _params_per_prompt(params, 1)
        if params.n != 1:
            raise InvalidRequestError("n", params.n, "generate_stream streams one completion: 1")
        self._adapters_per_prompt(adapter, 1)  # unknown names fail now
        ids = self.resolve_prompt(prompt).token_ids
        return self._stream(ids, params, priority, tenant, adapter)

    def _stream(self, ids, params: SamplingParams, priority: int, tenant: str, adapter):
        rid = self._add(ids, params, priority, tenant, adapter)
        finished = False
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.request_id == rid:
                        finished = out.finished
                        yield out
                        if finished:
                            return
        finally:
            if not finished:
                self.engine.abort_request(rid)

    def _add(
        self,
        ids: list[int],
        params: SamplingParams,
        priority: int,
        tenant: str,
        adapter: str | None = None,
    ) -> str:
        rid = f"llm-{next(self._ids)}"
        er = EngineRequest(rid, ids, params, priority=priority, tenant=tenant, adapter=adapter)
        self.engine.add_request(er)
        return rid

    def _run_until_done(self, completion_of: dict[str, CompletionOutput], use_tqdm) -> None:
        """Steps the engine until every request in `completion_of` has finished."""
        pending = set(completion_of)
        bar = _progress_bar(use_tqdm, len(pending))
        try:
            while pending and self.engine.has_unfinished():
                for out in self.engine.step():
                    c = completion_of.get(out.request_id)
                    if c is None:
                        continue
                    _accumulate(c, out)
                    if out.finished:
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()

    # ---- LoRA adapters (engine/lora/adapters.py) ------------------------------------------------
    def load_adapter(self, name: str, path: str) -> AdapterRef:
        """Loads a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors)
        under `name` into every engine replica; needs LLM(..., max_loras >= 1). Loading a
        name again with new content replaces it (running requests keep the old one)."""
        refs = [engine.load_adapter(name, path) for engine in self._engines()]
        return refs[0]

    def unload_adapter(self, name: str) -> None:
        for engine in self._engines():
            engine.unload_adapter(name)

    def adapters(self) -> dict[str, AdapterRef]:
        """Loaded adapters by name."""
        manager = self._engines()[0].adapters
        return {} if manager is None else manager.loaded

    def _adapters_per_prompt(self, adapter, num_prompts: int) -> list[AdapterRef | None]:
        names = [adapter] * num_prompts if adapter is None or isinstance(adapter, str) else adapter
        if not isinstance(names, (list, tuple)) or len(names) != num_prompts:
            raise InvalidRequestError(
                "adapter", adapter, f"None, a name, or a list of {num_prompts} (one per prompt)"
            )
        loaded = self.adapters()
        out = []
        for name in names:
            if name is not None and name not in loaded:
                raise UnknownAdapterError(name, sorted(loaded))
            out.append(None if name is None else loaded[name])
        return out

    def _engines(self) -> list:
        return getattr(self.engine, "replicas", [self.engine])

    # ---- engine ----------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def stats(self) -> dict:
        return self.engine.stats()

    def reload_model(self, model) -> None:
        """New weights of the same architecture (a LoadedModel); clears the prefix cache."""
        self.engine.reload_model(model)
        self.model, self.tokenizer = model, model.tokenizer
        opts = self.chat_options
        self.chat_options = ChatOptions.for_tokenizer(
            model.tokenizer, opts.tool_format.name, opts.reasoning.name if opts.reasoning else ""
        )


# ---- helpers (pure) -------------------------------------------------------------------------
def _accumulate(c: CompletionOutput, out: RequestOutput) -> None:
    c.text += out.new_text
    c.token_ids += out.new_token_ids
    if out.logprobs is not None:
        c.logprobs = (c.logprobs or []) + out.logprobs
    if out.finished:
        c.finish_reason, c.metrics = out.finish_reason, out.metrics


def _as_prompt_list(prompts) -> list:
    """One prompt or a list of them (a list of role dicts is ONE chat prompt)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts:
        first = prompts[0]
        if isinstance(first, int) and not isinstance(first, bool):
            return [prompts]
        if isinstance(first, dict) and "role" in first:
            return [prompts]
        return list(prompts)
    raise TypeError(f"prompts: expected a prompt or a non-empty list of prompts ({PROMPT_TYPES})")


def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)) or not all(
        isinstance(p, SamplingParams) for p in sampling_params
    ):
        raise TypeError(
            f"sampling_params: expected SamplingParams or a list of them; "
            f"got {describe(sampling_params)}"
        )
    if len(sampling_params) != num_prompts:
        raise ValueError(
            f"sampling_params has {len(sampling_params)} entries for {num_prompts} prompts"
        )
    return list(sampling_params)


def _nth(params: SamplingParams, index: int) -> SamplingParams:
    """Completion `index` of n: one engine request (n=1), its own seed when one is set."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else (params.seed + index) % 2**63
    return dataclasses.replace(params, n=1, seed=seed)


def _check_messages(messages: Sequence[dict], where: str) -> None:
    """role and content strings; content may be None beside tool_calls (OpenAI's shape)."""
    for i, m in enumerate(messages):
        content = m.get("content")
        calls = m.get("tool_calls")
        if calls is not None and not (
            isinstance(calls, list) and all(isinstance(c, dict) for c in calls)
        ):
            raise TypeError(f"{where}[{i}].tool_calls: expected a list of dicts; got {calls!r:.80}")
        if not isinstance(m.get("role"), str) or not (
            isinstance(content, str) or (content is None and calls)
        ):
            raise TypeError(
                f"{where}[{i}]: a chat message is a dict with 'role' (str) and 'content' (str); "
                f"got {m!r:.80}"
            )


def _progress_bar(use_tqdm, total: int):
    if not use_tqdm:
        return None
    if callable(use_tqdm) and not isinstance(use_tqdm, bool):
        return use_tqdm(total=total, desc="Processed prompts", unit="req")
    try:
        from tqdm.auto import tqdm
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "use_tqdm=True needs tqdm: pip install tqdm (or the `bench` extra)", name="tqdm"
        ) from None
    return tqdm(total=total, desc="Processed prompts", unit="req")
