"""Reasoning in a chat choice's output: the text between <think> and </think>, which models
such as Qwen3, QwQ and DeepSeek-R1's distills write before their answer, comes back apart from
the content (as vLLM's `reasoning` field).

Where the reasoning starts is read from the prompt: a generation prompt that opens a <think>
block and leaves it open (DeepSeek-R1's distills, Qwen3's thinking-only models) makes the output
start inside the reasoning; otherwise it starts in the content, and a <think> tag at its very
beginning (after whitespace) opens the reasoning (Qwen3's hybrid models; with
`enable_thinking: false` their prompt closes an empty block, and the output is all content).
The reasoning ends at </think>; the whitespace after it is not content. An output cut short
inside its reasoning is all reasoning. A grammar (response_format, a forced tool call) applies
after the reasoning where the tags are single tokens (`grammar_think`); elsewhere from the
output's first token.

`ReasoningStream` serves streams and whole responses alike: `feed` each piece as it arrives,
`finish` at the end; it holds back only what could still be part of a tag.
"""

from __future__ import annotations

from router.chat_prompt import partial_tag, template_text

OPEN, CLOSE = "<think>", "</think>"


def reasoning_template(tokenizer) -> bool:
    """Whether the chat template knows <think> blocks (then chat outputs are split)."""
    text = template_text(tokenizer)
    return OPEN in text or CLOSE in text


def starts_inside(prompt_tail: str) -> bool:
    """Whether a prompt ending in `prompt_tail` (its last tokens' text) leaves a <think> open."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def think_tokens(tokenizer) -> tuple[int, int] | None:
    """The <think> and </think> tokens where each tag is one token (a reasoning model's vocabulary:
    Qwen3, QwQ, DeepSeek-R1's distills), else None."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (OPEN, CLOSE)]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def grammar_think(tokens: tuple[int, int] | None, prompt_tail: str) -> tuple[int, int, bool] | None:
    """`StructuredOutput.think` for a chat output (a grammar then starts after the reasoning, as
    the reasoning is read above): None where the tags are not single tokens, or where the prompt
    closed a <think> block (`enable_thinking: false`: the answer starts at once)."""
    if tokens is None or prompt_tail.rfind(CLOSE) > prompt_tail.rfind(OPEN):
        return None
    return (*tokens, starts_inside(prompt_tail))


class ReasoningStream:
    def __init__(self, inside: bool):
        self._state = "reasoning" if inside else "start"   # start -> reasoning -> after -> content
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) now certain."""
        self._held += text
        reasoning, content = "", ""
        while True:
            if self._state == "start":        # only the output's beginning may open reasoning
                stripped = self._held.lstrip()
                if stripped.startswith(OPEN):
                    self._state, self._held = "reasoning", stripped[len(OPEN):]
                    continue
                if OPEN.startswith(stripped):     # could still become the tag
                    return reasoning, content
                self._state = "content"
            if self._state == "reasoning":
                end = self._held.find(CLOSE)
                if end < 0:
                    keep = partial_tag(self._held, CLOSE)
                    reasoning += self._held[:len(self._held) - keep]
                    self._held = self._held[len(self._held) - keep:]
                    return reasoning, content
                reasoning += self._held[:end]
                self._state, self._held = "after", self._held[end + len(CLOSE):]
            if self._state == "after":            # the whitespace after </think> is not content
                self._held = self._held.lstrip()
                if not self._held:
                    return reasoning, content
                self._state = "content"
            content += self._held
            self._held = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held: a tag's beginning that never completed is text of where it stood."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        return "", "" if self._state == "after" else held
