"""One tool-call section read as the model writes it (engine/chat/call_stream.py's
incremental reading): the calls in it, each call's name once complete and its arguments as
written so far, and where the calls end.

    <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>        hermes: one call
    {"name": "f", "parameters": {...}}; {"name": "g", ...}                   llama3_json
    [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]   [TOOL_CALLS]f[ARGS]{...}   mistral

A call is an ObjectScan of its JSON object (engine/chat/json_scan.py), or a ValueScan of the
arguments after a name written as markup.
"""

from __future__ import annotations

import json
import re

from engine.chat.json_scan import ObjectScan, ValueScan
from engine.chat.tool_parsers import ToolCallFormat

_NAME = re.compile(r"\s*[\w.-]*\s*")
ARGS_KEYS = ("arguments", "parameters")


class CallScan:
    """One call of a section being written: an object {"name", "arguments"} or, after a
    name written as markup (mistral's name[ARGS]), the arguments value alone."""

    def __init__(self, base: int, name: str | None = None):
        self.base = base  # where its text starts in the section's text
        self.fixed_name = name
        self.obj = ObjectScan() if name is None else None
        self.value = ValueScan() if name is not None else None
        self.tail = ""  # after it failed once announced: the rest of the section

    @property
    def text(self) -> str:
        return self.obj.text if self.obj is not None else self.value.text

    @property
    def name(self) -> str | None:
        if self.fixed_name is not None:
            return self.fixed_name
        return self.obj.complete_string("name") or None

    @property
    def done(self) -> bool:
        return self.obj.done if self.obj is not None else self.value.end is not None

    @property
    def bad(self) -> bool:
        return self.obj is not None and self.obj.bad is not None

    def feed(self, text: str) -> int:
        """Feeds `text`; how much of it is this call's (all of it unless the call ended)."""
        before = len(self.text)
        if self.obj is not None:
            self.obj.feed(text)
            end = self.obj.end if self.obj.end is not None else self.obj.bad
        else:
            self.value.feed(text)
            end = self.value.end
        if end is None:
            return len(text)
        if self.obj is not None:
            self.obj.text = self.obj.text[:end]
        else:
            self.value.text = self.value.text[:end]
        return end - before

    def finish(self) -> None:
        if self.obj is not None:
            self.obj.finish()
        else:
            self.value.finish()

    def arguments(self) -> str:
        """The arguments as written so far: a JSON string value decoded once complete, `{}`
        for a complete object without them; then the tail."""
        if self.obj is None:
            raw, complete = self.value.value_text(), self.value.end is not None
        else:
            key = next((k for k in self.obj.order if k in ARGS_KEYS), None)
            if key is None:
                return ("{}" if self.obj.done else "") + self.tail
            raw = self.obj.value_text(key).lstrip()
            complete = self.obj.members[key][1] is not None
        if raw.startswith('"'):
            raw = _decoded(raw) if complete else ""
        return raw + self.tail


def _decoded(raw: str) -> str:
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return raw
    return value if isinstance(value, str) else raw


class CallSection:
    """One call section read as it is written (incremental). Its states, over the text after
    the opening markup:

        lead       whitespace, then '{' (a call object), '[' (mistral's list), or a name
                   (mistral's name[ARGS]value)
        call       inside a call (CallScan)
        next       after a call: the format's separator (',' in a list, ';' llama3_json),
                   ']' closing the list, else the calls ended (`closed_at`)
        junk       hermes: text between a complete call and </tool_call> (content)
        failed     an announced call stopped being one: the rest is its arguments
    """

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.text = ""
        self.i = 0
        self.state = "lead"
        self.in_list = False
        self.name_start = 0
        self.junk_from: int | None = None
        self.calls: list[CallScan] = []
        self.closed_at: int | None = None  # the calls ended here; the text after is not theirs
        self.fallback = False  # not a call section after all (nothing announced): whole mode

    @property
    def active(self) -> bool:
        return self.closed_at is None and not self.fallback

    def feed(self, text: str) -> None:
        self.text += text
        if self.state == "failed":
            self.calls[-1].tail += text
            return
        while self.active and self.i < len(self.text) and self.state != "failed":
            if self.state == "call":
                self._call_step()
            else:
                self._char(self.text[self.i])
                self.i += 1

    def close(self) -> None:
        """The section's text ended (its closing markup, or the end of the output)."""
        if not self.active or self.state in ("failed", "junk"):
            return
        if self.state == "call":
            call = self.calls[-1]
            call.finish()
            if not call.done:
                self._unfinished(call)
        elif self.state in ("lead", "name") or (self.state == "call_lead" and not self.calls):
            self.fallback = True

    def junk(self) -> str:
        return self.text[self.junk_from :].strip() if self.junk_from is not None else ""

    def _call_step(self) -> None:
        call = self.calls[-1]
        self.i += call.feed(self.text[self.i :])
        if call.bad or (call.done and call.name is None):
            self._unfinished(call, at=self.i)
        elif call.done:
            self.state = "next"
            if call.obj is None:  # name[ARGS]value: a section per call
                self.closed_at = self.i

    def _unfinished(self, call: CallScan, at: int | None = None) -> None:
        """A call that did not finish as a call: the rest is an announced call's arguments;
        an unannounced first call makes the section not a call section; a later one ends
        the calls where it started."""
        if call.name is not None:
            self.state = "failed"
            call.tail = self.text[at:] if at is not None else ""
        elif len(self.calls) == 1:
            self.fallback = True
        else:
            self.calls.pop()
            self.closed_at = call.base

    def _start_call(self, name: str | None = None) -> None:
        self.calls.append(CallScan(self.i if name is None else self.i + 1, name))
        self.state = "call"

    def _char(self, c: str) -> None:
        state, fmt = self.state, self.fmt
        if state == "name":
            self._name_char()
        elif state == "junk" or c.isspace():
            return
        elif state in ("lead", "call_lead") and c == "{":
            self._start_call()
            self.i -= 1  # the call reads its own '{'
        elif state == "lead" and fmt.list_open and c == fmt.list_open:
            self.in_list, self.state = True, "call_lead"
        elif state == "lead" and fmt.named_args:
            self.state, self.name_start = "name", self.i
            self._name_char()
        elif state == "next":
            self._after_call(c)
        else:  # not the start of a call
            self._unfinished_lead()

    def _unfinished_lead(self) -> None:
        if not self.calls:
            self.fallback = True
        else:
            self.closed_at = self.i

    def _after_call(self, c: str) -> None:
        fmt = self.fmt
        if self.in_list and c == ",":
            self.state = "call_lead"
        elif self.in_list and c == fmt.list_close:
            self.closed_at = self.i + 1
        elif not self.in_list and fmt.separator and c == fmt.separator:
            self.state = "call_lead"
        elif fmt.end is not None:  # hermes: text before the closing tag
            self.state, self.junk_from = "junk", self.i
        else:
            self.closed_at = self.i

    def _name_char(self) -> None:
        marker = self.fmt.named_args
        seg = self.text[self.name_start : self.i + 1]
        k = seg.find(marker[0])
        name, mark = (seg, "") if k < 0 else (seg[:k], seg[k:])
        if not _NAME.fullmatch(name) or not marker.startswith(mark):
            self.fallback = True
        elif mark == marker:
            if not name.strip():
                self.fallback = True
            else:
                self._start_call(name.strip())
