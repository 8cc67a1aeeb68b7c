"""Chat templates of the kinds real models ship, written for the renderer comparison
(test_chat_render.py): each uses a part of transformers' rendering environment."""

# Qwen3-style: a tools block through tojson, namespace and a reversed scan, reasoning_content,
# tool calls and tool responses, enable_thinking passed as a template variable.
QWEN3_STYLE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nFunction signatures in <tools></tools>:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
                {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Llama-3-style: bos_token, trim, raise_exception on a bad role order, {% generation %}, loop
# controls and dict().
LLAMA3_STYLE = """{{- bos_token }}
{%- set meta = dict(sep='<|eot_id|>', roles=['system', 'user', 'assistant', 'tool']) %}
{%- for message in messages %}
    {%- if message.role not in meta.roles %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
    {%- if message.role == 'ignore' %}{% continue %}{% endif %}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
    {%- if message.role == 'assistant' %}
        {%- generation %}{{- message.content | trim + meta.sep }}{%- endgeneration %}
    {%- else %}
        {{- message.content | trim + meta.sep }}
    {%- endif %}
    {%- if loop.index > 50 %}{% break %}{% endif %}
{%- endfor %}
{%- if documents %}
    {%- for doc in documents %}{{ '\\n[' ~ loop.index ~ '] ' ~ doc.title ~ ': ' ~ doc.text }}{%- endfor %}
{%- endif %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
{{- eos_token if add_eos is defined and add_eos else '' }}"""

# Plain, with the whitespace control trim_blocks / lstrip_blocks decide (no '-' markers).
PLAIN_BLOCKS = """{% for message in messages %}
    {% if message['role'] == 'system' %}
<<SYS>>{{ message['content'] }}<</SYS>>
    {% else %}
[{{ message['role'] | upper }}] {{ message['content'] }} {{ unk_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""

TEMPLATES = {"qwen3_style": QWEN3_STYLE, "llama3_style": LLAMA3_STYLE,
             "plain_blocks": PLAIN_BLOCKS}
