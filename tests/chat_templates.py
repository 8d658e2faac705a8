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


def tokenizer_with(default_model_dir, d, template: str):
    """The default model's tokenizer with another chat template."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, d / name)
    (d / "chat_template.jinja").write_text(template)
    return AutoTokenizer.from_pretrained(d)
