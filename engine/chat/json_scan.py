"""JSON read as it is written, one character at a time: where a value ends, and where each
member of an object starts and ends, before the text is complete. The streaming tool-call
parser (engine/chat/call_stream.py) reads a call's name and the growing text of its arguments
from it while the model is still writing the call.

    ObjectScan  '{"name": "f", "arguments": {"a": [1, "}"]}}'
                 members: name -> its value's span, arguments -> its span (open until
                 the value's last character arrives); done at the final '}'
    ValueScan   one value of any kind ('{"a": 1}', '"text"', '12'): where it ends

They track strings, escapes and bracket depth, not the whole JSON grammar: `bad` means the
text cannot be the start of an object of members; whether a value is valid JSON is for
json.loads once it is complete. Resumable and linear: `feed` scans only the new characters.
"""

from __future__ import annotations

import json

_WS = " \t\n\r"


class ValueScan:
    """One JSON value: `end` (an index into `text`) once its last character is scanned."""

    def __init__(self) -> None:
        self.text = ""
        self.start: int | None = None  # its first character (leading whitespace skipped)
        self.end: int | None = None
        self._i = 0
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, text: str) -> None:
        self.text += text
        while self.end is None and self._i < len(self.text):
            self.step(self.text[self._i], self._i)
            self._i += 1

    def finish(self, length: int | None = None) -> None:
        """The text ended (at `length`, default its own): a number or literal is complete."""
        if self.end is None and self.start is not None and not self._open:
            self.end = len(self.text) if length is None else length

    @property
    def _open(self) -> bool:
        return self._in_string or self._depth > 0

    def value_text(self) -> str:
        """The value as written so far (all of it once `end` is set)."""
        if self.start is None:
            return ""
        return self.text[self.start : self.end if self.end is not None else len(self.text)]

    def step(self, c: str, i: int) -> None:
        """Scans character `c` at index `i` (of `text`, or of the caller's text)."""
        if self.start is None:
            if c in _WS:
                return
            self.start = i
        if self._in_string:
            if self._escape:
                self._escape = False
            elif c == "\\":
                self._escape = True
            elif c == '"':
                self._in_string = False
                if self._depth == 0:
                    self.end = i + 1
            return
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]" and self._depth > 0:
            self._depth -= 1
            if self._depth == 0:
                self.end = i + 1
        elif self._depth == 0 and i > self.start and (c in _WS or c in ",}]"):
            self.end = i  # a number or literal ends at the first character after it


class ObjectScan:
    """One JSON object's members as they are written. `members[key]` is the span
    [start, end) of the key's value in `text` (end None while the value is open)."""

    def __init__(self) -> None:
        self.text = ""
        self.members: dict[str, list[int | None]] = {}
        self.order: list[str] = []  # keys in the order written
        self.end: int | None = None  # after the closing '}'
        self.bad: int | None = None  # where the text stopped being an object's start
        self._i = 0
        self._state = "open"
        self._key_start = 0
        self._key = ""
        self._escape = False
        self._value: ValueScan | None = None  # the open member value (indices into text)

    @property
    def done(self) -> bool:
        return self.end is not None

    def feed(self, text: str) -> None:
        self.text += text
        while self.end is None and self.bad is None and self._i < len(self.text):
            self._char(self.text[self._i])
            self._i += 1

    def finish(self) -> None:
        """The text ended (a cut-off object stays open; a trailing literal value closes)."""
        if self._value is not None:
            self._value.finish(len(self.text))
            self._close_value()

    def value_text(self, key: str) -> str | None:
        """`key`'s value as written so far, or None when the key has not appeared."""
        span = self.members.get(key)
        if span is None:
            return None
        start, end = span
        return self.text[start : end if end is not None else len(self.text)]

    def complete_string(self, key: str) -> str | None:
        """`key`'s value when it is a complete JSON string, decoded; else None."""
        span = self.members.get(key)
        if span is None or span[1] is None or self.text[span[0]] != '"':
            return None
        try:
            value = json.loads(self.text[span[0] : span[1]])
        except (json.JSONDecodeError, RecursionError):
            return None
        return value if isinstance(value, str) else None

    def _char(self, c: str) -> None:
        state, i = self._state, self._i
        if state == "value":
            self._value_char(c)
        elif state == "key":
            self._key_char(c)
        elif c in _WS:
            return
        elif state == "open":
            self._expect(c == "{", "first")
        elif state == "first" and c == "}":
            self.end = i + 1
        elif state in ("first", "next_key"):
            self._expect(c == '"', "key")
            self._key_start = i
        elif state == "colon":
            self._expect(c == ":", "value")
            self._value = ValueScan()
            self.members[self._key] = [i + 1, None]
            self.order.append(self._key)
        elif state == "after":
            if c == "}":
                self.end = i + 1
            else:
                self._expect(c == ",", "next_key")

    def _expect(self, ok: bool, next_state: str) -> None:
        if ok:
            self._state = next_state
        else:
            self.bad = self._i

    def _key_char(self, c: str) -> None:
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            try:
                self._key = json.loads(self.text[self._key_start : self._i + 1])
            except (json.JSONDecodeError, RecursionError):
                self.bad = self._i
                return
            self._state = "colon"

    def _value_char(self, c: str) -> None:
        value, span = self._value, self.members[self._key]
        value.step(c, self._i)
        if value.start is not None:
            span[0] = value.start
        if value.end is None:
            return
        self._close_value()
        if value.end == self._i:  # a literal ended by this character: rescan it
            self._i -= 1

    def _close_value(self) -> None:
        value = self._value
        if value is None or value.end is None:
            return
        self.members[self._key][1] = value.end
        self._value, self._state = None, "after"
