"""A chat request's prompt: its messages (and tools, router/tools.py) through the model's chat
template, as token ids.

Beside OpenAI's fields, vLLM's extensions that shape the prompt (router/chat_protocol.py
validates them):
  - `add_generation_prompt` (default true): open the assistant's turn after the messages;
  - `continue_final_message`: leave the last message, an assistant's, open, so the output
    continues it (a prefilled answer); needs `add_generation_prompt: false`;
  - `chat_template_kwargs`: more variables for the template, such as Qwen3's `enable_thinking`;
    not the names of apply_chat_template's own arguments (RESERVED_TEMPLATE_KWARGS);
  - `documents`: the template's `documents` (retrieval-augmented generation);
  - `add_special_tokens` (default false): the templated text is tokenized with the tokenizer's
    special tokens (a BOS) on top of the template's own;
and OpenAI's `reasoning_effort` as the template variable of that name (gpt-oss's template reads
it; others ignore it), unless chat_template_kwargs sets it.
The template may refuse a conversation (a ValueError, or jinja's TemplateError from its
`raise_exception`): the caller answers a 400. Also here: the template's text (what tools and
reasoning support is read from) and `partial_tag`, which the output parsers of its tags share.
"""

from __future__ import annotations

# apply_chat_template's own parameters and what templates take from it
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                            "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
                            "truncation", "max_length", "return_tensors", "return_dict",
                            "return_assistant_tokens_mask", "tokenizer_kwargs")


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`: a tag of the template's (<think>,
    <tool_call>) that may still be arriving in a streamed output."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


def template_text(tokenizer) -> str:
    """The tokenizer's chat template(s) as one text (a dict of named templates joined)."""
    template = tokenizer.chat_template or ""
    return "\n".join(template.values()) if isinstance(template, dict) else template


def chat_prompt_ids(tokenizer, body, native_tools) -> list[int]:
    """The prompt of a ChatCompletionRequest `body`; `native_tools`: the syntax of a template that
    writes tool calls itself, or None (router/tools.py)."""
    conversation, tools = body.conversation(native_tools)
    variables = {"reasoning_effort": body.reasoning_effort} if body.reasoning_effort else {}
    text = tokenizer.apply_chat_template(conversation, tools=tools, documents=body.documents,
                                         add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message, tokenize=False,
                                         **(variables | (body.chat_template_kwargs or {})))
    return tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
