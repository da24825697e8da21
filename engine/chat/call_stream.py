"""Output text in, content and tool calls out, as the text streams (one ToolCallStream per
choice; the formats' markup is engine/chat/tool_parsers.py's).

Two ways to read a call, chosen per request (ChatSetup: `incremental` exactly when decoding
is constrained by the call grammar, so the call's syntax cannot go wrong):

    whole        a call's markup is held until the call closes and parses; a section that
                 does not parse (malformed JSON, cut off) comes back as content, as written.
                 A call is never announced and then retracted. Its first delta arrives when
                 the call is complete. (`parse` of unconstrained text; the servers' requests
                 all have a grammar.)
    incremental  OpenAI's streaming: a call is announced (index, id, name) as soon as its
                 name is complete, then its arguments stream as the model writes them, each
                 new piece an `arguments` fragment; the fragments concatenate to the
                 arguments as written. (required, a named function, and auto: the grammar,
                 lazy under auto, makes every call well-formed.)

    text "Let me check.<tool_call>\\n{"name": "f", "arguments": {"a": 1}}\\n</tool_call>"
      feed -> [content "Let me check."]  [call 0: f]  [0: '{"a": ']  [0: '1}']  ...

Incremental, a section that is not a call before any name is complete (no JSON object, an
object without a name) is read the whole way (content). Once a call is announced it stays a
call: if its text then stops being a call (cut off by max_tokens; malformed, which only an
engine that ignores the grammar writes), the rest of its section becomes its arguments, as
written: nothing is lost, nothing of the markup reaches content, and the client sees
arguments that are not valid JSON, as OpenAI's API gives them for a call cut off by
max_tokens. After a complete call, text that is not markup is content. Whitespace next to
markup is dropped. The section itself is engine/chat/call_section.py's.

The non-streamed response is the same stream fed all at once (`parse`), so streamed and
non-streamed answers agree by construction.
"""

from __future__ import annotations

import dataclasses

from engine.chat.call_section import CallSection
from engine.chat.tool_parsers import ToolCall, ToolCallFormat, dumps, held_prefix


@dataclasses.dataclass(frozen=True)
class ToolEvent:
    """One step of a parsed stream, in output order: content text, a call announced (`call`:
    its id and name, at `index`), or a fragment of call `index`'s arguments."""

    content: str = ""
    call: ToolCall | None = None
    index: int = -1
    arguments: str = ""


