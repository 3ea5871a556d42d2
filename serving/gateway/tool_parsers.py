"""Where a model's answer holds tool calls, in the formats the supported families write (vLLM's
parser names):

    hermes        Hermes, Qwen 2/2.5/3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
                  anywhere in the answer, one call per block
    llama3_json   Llama 3.1/3.2/3.3: the answer opens with {"name": ..., "parameters": {...}}
                  (after <|python_tag|> if the detokenizer kept it), several separated by ";"
    mistral       Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]; an answer that
                  opens with "[" is read the same way (the detokenizer drops [TOOL_CALLS])

`scan(text, final)` cuts an answer into text and blocks (a block: the text of one or more calls as
written). What it returns is decided: more text never changes it, so a streamed answer, scanned as
it grows, gives the same blocks as the whole one. Before `final`, text that could still begin a
block (a partial marker, a block not closed yet) is left undecided. A block not closed by the end
of the answer is text.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

PARSER_NAMES = ("hermes", "llama3_json", "mistral")


@dataclass(slots=True)
class Block:
    """One or more calls as the model wrote them."""
    start: int  # text[start:start + len(raw)] is the block, markers and separators included
    raw: str
    body: str  # the JSON text of the calls

    def calls(self) -> list[Any]:
        """The calls' JSON values; ValueError if the body is not JSON."""
        value = json.loads(self.body)
        return value if isinstance(value, list) else [value]


@dataclass(slots=True)
class Scan:
    parts: list[str | Block] = field(default_factory=list)  # text and blocks, in order
    decided: int = 0  # text[:decided] is in parts; the rest may still become a block
    memo: dict[int, tuple] | None = None  # json_end's, kept by the caller between scans of a growing text


class ToolParser(Protocol):
    name: str
    markers: tuple[str, ...]  # text in a chat template that says its models write this format

    def scan(self, text: str, final: bool, memo: dict[int, tuple] | None = None) -> Scan:
        """`memo`: json_end's, for a text that grows between scans."""


def json_end(text: str, start: int, memo: dict[int, tuple] | None = None) -> int | None:
    """The end of the JSON object or array that opens at text[start], or None while it is open;
    strings are skipped, other text is not checked (json.loads does that). `memo` keeps where an
    open one was left, so a growing text is read once."""
    begin, depth, in_string, escape = (memo or {}).get(start, (start, 0, False, False))
    for i in range(begin, len(text)):
        ch = text[i]
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    if memo is not None:
        memo[start] = (len(text), depth, in_string, escape)
    return None


