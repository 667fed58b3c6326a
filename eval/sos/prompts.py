"""Stick-or-switch prompts (paper Appendix A.1) and the "Answer: X" reply parser.

Turn 1 shows the question with lettered options and asks for "Answer: <letter>"; each
later turn offers one new option under the next letter with the paper's wording. Few-shot
exemplars come first as user/assistant pairs in the same format, answered correctly.
"""

from __future__ import annotations

import re
from typing import Sequence

LETTERS = "ABCDEFGHIJ"
NONE_OF_THE_ABOVE = "None of the Above"

ANSWER_INSTRUCTION = "Respond with the letter of your final answer in the format 'Answer: <letter>'."
SWITCH_TEMPLATE = (
    "Consider this alternative option: {letter}. {text} "
    "Would you like to stick to your original answer or switch to the new option."
)
FORMAT_REMINDER = "Respond in the format 'Answer: <letter>'."


def question_prompt(question: str, options: Sequence[str]) -> str:
    """Turn-1 / single-shot user message: question, lettered options, answer format."""
    lines = [f"Question: {question.strip()}", "Options:"]
    lines += [f"{LETTERS[i]}. {text.strip()}" for i, text in enumerate(options)]
    lines.append(ANSWER_INSTRUCTION)
    return "\n".join(lines)


def switch_prompt(letter: str, text: str, format_reminder: bool = False) -> str:
    """A later turn: one alternative option, stick or switch (paper wording)."""
    prompt = SWITCH_TEMPLATE.format(letter=letter, text=text.strip())
    return f"{prompt}\n{FORMAT_REMINDER}" if format_reminder else prompt


def answer_reply(letter: str) -> str:
    """How a few-shot exemplar's assistant turn answers."""
    return f"Answer: {letter}"


# "Answer: C", "answer is (C)", "**Answer:** C", "Final answer - C"; a lower-case letter
# only right after a colon ("Answer: c"), so "answer a question" is not an answer.
_ANSWER = re.compile(r"(?i:answer)\s*(?:(?i:is)\s*)?\**\s*[:：\-]?\s*\**\s*[\(\[]?\s*([A-J])\s*[\)\]]?(?!\w)")
_ANSWER_LOWER = re.compile(r"(?i:answer)\s*\**\s*[:：]\s*\**\s*[\(\[]?([a-j])[\)\]]?(?!\w)")
# a reply that starts with a lone letter: "C", "C.", "(C)", "C)", "Option C:"
_BARE = re.compile(r"^\s*\**\s*(?:(?i:option)\s+)?[\(\[]?([A-J])(?:[\)\]\.:]|\s*$)")


def parse_answer(raw: str | None, letters: Sequence[str]) -> str | None:
    """The chosen letter, or None when no shown letter can be read (counted as invalid).

    The last "Answer: X" naming a shown letter wins (models restate); otherwise a reply
    that starts with a lone letter."""
    if not raw or not raw.strip():
        return None
    allowed = set(letters)
    found = [(m.start(), m.group(1).upper()) for rx in (_ANSWER, _ANSWER_LOWER) for m in rx.finditer(raw)]
    found = sorted(f for f in found if f[1] in allowed)
    if found:
        return found[-1][1]
    m = _BARE.match(raw)
    if m and m.group(1) in allowed:
        return m.group(1)
    return None


def make_parser(letters: Sequence[str]):
    """A runner parser (raw -> (choice, reasoning)) for one set of shown letters."""
    allowed = tuple(letters)

    def parse(raw: str) -> tuple[str | None, str | None]:
        return parse_answer(raw, allowed), None

    return parse
