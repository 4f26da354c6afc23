"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked and resolved.

``auto`` offers the tools through the chat template and parses whatever calls the reply makes;
``none`` neither offers nor parses them; ``required`` and a named function also offer them, and
constrain the reply by the parser's grammar of a call to them (to the named one), so it always
parses. On a model whose chat template shows no tool-call format kvserve knows (and no
``--tool-call-parser``), ``auto`` is a 400, since nothing says how the model writes a call; forced
calls then take the ``json`` format, which their grammar alone makes the model write.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from kvserve.entrypoints.openai.errors import bad_request
from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from kvserve.entrypoints.openai.structured import Requested
from kvserve.entrypoints.openai.tool_parsers import ToolParser, make_parser, parser_for_template
from kvserve.types import StructuredOutputs


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolSetup:
    tools: list[dict]
    choice: str | NamedToolChoice
    parallel: bool
    parser: ToolParser | None

    @property
    def offered(self) -> bool:
        """The chat template shows the tools to the model."""
        return self.choice != "none"

    @property
    def parses(self) -> bool:
        return self.choice != "none" and self.parser is not None

    @staticmethod
    def of(req: ChatCompletionRequest, tokenizer, parser_name: str | None) -> ToolSetup | None:
        """None when the request has no tools (a tool_choice other than none then is a 400)."""
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if not req.tools:
            if choice != "none":
                raise bad_request("tool_choice needs tools", "tool_choice")
            return None
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        names = [t["function"]["name"] for t in tools]
        if len(set(names)) != len(names):
            raise bad_request("tools: function names must be unique", "tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                              "tool_choice")
        parser = None
        if choice != "none":
            name = parser_name or parser_for_template(getattr(tokenizer, "chat_template", None))
            if name is None and choice == "auto":
                raise bad_request("this model's chat template shows no tool-call format kvserve knows; start the "
                                  "server with --tool-call-parser to say which, or ask for tool_choice required "
                                  "or a named function", "tools")
            parser = make_parser(name or "json")
        return ToolSetup(tools, choice, req.parallel_tool_calls, parser)

    def forced_structure(self) -> Requested | None:
        """The grammar of ``required`` (any of the tools) or a named call; None for auto and none."""
        if self.choice == "required":
            grammar = self.parser.grammar(self.tools, self.parallel)
        elif isinstance(self.choice, NamedToolChoice):
            named = [t for t in self.tools if t["function"]["name"] == self.choice.function.name]
            grammar = self.parser.grammar(named, parallel=False)
        else:
            return None
        return Requested(StructuredOutputs(grammar=grammar), "tool_choice")
