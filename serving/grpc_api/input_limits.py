"""Cheap bounds on a request's raw fields, checked before any tokenizing or queueing.

Tokenizing is the first costly thing the server does with a prompt (about 0.5 us per byte on
this CPU), so its input is bounded in bytes first: text and chat content at most
`max_prompt_bytes` UTF-8 bytes in all, at most `max_chat_messages` messages; tool
definitions and earlier calls (rendered into the prompt too) at most as many bytes. Enum
values and token ids are range-checked here too (proto3 accepts any int for an enum field).
Every failure is an InvalidRequestError naming the field, the value and the limit.
"""

from __future__ import annotations

from engine.errors import InvalidRequestError
from serving.proto import pagedjax_pb2 as pb

PRIORITY_VALUES = tuple(pb.Priority.values())


def utf8_len(text: str) -> int:
    """Bytes of `text` as UTF-8 (lone surrogates count as 3, the tokenizer refuses them)."""
    return len(text.encode("utf-8", "surrogatepass"))


def check_prompt_bytes(kind: str | None, req, max_prompt_bytes: int, max_messages: int) -> None:
    """`req` is a GenerateRequest or TokenizeRequest; `kind` its prompt oneof's case."""
    if kind == "text":
        size = utf8_len(req.text)
        if size > max_prompt_bytes:
            raise InvalidRequestError(
                "text", f"<{size} bytes>", f"at most {max_prompt_bytes} bytes"
            )
    elif kind == "chat":
        n = len(req.chat.messages)
        if n > max_messages:
            raise InvalidRequestError("chat.messages", f"<{n} messages>", f"at most {max_messages}")
        size = sum(utf8_len(m.content) + utf8_len(m.role) for m in req.chat.messages)
        if size > max_prompt_bytes:
            raise InvalidRequestError(
                "chat.messages", f"<{size} bytes>", f"at most {max_prompt_bytes} bytes in all"
            )


def check_token_ids(field: str, ids, vocab_size: int | None, max_count: int) -> None:
    if len(ids) > max_count:
        raise InvalidRequestError(field, f"<{len(ids)} ids>", f"at most {max_count}")
    if vocab_size is None:
        return
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"{field}[{i}]", token_id, f"0 <= id < {vocab_size}")


def check_generate_input(req: pb.GenerateRequest, cfg, vocab_size: int | None) -> None:
    """Raw-field bounds of a GenerateRequest; `cfg` is an AdmissionConfig."""
    kind = req.WhichOneof("prompt")
    check_prompt_bytes(kind, req, cfg.max_prompt_bytes, cfg.max_chat_messages)
    if kind == "token_ids":
        check_token_ids("token_ids", req.token_ids.ids, vocab_size, cfg.max_prompt_tokens)
    check_token_ids("stop_token_ids", req.stop_token_ids, vocab_size, cfg.max_stop_token_ids)
    if len(req.stop) > cfg.max_stop_strings:
        raise InvalidRequestError(
            "stop", f"<{len(req.stop)} strings>", f"at most {cfg.max_stop_strings}"
        )
    check_tools_bytes(req, cfg.max_prompt_bytes)
    if req.priority not in PRIORITY_VALUES:
        raise InvalidRequestError("priority", req.priority, f"one of {dict(pb.Priority.items())}")


def check_tools_bytes(req: pb.GenerateRequest, max_prompt_bytes: int) -> None:
    """Tool definitions and earlier calls are rendered into the prompt: bounded with it."""
    size = sum(
        utf8_len(t.function.name)
        + utf8_len(t.function.description)
        + utf8_len(t.function.parameters)
        for t in req.tools
    )
    if size > max_prompt_bytes:
        raise InvalidRequestError("tools", f"<{size} bytes>", f"at most {max_prompt_bytes} bytes")
    if req.WhichOneof("prompt") == "chat":
        calls = sum(utf8_len(c.arguments) for m in req.chat.messages for c in m.tool_calls)
        if calls > max_prompt_bytes:
            raise InvalidRequestError(
                "chat.messages", f"<{calls} bytes of tool calls>", f"at most {max_prompt_bytes}"
            )


def check_tokenize_input(req: pb.TokenizeRequest, cfg) -> None:
    check_prompt_bytes(req.WhichOneof("input"), req, cfg.max_prompt_bytes, cfg.max_chat_messages)
