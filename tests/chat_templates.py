"""Chat templates the tests give the default model's tokenizer (each written for the tests, after
the model family it names)."""

import shutil

from transformers import AutoTokenizer

# Llama 3.1-3.3's way: tools in the system turn, a call as the whole assistant turn with
# "parameters", results in an ipython turn, one call per turn
LLAMA3_TEMPLATE = """{{- bos_token }}<|start_header_id|>system<|end_header_id|>

{%- if tools %}
Environment: ipython
Call a function by answering {"name": function name, "parameters": its arguments} only.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{%- endif %}<|eot_id|>
{%- for message in messages %}
{%- if message.tool_calls %}
{%- if message.tool_calls | length != 1 %}{{ raise_exception("one call per turn") }}{% endif %}
{%- set call = message.tool_calls[0].function %}<|start_header_id|>assistant<|end_header_id|>

{{ '{"name": "' + call.name + '", "parameters": ' }}{{ call.arguments | tojson }}}<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


# Mistral 7B-Instruct v0.3's way (its template, shortened): the tools before the last user turn,
# calls as [TOOL_CALLS] and a JSON array, results as [TOOL_RESULTS]; call ids of 9 characters only
MISTRAL_TEMPLATE = """{{- bos_token }}
{%- set user_messages = messages | selectattr("role", "equalto", "user") | list %}
{%- for message in messages %}
{%- if message.role == "user" %}
{%- if tools and message == user_messages[-1] %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
{{- "[INST] " + message.content + "[/INST]" }}
{%- elif message.tool_calls %}
{{- message.content or "" }}[TOOL_CALLS] [
{%- for tool_call in message.tool_calls %}
{%- if tool_call.id | length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{{- (tool_call.function | tojson)[:-1] + ', "id": "' + tool_call.id + '"}' }}{{ ", " if not loop.last else "]" + eos_token }}
{%- endfor %}
{%- elif message.role == "tool" %}
{%- if message.tool_call_id | length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{{- '[TOOL_RESULTS] {"content": ' + message.content | string + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- else %}
{{- " " + message.content + eos_token }}
{%- endif %}
{%- endfor %}"""
MISTRAL_TOKENS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                  "[/TOOL_RESULTS]"]


def tokenizer_with(default_model_dir, d, template: str, special_tokens: list[str] = ()):
    """The default model's tokenizer with another chat template (and `special_tokens` added, as
    single special tokens)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, d / name)
    (d / "chat_template.jinja").write_text(template)
    tokenizer = AutoTokenizer.from_pretrained(d)
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
        tokenizer.save_pretrained(d)
        tokenizer = AutoTokenizer.from_pretrained(d)
    return tokenizer
