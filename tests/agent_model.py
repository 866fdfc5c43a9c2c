"""A copy of the tiny model that thinks and calls tools: four tokens added to its
vocabulary (`<think>`, `</think>`, `<tool_call>`, `</tool_call>`, with embedding rows of
their own) and a Qwen3-style chat template with tools and `enable_thinking`.

Built in the tests rather than by common/tiny_model.py so the default model stays as it is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

AGENT_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

# Qwen3's template, cut to what the tests use (a system message after the first renders as a
# system turn at its position, as in Qwen3's), with the tool calls written in one of
# mlx-lm's tool formats: mlx-lm infers the parser from the template's markers (json_tools
# from `<tool_call>` and `tool_call.name`) and the thinking markers from the vocabulary.
_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Call a function as @HINT@<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{% for tool_call in message.tool_calls or [] %}"
    "{% if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    "@CALL@{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n"
    "{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
_ARGS = "{{ tool_call.arguments | tojson }}"
_VALUE = "{{ v if v is string else v | tojson }}"
_EACH = "{% for k, v in tool_call.arguments.items() %}"
# tool format -> (how the system prompt shows a call, how the history writes one)
FORMATS = {
    "json_tools": (
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
        '\n<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": ' + _ARGS + "}\n</tool_call>",
    ),
    "mistral": ("[TOOL_CALLS]name[ARGS]{...}", "[TOOL_CALLS]{{ tool_call.name }}[ARGS]" + _ARGS),
    "kimi_k2": (
        "<|tool_calls_section_begin|>...",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.{{ tool_call.name }}:0"
        "<|tool_call_argument_begin|>" + _ARGS + "<|tool_call_end|><|tool_calls_section_end|>",
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=name>...",
        "<tool_call>\n<function={{ tool_call.name }}>\n" + _EACH + "<parameter={{ k }}>\n"
        + _VALUE + "\n</parameter>\n{% endfor %}</function>\n</tool_call>",
    ),
    "glm47": (
        "<tool_call>name<arg_key>...",
        "<tool_call>{{ tool_call.name }}" + _EACH + "<arg_key>{{ k }}</arg_key><arg_value>"
        + _VALUE + "</arg_value>{% endfor %}</tool_call>",
    ),
    "longcat": (
        "<longcat_tool_call>...",
        "<longcat_tool_call>{{ tool_call.name }}" + _EACH + "<longcat_arg_key>{{ k }}"
        "</longcat_arg_key><longcat_arg_value>" + _VALUE
        + "</longcat_arg_value>{% endfor %}</longcat_tool_call>",
    ),
    "minimax_m2": (
        "<minimax:tool_call>...",
        '<minimax:tool_call>\n<invoke name="{{ tool_call.name }}">\n' + _EACH
        + '<parameter name="{{ k }}">' + _VALUE + "</parameter>\n{% endfor %}</invoke>\n"
        "</minimax:tool_call>",
    ),
    "minicpm5": (
        '<function name="fn"><param name="p">value</param></function>',
        '<function name="{{ tool_call.name }}">' + _EACH + '<param name="{{ k }}">' + _VALUE
        + "</param>{% endfor %}</function>",
    ),
    "muse_spark": (
        "<atem:function_calls>...",
        '<atem:function_calls><atem:invoke name="{{ tool_call.name }}">' + _EACH
        + '<atem:parameter name="{{ k }}">{{ v | tojson }}</atem:parameter>{% endfor %}'
        "</atem:invoke></atem:function_calls>",
    ),
    "pythonic": (
        "<|tool_call_start|>[name(arg=value)]<|tool_call_end|>",
        "<|tool_call_start|>[{{ tool_call.name }}(" + _EACH + "{{ k }}={{ v | tojson }}"
        "{% if not loop.last %}, {% endif %}{% endfor %})]<|tool_call_end|>",
    ),
    "kimi_k3": (  # chosen by its vocabulary (tests add the XTML tokens), not the template
        "<|open|>tools<|sep|>...",
        '<|open|>tools<|sep|><|open|>call tool="{{ tool_call.name }}" index="1"<|sep|>'
        '<|open|>json type="object"<|sep|>' + _ARGS + "<|close|>json<|sep|><|close|>call<|sep|>"
        "<|close|>tools<|sep|>",
    ),
    "gemma4": (
        "<|tool_call>call:name{key:value}<tool_call|>",
        "<|tool_call>call:{{ tool_call.name }}{{ '{' }}" + _EACH + "{{ k }}:"
        '{% if v is string %}<|"|>{{ v }}<|"|>{% else %}{{ v | tojson }}{% endif %}'
        "{% if not loop.last %},{% endif %}{% endfor %}{{ '}' }}<tool_call|>",
    ),
    "function_gemma": (
        "<start_function_call>call:name{...}<end_function_call>",
        "<start_function_call>call:{{ tool_call.name }}{{ '{' }}" + _EACH + "{{ k }}:"
        "{% if v is string %}<escape>{{ v }}<escape>{% else %}{{ v | tojson }}{% endif %}"
        "{% if not loop.last %},{% endif %}{% endfor %}{{ '}' }}<end_function_call>",
    ),
}  # fmt: skip


def agent_template(tool_format: str = "json_tools") -> str:
    hint, call = FORMATS[tool_format]
    return _TEMPLATE.replace("@HINT@", hint).replace("@CALL@", call)


AGENT_TEMPLATE = agent_template()


def build_agent_model(tiny_model: str, out_dir: Path, tool_format: str = "json_tools") -> str:
    import mlx.core as mx

    config_path = out_dir / "tokenizer_config.json"
    if (out_dir / "config.json").exists():  # built before: its template may be older
        config = json.loads(config_path.read_text())
        if config["chat_template"] != agent_template(tool_format):
            config["chat_template"] = agent_template(tool_format)
            config_path.write_text(json.dumps(config))
        return str(out_dir)
    shutil.copytree(tiny_model, out_dir)
    tok = json.loads((out_dir / "tokenizer.json").read_text())
    first = 1 + max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])])
    for i, content in enumerate(AGENT_TOKENS):
        tok["added_tokens"].append({
            "id": first + i, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": False,
        })  # fmt: skip
    (out_dir / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads(config_path.read_text())
    config["chat_template"] = agent_template(tool_format)
    config_path.write_text(json.dumps(config))
    model_config = json.loads((out_dir / "config.json").read_text())
    weights = mx.load(str(out_dir / "model.safetensors"))
    name = "model.embed_tokens.weight"
    extra = mx.random.normal((len(AGENT_TOKENS), weights[name].shape[1]), key=mx.random.key(7))
    weights[name] = mx.concatenate([weights[name], 0.02 * extra.astype(weights[name].dtype)])
    assert model_config["vocab_size"] == first and model_config.get("tie_word_embeddings")
    model_config["vocab_size"] = first + len(AGENT_TOKENS)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights)
    (out_dir / "config.json").write_text(json.dumps(model_config, indent=2))
    return str(out_dir)
