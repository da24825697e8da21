"""A MockEngine whose replies are scripted text: tests of output parsing (tool calls,
reasoning) and of agent loops drive the real serving path with model outputs recorded from
real models, byte by byte (the mock's tokenizer has one token per UTF-8 byte, so every
recorded output streams token by token and every tag is split across tokens).

    engine = ScriptedEngine(lambda prompt: "<tool_call>\\n{...}\\n</tool_call>")
    # each request's output: reply(its prompt text) as bytes, then EOS

The reply is chosen from the prompt the server rendered (chat template included), so a
test script can answer differently once the conversation holds a tool result.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.sched.scheduler import SchedulerOutput
from serving.engine_host.mock_engine import MockEngine


class ScriptedEngine(MockEngine):
    def __init__(self, reply: Callable[[str], str], **kwargs):
        kwargs.setdefault("max_model_len", 4096)
        kwargs.setdefault("num_pages", 4096)
        kwargs.setdefault("max_num_batched_tokens", 4096)
        super().__init__(**kwargs)
        self.reply = reply
        self._replies: dict[str, bytes] = {}  # request id -> its reply's bytes
        self.prompts: list[str] = []  # every request's prompt text, in arrival order

    def device_step(self, plan: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for s in plan.scheduled:
            if not s.samples:
                continue
            req = s.request
            script = self._replies.get(req.request_id)
            if script is None:
                prompt = bytes(req.prompt_token_ids).decode("utf-8", "replace")
                self.prompts.append(prompt)
                script = self._replies[req.request_id] = self.reply(prompt).encode("utf-8")
            i = req.num_output_tokens
            sampled[req.request_id] = script[i] if i < len(script) else self.eos_token_id
        return sampled

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_ids[0]
