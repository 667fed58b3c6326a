"""Robust parsing of the paper's JSON answer {"chosen_answer", "reasoning"}.

Models wrap JSON in code fences, add prose around it, emit single quotes or a bare
"1"/"2". Every reply maps to ("1" | "2", reasoning) or to (None, None), which is
recorded as invalid and counted in the report, never dropped.
"""

from __future__ import annotations

import json
import re

_FENCE = re.compile(r"```(?:json|JSON)?\s*(.*?)```", re.S)
_CHOSEN = re.compile(r"""["']?chosen_answer["']?\s*[:=]\s*["']?\s*(?:answer[_\s]*)?([12])\b""", re.I)
_REASONING = re.compile(r"""["']?reasoning["']?\s*[:=]\s*["'](.*?)["']\s*[,}]?\s*$""", re.I | re.S)
_BARE = re.compile(r"^\s*(?:answer[_\s:]*)?\**\s*([12])\s*\**\s*(?:[.):\-]|$)", re.I)


def _choice_value(value) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value in (1, 2):
        return str(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(?:answer[_\s]*)?([12])\s*\.?\s*", value, re.I)
        return m.group(1) if m else None
    return None


def _json_objects(text: str):
    """Every balanced {...} substring that parses as a JSON object, in order."""
    for start in [i for i, ch in enumerate(text) if ch == "{"]:
        depth, in_str, esc = 0, False, False
        for end in range(start, len(text)):
            ch = text[end]
            if in_str:
                esc = (ch == "\\") and not esc
                if ch == '"' and not esc:
                    in_str = False
                continue
            if ch == '"':
                in_str = True
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    try:
                        obj = json.loads(text[start : end + 1])
                    except json.JSONDecodeError:
                        break
                    if isinstance(obj, dict):
                        yield obj
                    break


def reply_json_objects(text: str):
    """The JSON objects of a model reply, in the order a reader trusts them: those inside
    code fences first, then every object in the whole text."""
    for cand in [m.group(1) for m in _FENCE.finditer(text)] + [text]:
        yield from _json_objects(cand)


def parse_choice(raw: str | None) -> tuple[str | None, str | None]:
    """("1"|"2", reasoning) from a model reply, or (None, None) if no answer is readable."""
    if not raw or not raw.strip():
        return None, None
    text = raw.strip()
    for obj in reply_json_objects(text):
        lowered = {str(k).lower(): v for k, v in obj.items()}
        choice = _choice_value(lowered.get("chosen_answer"))
        if choice:
            reasoning = lowered.get("reasoning")
            return choice, reasoning if isinstance(reasoning, str) else None
    m = _CHOSEN.search(text)  # broken JSON that still names the answer
    if m:
        r = _REASONING.search(text[m.end() :])
        return m.group(1), (r.group(1).strip() if r else None)
    m = _BARE.match(text)
    if m:
        return m.group(1), None
    return None, None