class ToolCallStream:
    """Output text in, content and tool calls out (see the module docstring)."""

    def __init__(self, fmt: ToolCallFormat, incremental: bool = False):
        self.fmt = fmt
        self.incremental = incremental
        self.calls: list[ToolCall] = []  # arguments as far as they were given out
        self._buf = ""  # text not yet given out
        self._opener: str | None = None  # inside a call section: the markup that opened it
        self._section: CallSection | None = None  # incremental: the section being read
        self._first = 0  # incremental: index in self.calls of the section's first call
        self._started = False  # any non-whitespace output seen (bare JSON starts only there)
        self._after_call = False  # drop the whitespace right after a call
        self._held_ws = ""  # trailing whitespace of content (dropped if markup follows)

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        out: list[ToolEvent] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ToolEvent]:
        """The end of the output: an open call section is parsed (or given back as content),
        held text is given out."""
        out: list[ToolEvent] = []
        while self._section is not None:  # it takes the rest; what follows its calls is read
            self._section.feed(self._buf)
            self._buf = ""
            self._end_section(out)
            while self._step(out):
                pass
        if self._opener is not None:
            self._close_section(self._buf, "", out)
        else:
            self._content(self._buf, out, before_markup=False)
            if self._held_ws and not self._after_call:
                out.append(ToolEvent(content=self._held_ws))
        self._buf, self._held_ws = "", ""
        return out

    def _step(self, out: list[ToolEvent]) -> bool:
        """Consumes what it can of the buffer; True when it should run again."""
        fmt = self.fmt
        if self._section is not None:
            return self._step_section(out)
        if self._opener is not None:
            if fmt.end is None or (i := self._buf.find(fmt.end)) < 0:
                return False
            body, self._buf = self._buf[:i], self._buf[i + len(fmt.end) :]
            self._close_section(body, fmt.end, out)
            return True
        if fmt.bare_json_start and not self._started:
            stripped = self._buf.lstrip()
            if not stripped:
                return False
            self._started = True
            if stripped.startswith("{"):
                self._open("", stripped)
                return True
        i = self._buf.find(fmt.start)
        if i >= 0:
            self._content(self._buf[:i], out, before_markup=True)
            self._open(fmt.start, self._buf[i + len(fmt.start) :])
            return True
        keep = held_prefix(self._buf, fmt.start)
        self._content(self._buf[: len(self._buf) - keep], out, before_markup=False)
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _open(self, opener: str, rest: str) -> None:
        self._opener, self._buf = opener, rest
        if self.incremental:
            self._section, self._first = CallSection(self.fmt), len(self.calls)

    # ---- incremental ------------------------------------------------------------------------
    def _step_section(self, out: list[ToolEvent]) -> bool:
        """Feeds the section what is surely its text (up to its closing tag); True when the
        section ended (the buffer then holds what follows it)."""
        sec, end = self._section, self.fmt.end
        i = self._buf.find(end) if end is not None else -1
        cut = i if i >= 0 else len(self._buf) - (held_prefix(self._buf, end) if end else 0)
        sec.feed(self._buf[:cut])
        self._buf = self._buf[cut:]
        if sec.active and i < 0:
            self._emit(sec, out)
            return False
        if sec.active:  # the closing tag ends the section's text
            sec.close()
            if not sec.fallback:  # (else the whole reading needs the tag)
                self._buf = self._buf[len(end) :]
        self._end_section(out)
        return True

    def _end_section(self, out: list[ToolEvent]) -> None:
        """The section's calls are over: announced ones finish; a section that was not one
        goes back to the whole reading (its text and the buffer, in order)."""
        sec = self._section
        sec.close()
        self._section = None
        if sec.fallback:
            self._buf = sec.text + self._buf
            return
        self._emit(sec, out)
        self._opener, self._held_ws, self._after_call = None, "", True
        if sec.closed_at is not None:
            self._buf = sec.text[sec.closed_at :] + self._buf
        elif junk := sec.junk():
            self._content(junk, out, before_markup=False)
            self._after_call = True

    def _emit(self, sec: CallSection, out: list[ToolEvent]) -> None:
        """Announces the section's calls whose names are complete, and gives out the new
        part of each announced call's arguments."""
        for k, scan in enumerate(sec.calls):
            index = self._first + k
            if index == len(self.calls):
                if scan.name is None:
                    return  # names come in order: the calls after wait for this one
                self.calls.append(ToolCall(scan.name, ""))
                out.append(ToolEvent(call=self.calls[index], index=index))
            call = self.calls[index]
            new = scan.arguments()[len(call.arguments) :]
            if new:
                self.calls[index] = dataclasses.replace(call, arguments=call.arguments + new)
                out.append(ToolEvent(index=index, arguments=new))

    # ---- whole ------------------------------------------------------------------------------
    def _close_section(self, body: str, closer: str, out: list[ToolEvent]) -> None:
        opener, self._opener = self._opener or "", None
        calls = self.fmt.parse_section(body)
        if calls is None:  # not a call after all: the model's text, as it wrote it
            self._content(opener + body + closer, out, before_markup=False)
            return
        self._held_ws = ""
        for name, args in calls:
            call = ToolCall(name, dumps(args))
            self.calls.append(call)
            out.append(ToolEvent(call=call, index=len(self.calls) - 1))
            out.append(ToolEvent(index=len(self.calls) - 1, arguments=call.arguments))
        self._after_call = True

    def _content(self, text: str, out: list[ToolEvent], before_markup: bool) -> None:
        if text and not text.isspace():
            self._started = True
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text, self._held_ws = self._held_ws + text, ""
        trimmed = text.rstrip()
        if not before_markup:
            self._held_ws = text[len(trimmed) :]
        if trimmed:
            out.append(ToolEvent(content=trimmed))


def parse(fmt: ToolCallFormat, text: str, incremental: bool = False) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole output: the stream fed at once."""
    stream = ToolCallStream(fmt, incremental)
    events = stream.feed(text) + stream.finish()
    return "".join(e.content for e in events), stream.calls
