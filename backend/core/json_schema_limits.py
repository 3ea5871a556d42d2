"""What a schema may cost to compile (SchemaLimits) and a regex's size with its counted
repetitions expanded, checked against those limits."""
from __future__ import annotations

import re
from dataclasses import dataclass

from backend.core.json_schema_merge import FIELD
from backend.errors import ValidationError

REPETITION = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """What one constraint may cost to compile; past a bound it is refused before compiling.
    Measured on a 2-core CPU with SmolLM2's 49k-token vocabulary (docs/guided-decoding.md)."""
    max_nodes: int = 2000  # subschemas, enum values and properties, all counted
    max_depth: int = 32  # subschemas nested in one another
    max_properties: int = 512  # properties (and patternProperties) of all objects together
    # ... where properties beyond the schema's are allowed (not strict): each costs some 30 ms
    max_free_properties: int = 64
    max_repetition: int = 1000  # one regex's size with its counted repetitions {n,m} expanded
    max_total_repetition: int = 4000  # the same over all of a schema's patterns



def check_repetitions(text: str, what: str, limits: SchemaLimits = SchemaLimits()) -> int:
    """A regex's (or grammar's) size once xgrammar expands its counted repetitions: each {n,m}
    repeats what it follows m times (n when there is no m), through nested groups. Past
    limits.max_repetition it is refused: `[a-z]{1,1000}` compiles in 0.1 s (a pattern) to 2 s (a
    regex), `[a-z]{1,10000}` in half a minute. Returns the size."""
    size = repetition_size(text)
    if size > limits.max_repetition:
        raise ValidationError(FIELD, f"{what} repeats too much: its counted repetitions ({{n,m}}) expand to {size} "
                                     f"items; at most {limits.max_repetition} are supported")
    return size


def repetition_size(text: str) -> int:
    """How many items `text`'s counted repetitions expand to (an item repeated once counts 1)."""
    stack = [[0, 0]]  # per open group: [size so far, size of the last item]
    i = 0
    while i < len(text):
        ch = text[i]
        match = REPETITION.match(text, i) if ch == "{" else None
        if match:
            counts = [int(c) for c in match.groups() if c]
            group = stack[-1]
            group[0] += group[1] * (max(counts) - 1)
            group[1] *= max(counts)
            i = match.end()
            continue
        if ch == "(":
            stack.append([0, 0])
        elif ch == ")" and len(stack) > 1:
            inner = stack.pop()[0]
            stack[-1][0] += inner
            stack[-1][1] = inner
        elif ch not in "|*+?^$":
            if ch == "\\":
                i += 1
            elif ch == "[":  # a class is one item
                end = text.find("]", i + 2)
                i = end if end > 0 else len(text)
            stack[-1][0] += 1
            stack[-1][1] = 1
        i += 1
    return sum(group[0] for group in stack)
