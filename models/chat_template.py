"""The model's own chat template, rendered the way Hugging Face `transformers` renders it.

A chat template is Jinja source shipped with the model (GGUF `tokenizer.chat_template`, or
`chat_template` in `tokenizer_config.json`). Templates come from the Hub and are untrusted code,
so they run in jinja2's `ImmutableSandboxedEnvironment`, with the same environment options,
globals and filters as `transformers.utils.chat_template_utils._cached_compile_jinja_template`
(trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `strftime_now`, a `tojson` that
does not HTML-escape, a restricted `dict` and `namespace`). Keeping the environment identical is
what makes our prompt strings byte-for-byte equal to `tokenizer.apply_chat_template(...,
tokenize=False)`, which the tests check.

    template = ChatTemplate(text)
    prompt = template.render(messages, add_generation_prompt=True, special_tokens={...})

Bad messages raise `configs.errors.InvalidRequestError` naming the message and field (the serving
layer maps it to INVALID_ARGUMENT); a template that calls `raise_exception` does the same, since
it is rejecting the conversation. A template that does not compile raises `ChatTemplateError`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from configs.errors import InvalidRequestError

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The chat template itself is broken (does not compile, or fails while rendering)."""


def template_sha256(text: str) -> str:
    """Hex sha256 of the template source: part of the model's resolved identity."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class ChatTemplate:
    """A compiled chat template. Compile once per model; `render` is cheap (~0.1 ms)."""

    def __init__(self, text: str, source: str = "<chat template>"):
        if not isinstance(text, str) or not text.strip():
            raise ChatTemplateError(f"{source}: chat template is empty")
        self.text = text
        self.source = source
        self.sha256 = template_sha256(text)
        try:
            self._compiled = _environment().from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{source}: chat template line {e.lineno}: {e.message}") from e

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        special_tokens: Mapping[str, str | None] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages` (role/content dicts).

        `special_tokens` (bos_token, eos_token, unk_token, pad_token) become template variables,
        as transformers passes `tokenizer.special_tokens_map`; `template_kwargs` override them.
        """
        chat = validate_messages(messages)
        variables = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        variables.update(template_kwargs)
        try:
            return self._compiled.render(
                messages=chat,
                tools=variables.pop("tools", None),
                documents=variables.pop("documents", None),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _TemplateRejected as e:
            raise InvalidRequestError(
                "messages", _summary(chat), f"rejected by the chat template: {e}"
            ) from e
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.source}: rendering failed: {e}") from e

    def __repr__(self) -> str:
        return f"ChatTemplate(source={self.source!r}, sha256={self.sha256[:12]}...)"


def validate_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Plain-dict copies of `messages`, keys with a None value dropped (as transformers does).

    Each message needs a non-empty string `role` and a `content` that is a string or a list of
    content blocks (dicts); an assistant message carrying `tool_calls` may omit `content`.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages", type(messages).__name__, "must be a list of messages")
    if not messages:
        raise InvalidRequestError("messages", [], "must hold at least one message")
    chat = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"messages[{i}]", message, "must be a dict with 'role' and 'content'"
            )
        message = {k: v for k, v in message.items() if v is not None}
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError(f"messages[{i}].role", role, "must be a non-empty string")
        content = message.get("content")
        if content is None and "tool_calls" not in message:
            raise InvalidRequestError(f"messages[{i}].content", None, "is required")
        if content is not None and not _is_content(content):
            raise InvalidRequestError(
                f"messages[{i}].content", content, "must be a string or a list of content blocks"
            )
        chat.append(_alias_reasoning(_plain(message)))
    return chat


# Names a message's reasoning may come under; templates read `reasoning_content` (or `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """Expose reasoning under both names templates read, as transformers does."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _is_content(content: Any) -> bool:
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(isinstance(block, Mapping) for block in content)


def _plain(value: Any) -> Any:
    """A copy built from plain JSON types only, so the sandbox never sees a caller's rich object."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return f"<{type(value).__name__}>"


def _summary(chat: list[dict[str, Any]]) -> str:
    return "[" + ", ".join(str(m.get("role")) for m in chat) + "]"


class _TemplateRejected(jinja2.TemplateError):
    """Raised by the template's own `raise_exception(...)`: the conversation is not acceptable."""


def _raise_exception(message: str):
    raise _TemplateRejected(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # NOTE: jinja's built-in tojson HTML-escapes '<', '>' and '&'; transformers overrides it so
    # that tool schemas render verbatim. We must do the same to render identical prompts.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore attributes (no reaching CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with '_'")


class _GenerationTag(jinja2.ext.Extension):
    """Accepts transformers' `{% generation %}...{% endgeneration %}` block and renders its body.

    Templates written for assistant-token masks use it; we never need the mask, only the text.
    """

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller):
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
