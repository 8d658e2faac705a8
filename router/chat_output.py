"""How a chat choice's generated text becomes the assistant's message: its reasoning set apart
(router/reasoning.py), then its tool calls parsed out of the rest (router/tool_parser.py and one
module per syntax); a harmony model's output (gpt-oss) all three at once by its channels
(router/harmony.py).

`ChatOutputShape` is decided once per request (router/app.py's chat endpoint: the template,
the prompt's end, the request's tools); each choice gets its own `ChoiceOutput`, fed its text as
it streams (`feed`, `finish`) or whole (`message`). A streamed choice's pieces add up to its
non-streamed message, as both run the same parsers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.array_calls import ArrayCallStream
from router.harmony import HarmonyStream
from router.hermes_calls import ToolCallStream
from router.llama3_calls import JsonCallStream
from router.pythonic_calls import PythonicCallStream
from router.reasoning import ReasoningStream
from router.tool_parser import extend_calls, merge_calls
from router.tools import GLM45, HARMONY, HERMES, PYTHONIC, CallSyntax, in_blocks, string_parameters


@dataclass(frozen=True)
class ChatOutputShape:
    """`tools`: the syntax tool calls are parsed in (None: no calls); `reasoning`: None (no
    split) or whether the output starts inside a <think> block; `include_reasoning` false drops
    the reasoning text (vLLM's); `parallel` false: at most one call (parallel_tool_calls);
    `harmony`: the output is in gpt-oss's harmony format (its own reasoning and calls);
    `string_args`: GLM-4.5's syntax, each function's string parameters (router/tools.py)."""
    tools: CallSyntax | None = None
    reasoning: bool | None = None
    include_reasoning: bool = True
    parallel: bool = True
    harmony: bool = False
    string_args: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def of(cls, body, syntax: CallSyntax, reasoning: bool | None) -> ChatOutputShape:
        """A chat request's (router/chat_protocol.py ChatCompletionRequest): `syntax`, the template's
        call syntax; `reasoning`, where its output starts (None: no <think> split)."""
        tools = syntax if body.parses_tool_calls else None
        glm = tools is not None and tools.name == GLM45.name
        return cls(tools, reasoning, body.include_reasoning, body.parallel_tool_calls, syntax.name == HARMONY.name,
                   string_parameters(body.tools) if glm else ())

    @property
    def plain(self) -> bool:
        return not self.tools and self.reasoning is None and not self.harmony

    @property
    def may_end_early(self) -> bool:
        """Whether a choice may be complete before its output ends (`ChoiceOutput.done`; harmony's
        single call ends the output itself, an EOS)."""
        return self.tools is not None and not in_blocks(self.tools) and not self.parallel and not self.harmony

    def choice(self) -> ChoiceOutput:
        return ChoiceOutput(self)


@dataclass
class Piece:
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)   # call deltas, each with its call's stream `index`

    def __iadd__(self, other: Piece) -> Piece:
        self.reasoning += other.reasoning
        self.content += other.content
        extend_calls(self.calls, other.calls)
        return self


class ChoiceOutput:
    def __init__(self, shape: ChatOutputShape):
        self.shape = shape
        self._reasoning = None if shape.reasoning is None else ReasoningStream(shape.reasoning)
        self._tools = None
        self._harmony = None
        if shape.harmony:
            self._harmony = HarmonyStream(shape.tools is not None, (shape.tools or HERMES).new_id)
        elif in_blocks(shape.tools):     # parallel_tool_calls false ends the output at the first call (a stop)
            self._tools = ToolCallStream(dict(shape.string_args) if shape.tools.name == GLM45.name else None)
        elif shape.tools is not None and shape.tools.name == PYTHONIC.name:
            self._tools = PythonicCallStream(shape.tools.new_id, first_only=not shape.parallel)
        elif shape.tools is not None and shape.tools.marker:          # Mistral's, Granite's
            self._tools = ArrayCallStream(shape.tools, first_only=not shape.parallel)
        elif shape.tools is not None:
            self._tools = JsonCallStream(first_only=not shape.parallel)

    @property
    def done(self) -> bool:
        """Whether the output needs no more text: its one call is complete (parallel_tool_calls
        false; router/reply.py then stops the choice)."""
        return self._tools is not None and self._tools.done

    @property
    def num_calls(self) -> int:
        stream = self._harmony or self._tools
        return 0 if stream is None else stream.count

    def feed(self, text: str) -> Piece:
        """What is certain after `text` arrives."""
        if self._harmony is not None:
            return self._harmony_piece(*self._harmony.feed(text))
        reasoning, content = ("", text) if self._reasoning is None else self._reasoning.feed(text)
        return self._piece(reasoning, content, final=False)

    def finish(self) -> Piece:
        """What was held back; the output has ended."""
        if self._harmony is not None:
            return self._harmony_piece(*self._harmony.finish())
        reasoning, content = ("", "") if self._reasoning is None else self._reasoning.finish()
        return self._piece(reasoning, content, final=True)

    def _harmony_piece(self, reasoning: str, content: str, calls: list[dict]) -> Piece:
        return Piece(reasoning if self.shape.include_reasoning else "", content, calls)

    def _piece(self, reasoning: str, content: str, final: bool) -> Piece:
        piece = Piece(reasoning if self.shape.include_reasoning else "")
        if self._tools is None:
            piece.content = content
            return piece
        piece.content, piece.calls = self._tools.feed(content)
        if final:
            more, calls = self._tools.finish()
            piece.content += more
            extend_calls(piece.calls, calls)
        return piece

    def finish_reason(self, finish: str | None) -> str | None:
        """A stop after calls is "tool_calls"."""
        return "tool_calls" if finish == "stop" and self.num_calls else finish

    def message(self, text: str) -> tuple[str | None, str | None, list[dict] | None]:
        """A whole output's (reasoning, content, tool calls): reasoning None when there is none
        (or include_reasoning is false), calls None without tools; content None when calls are all."""
        whole = self.feed(text)
        whole += self.finish()
        calls = merge_calls(whole.calls) if self._tools or (self._harmony and self.shape.tools) else None
        reasoning = whole.reasoning or None
        return reasoning, (whole.content or None) if calls else whole.content, calls
