"""A model's reasoning kept apart from its answer (``--reasoning-parser think``).

Models such as DeepSeek-R1's distills and Qwen3 think in ``<think>...</think>`` before they
answer. The reasoning goes to ``reasoning_content``, the rest to ``content`` (which tool-call
parsing then reads). Many templates open the block in the generation prompt itself, so a reply
may start inside it: the parser is told whether the prompt ended in an open ``<think>``.
Like the tool-call parsers, ``split(text, final)`` reads a partial reply the same way as a whole
one and holds back a tail that may be the start of a tag, so a stream and a response agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.types import StructuredOutputs

START, END = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str | None  # None: the reply has no reasoning block
    content: str


def _without_partial(text: str, marker: str) -> str:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return text[:-k]
    return text


class ThinkParser:
    name = "think"

    def __init__(self, prompt_text: str) -> None:
        tail = prompt_text.rstrip()
        self.opened_in_prompt = tail.endswith(START)

    def split(self, text: str, final: bool) -> Split:
        if self.opened_in_prompt:
            body = text
        else:
            stripped = text.lstrip()
            if not stripped.startswith(START):
                if not final and START.startswith(stripped):
                    return Split(None, "")  # may still open a block
                return Split(None, text)
            body = stripped[len(START):]
        end = body.find(END)
        if end < 0:
            return Split(body if final else _without_partial(body, END), "")
        return Split(body[:end], body[end + len(END):].lstrip())

    def constrain(self, spec: StructuredOutputs) -> StructuredOutputs:
        """``spec`` for the answer only: a Lark grammar that lets the model think first."""
        if spec.json is not None or spec.json_object:
            schema = {"type": "object"} if spec.json_object else spec.json
            schema = json.loads(schema) if isinstance(schema, str) else schema
            answer = "%json " + json.dumps(schema)
        elif spec.regex is not None:
            answer = "/" + spec.regex.replace("/", "\\/") + "/"
        elif spec.choice is not None:
            answer = " | ".join(json.dumps(c) for c in spec.choice)
        else:
            raise ValueError("structured_outputs grammar cannot be combined with a reasoning parser; use json, "
                             "regex or choice")
        opening = "" if self.opened_in_prompt else f"{json.dumps(START)} "
        return StructuredOutputs(grammar=f'start: {opening}think /[ \\n]*/ answer\n'
                                         f'think[stop={json.dumps(END)}]: /(?s:.*)/\n'
                                         f'answer: {answer}')


class ReasoningStream:
    """A choice's stream: reasoning deltas as they come, and the content seen so far."""

    def __init__(self, parser: ThinkParser) -> None:
        self.parser = parser
        self.sent = 0

    def update(self, text: str, final: bool) -> tuple[str, str]:
        """(new reasoning text, all content so far)."""
        split = self.parser.split(text, final)
        reasoning = split.reasoning or ""
        new = reasoning[self.sent:]
        self.sent = max(self.sent, len(reasoning))
        return new, split.content


REASONING_PARSERS = {"think": ThinkParser}