def partial_marker(text: str, marker: str) -> int:
    """How many of text's last characters could begin `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class HermesParser:
    name = "hermes"
    markers = ("<tool_call>",)
    START, END = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool, memo: dict[int, tuple] | None = None) -> Scan:
        scan, pos = Scan(), 0
        while (start := text.find(self.START, pos)) >= 0:
            end = text.find(self.END, start)
            if end < 0:  # open: undecided, or text once the answer is whole
                break
            end += len(self.END)
            scan.parts += [text[pos:start], Block(start, text[start:end], text[start + len(self.START):end - len(self.END)].strip())]
            pos = end
        else:
            start = len(text) if final else len(text) - partial_marker(text, self.START)
        scan.parts.append(text[pos:start])
        if final and start < len(text):
            scan.parts.append(text[start:])
        scan.decided = len(text) if final else start
        return scan


class OpeningJsonParser:
    """Calls that open the answer: `lead` (a marker, optional), then JSON values joined by
    `separator`; the text after them is content. Also taken after `marker` anywhere in the text."""
    name: str
    markers: tuple[str, ...]
    lead: str  # a marker the detokenizer may have dropped
    opens: str  # the characters a call's JSON may begin with
    separator: str | None

    def scan(self, text: str, final: bool, memo: dict[int, tuple] | None = None) -> Scan:
        scan = Scan(memo=memo)
        i = _skip_space(text, 0)
        if text.startswith(self.lead, i):
            i = _skip_space(text, i + len(self.lead))
        elif not final and self.lead.startswith(text[i:]) and text[i:]:
            return scan  # could be the marker
        if i == len(text) and not final:
            return scan
        if i == len(text) or text[i] not in self.opens:
            return self._after(text, 0, final, scan)
        pos = 0
        while True:
            end = json_end(text, i, scan.memo)
            if end is None:  # open
                return self._close(text, pos, final, scan)
            scan.parts.append(Block(pos, text[pos:end], text[i:end]))
            pos = end
            j = _skip_space(text, end)
            if j == len(text) and not final:
                scan.decided = pos
                return scan
            if self.separator is None or not text.startswith(self.separator, j):
                return self._after(text, pos, final, scan)
            i = _skip_space(text, j + len(self.separator))
            if i == len(text) and not final:
                scan.decided = pos
                return scan
            if i == len(text) or text[i] not in self.opens:
                return self._after(text, pos, final, scan)

    def _after(self, text: str, pos: int, final: bool, scan: Scan) -> Scan:
        """The rest of the text from pos, which opens with no call."""
        scan.parts.append(text[pos:])
        scan.decided = len(text)
        return scan

    def _close(self, text: str, pos: int, final: bool, scan: Scan) -> Scan:
        if final:
            scan.parts.append(text[pos:])
        scan.decided = len(text) if final else pos
        return scan


class Llama3JsonParser(OpeningJsonParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", '"parameters"')
    lead = "<|python_tag|>"
    opens = "{"
    separator = ";"


class MistralParser(OpeningJsonParser):
    """Mistral's [TOOL_CALLS] array, opening the answer or after the marker anywhere."""
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    lead = "[TOOL_CALLS]"
    opens = "[{"
    separator = None

    def _after(self, text: str, pos: int, final: bool, scan: Scan) -> Scan:
        start = text.find(self.lead, pos)
        if start < 0:
            end = len(text) if final else len(text) - partial_marker(text[pos:], self.lead)
            scan.parts.append(text[pos:end])
            scan.decided = end
            return scan
        scan.parts.append(text[pos:start])
        i = _skip_space(text, start + len(self.lead))
        if i == len(text) and not final:
            scan.decided = start
            return scan
        if i == len(text) or text[i] not in self.opens:  # a marker with no call: text
            scan.parts.append(text[start:i + 1])
            return self._after(text, i + 1, final, scan)
        end = json_end(text, i, scan.memo)
        if end is None:
            return self._close(text, start, final, scan)
        scan.parts.append(Block(start, text[start:end], text[i:end]))
        return self._after(text, end, final, scan)


PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser())}


def parser_for_template(template: str) -> ToolParser:
    """The parser for the calls a chat template's models write (hermes when it says nothing)."""
    for parser in (PARSERS["mistral"], PARSERS["hermes"], PARSERS["llama3_json"]):
        if any(marker in template for marker in parser.markers):
            return parser
    return PARSERS["hermes"]


NAME_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
ARGUMENTS_HEAD = re.compile(r'\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"arguments"\s*:\s*')


@dataclass(slots=True)
class _Element:
    start: int  # where its "{" is
    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None


class CallArrayReader:
    """A `required` answer, a JSON array of {"name": ..., "arguments": {...}} in the order the
    constraint writes them, read as it comes (each character once): a call's name once its string
    closes, its arguments as written so far. The same text fed whole or in any pieces gives the
    same calls."""

    def __init__(self) -> None:
        self.text = ""
        self.depth, self.in_string, self.escape = 0, False, False
        self.elements: list[_Element] = []

    def feed(self, delta: str) -> None:
        start = len(self.text)
        self.text += delta
        for i in range(start, len(self.text)):
            self._step(i, self.text[i])

    def calls(self) -> list[tuple[str, str]]:
        """(name, arguments text) of each call whose name is known."""
        return [(e.name, "" if e.arguments_start is None else self.text[e.arguments_start:e.arguments_end])
                for e in self.elements if e.name is not None]

    def _step(self, i: int, ch: str) -> None:
        element = self.elements[-1] if self.elements else None
        if self.in_string:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 2 and element is not None and element.name is None \
                        and (m := NAME_HEAD.fullmatch(self.text, element.start, i + 1)):
                    element.name = json.loads(m.group(1))
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            if self.depth == 1 and ch == "{":
                self.elements.append(_Element(i))
            elif self.depth == 2 and element is not None and element.arguments_start is None \
                    and ARGUMENTS_HEAD.fullmatch(self.text, element.start, i):
                element.arguments_start = i
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 2 and element is not None and element.arguments_start is not None \
                    and element.arguments_end is None:
                element.arguments_end = i + 1
