"""Chat templates in the tool-call formats of four model families, for tiny test models: Hermes /
Qwen2.5 (<tool_call> JSON), Llama 3.1 (JSON with "parameters"), Llama 3.2 (pythonic calls) and
Mistral ([TOOL_CALLS] list). Written after those families' published templates, trimmed to the
parts that render tools, calls and tool results."""

HERMES = """{%- if tools %}<|im_start|>system
You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tc in message.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3_JSON = """<|begin_of_text|>{%- for message in messages %}
{%- if message.role == "user" and loop.last and tools %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.

{% for tool in tools %}{{ tool | tojson(indent=4) }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.role == "assistant" and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

PYTHONIC = """<|begin_of_text|>{%- if tools %}<|start_header_id|>system<|end_header_id|>

You are an expert in composing functions. Given a question and a set of possible functions, make one or more function calls to achieve the purpose.
If you decide to invoke any of the function(s), you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]
You SHOULD NOT include any other text in the response if you call a function.
Here is a list of functions in JSON format that you can invoke.

[{% for tool in tools %}{{ tool | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

[{% for tc in message.tool_calls %}{{ tc.function.name }}({% for k, v in tc.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """<s>{%- for message in messages %}
{%- if message.role == "user" %}{% if loop.last and tools %}[AVAILABLE_TOOLS][{% for tool in tools %}{{ tool | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}][/AVAILABLE_TOOLS]{% endif %}[INST]{{ message.content }}[/INST]
{%- elif message.role == "assistant" and message.tool_calls %}[TOOL_CALLS][{% for tc in message.tool_calls %}{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]</s>
{%- elif message.role == "tool" %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}}[/TOOL_RESULTS]
{%- elif message.role == "assistant" %}{{ message.content }}</s>
{%- else %}{{ message.content }}
{%- endif %}{% endfor %}"""

TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA3_JSON, "pythonic": PYTHONIC, "mistral": MISTRAL}
