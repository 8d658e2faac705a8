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

# IBM Granite 3.2's way (its template as granite-io quotes it, without the date, documents and
# controls): the tools as indented JSON in a tools turn, the system text asking for <|tool_call|>
# and a JSON list; every turn written as its role and content only (no tool_calls)
GRANITE_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system_message = "Knowledge Cutoff Date: April 2024.\nYou are Granite, developed by IBM." %}
{%- if tools %}
{%- set system_message = system_message + " You are a helpful AI assistant with access to the following tools. \
When a tool is required to answer the user's query, respond with <|tool_call|> followed by a JSON list of tools \
used. If a tool does not exist in the provided list of tools, notify the user that you do not have the ability \
to fulfill the request." %}
{%- else %}
{%- set system_message = system_message + " You are a helpful AI assistant." %}
{%- endif %}
{%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\n' }}
{%- if tools %}
{{- '<|start_of_role|>tools<|end_of_role|>' }}{{- tools | tojson(indent=4) }}{{- '<|end_of_text|>\n' }}
{%- endif %}
{%- for message in loop_messages %}
{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}
{%- if loop.last and add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}
{%- endfor %}"""
GRANITE_TOKENS = ["<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>", "<|end_of_text|>"]


# vLLM's pythonic template for Gemma 3 (examples/tool_chat_template_gemma3_pythonic.jinja, shortened):
# the tools as JSON in the first user turn, asking for a Python list of calls; a turn's calls
# written as [name(key=<JSON value>, ...)]; tool results in a user turn
PYTHONIC_TEMPLATE = """{{ bos_token }}
{%- for message in messages -%}
{%- set role = "model" if message.role == "assistant" else ("user" if message.role == "tool" else message.role) -%}
{{ '<start_of_turn>' + role + '\n' -}}
{%- if loop.first and tools is defined and tools is not none -%}
{{- "Tools (functions) are available. If you decide to invoke one or more of the tools, you must respond with a \
python list of the function calls.\n" -}}
{{- "Example Format: [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)] \n" -}}
{{- tools | tojson(indent=4) -}}{{- "\n\n" -}}
{%- endif -%}
{%- if 'tool_calls' in message -%}
{{- '[' -}}
{%- for tool_call in message.tool_calls -%}
{%- set tool_call = tool_call.function -%}
{{- tool_call.name + '(' -}}
{%- for key, val in tool_call.arguments.items() -%}{{ key }}={{ val | tojson }}{%- if not loop.last %}, {% endif -%}
{%- endfor -%}
{{- ')' -}}{%- if not loop.last -%}, {% endif -%}
{%- endfor -%}
{{- ']' -}}
{%- endif -%}
{%- if message.role == 'tool' -%}{{ '<tool_response>\n' -}}{%- endif -%}
{{ (message.content or '') | trim }}
{%- if message.role == 'tool' -%}{{ '</tool_response>' -}}{%- endif -%}
{{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"""


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

# GLM-4.5's template in outline (zai-org's chat_template.jinja: the tools in the system turn with its
# instruction for the key / value syntax; a turn's calls as <tool_call> blocks, a string value as its
# text, any other as JSON; tool results as <tool_response> blocks)
GLM45_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}<|system|>
# Tools

You may call one or more functions to assist with the user query.
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
...
</tool_call>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}<|assistant|>
{%- if m.content %}
{{ m.content }}{% endif -%}
{%- for tc in m.tool_calls or [] %}
<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{% endfor %}</tool_call>{% endfor -%}
{%- elif m.role == 'tool' -%}<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- else -%}<|{{ m.role }}|>
{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"""
