"""vLLM's /tokenize and /detokenize request models (router/app.py serves them)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, model_validator

from router.chat_protocol import ChatCompletionRequest, ChatMessage, Documents
from router.protocol_types import MODEL_FIELD, REASONING_EFFORT, Int, Strict, Text, present
from router.tools import MAX_TOOLS, Tool, ToolChoice

CHAT_PROMPT_FIELDS = ("messages", "tools", "tool_choice", "add_generation_prompt", "continue_final_message",
                      "chat_template_kwargs", "reasoning_effort", "documents")


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a completion's `prompt`, or a chat's `messages` (with the chat fields that
    shape its prompt, under the chat endpoint's rules), as the token ids the engine would get."""
    model_config = ConfigDict(json_schema_extra={"oneOf": [present("prompt"), present("messages")], "if": present(
        "prompt"), "then": {"not": {"anyOf": [{"required": [name]} for name in CHAT_PROMPT_FIELDS[1:]]}}})
    model: str | None = Field(None, description=MODEL_FIELD)
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: REASONING_EFFORT | None = None
    documents: Documents | None = None
    add_special_tokens: bool | None = Field(None, description="vLLM's: the tokenizer's special tokens (e.g. a BOS) "
                                            "added; default: true for a prompt, false for messages (as the "
                                            "completion and chat endpoints do).")
    return_token_strs: bool = Field(False, description="Also each token's text (the tokenizer's piece).")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.prompt is not None and self.model_fields_set & set(CHAT_PROMPT_FIELDS[1:]):
            raise ValueError(f"{', '.join(sorted(self.model_fields_set & set(CHAT_PROMPT_FIELDS[1:])))} "
                             "go with messages")
        return self

    def chat(self, model: str) -> ChatCompletionRequest:
        """The chat request whose prompt this is; a ValueError (pydantic's) where the chat rules refuse it."""
        fields = self.model_dump(include={*CHAT_PROMPT_FIELDS, "add_special_tokens"}, exclude_unset=True,
                                 exclude_none=True, by_alias=True)
        return ChatCompletionRequest.model_validate({"model": model, **fields})


class DetokenizeRequest(Strict):
    """vLLM's /detokenize: token ids back to text (special tokens included)."""
    model: str | None = Field(None, description=MODEL_FIELD)
    tokens: list[Int(ge=0)] = Field(max_length=1_000_000)
