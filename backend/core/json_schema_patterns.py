"""JSON Schema's patterns and formats as xgrammar compiles them: the formats it enforces, exact
regexes for those it reads loosely, the regex constructs it cannot, and a search as a whole-string match."""
from __future__ import annotations

import re

FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# formats xgrammar reads loosely (2023-02-30, year 0000, 01.2.3.4): RFC 3339's and RFC 2673's exact
# forms, a little stricter (no February 29th, no leap second)
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_MONTH_DAY = ("(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              "|02-(?:0[1-9]|1[0-9]|2[0-8]))")
_TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMAT_PATTERNS = {"date": f"^{_YEAR}-{_MONTH_DAY}$", "date-time": f"^{_YEAR}-{_MONTH_DAY}T{_TIME}$",
                   "time": f"^{_TIME}$", "ipv4": f"^{_OCTET}(?:\\.{_OCTET}){{3}}$"}
# regex constructs xgrammar ignores (lookaround) or cannot compile (backreferences, \b, \p{...})
UNSUPPORTED_REGEX = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<|\\[bBpP]")


def search_as_match(pattern: str) -> str:
    """A JSON Schema pattern (found anywhere in the string) as a regex the whole string matches:
    `^a` becomes `a.*`, `[0-9]` becomes `.*[0-9].*`, `^a$` stays as it is. Top-level alternatives
    are rewritten one by one."""
    alternatives = _top_level_alternatives(pattern)
    if len(alternatives) > 1:
        return "|".join(f"({search_as_match(a)})" for a in alternatives)
    head = pattern[1:] if pattern.startswith("^") else "[\\s\\S]*" + pattern
    anchored_end = head.endswith("$") and not head.endswith("\\$")
    return head[:-1] if anchored_end else head + "[\\s\\S]*"


def _top_level_alternatives(pattern: str) -> list[str]:
    out, depth, start, i, in_class = [], 0, 0, 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "|" and depth == 0:
            out.append(pattern[start:i])
            start = i + 1
        i += 1
    return out + [pattern[start:]]
