"""A tiny model that acts like an agent's model, for the agents' own clients: given a tool
it knows, it calls that tool with fixed arguments; once a tool result is in the
conversation it answers with a fixed text; with no tool it knows, it answers at once.

Agents such as Claude Code and Codex send their requests themselves, with `tool_choice`
auto and no way to add a grammar, so a random-weight model would never call their tools
(or would call them forever). This one does what a real model does in their loop, and
deterministically, with margins no BLAS can flip:

- its chat template ends the prompt with a marker token that says what comes next:
  `<|script:NAME|>` when the request offers tool NAME from SCRIPTS and no tool result is
  in the conversation yet, `<|script|>` otherwise; with thinking on (Claude Code asks for
  it on every turn), the template opens `<think>` and the markers are
  `<|script-think:NAME|>` and `<|script-think|>`;
- the network is a bigram table: every layer's output projections (attention's o_proj,
  the MLP's down_proj) are zero, so the last hidden state is the current token's
  embedding; the script's tokens have one-hot embeddings, and the untied lm_head maps
  each to its successor with a logit of 32 against exactly 0 for every other token:
  marker -> the whole tool call (one added token) -> `<|im_end|>`, and
  `<|script|>` -> ANSWER (one added token) -> `<|im_end|>`; a thinking marker's
  successor is one token that holds `</think>` and then the same call or answer (the
  server splits the output's text at the markers). The thought is empty: under a
  thinking budget (Claude Code's requests have one) the server's grammar refuses the end
  marker after any thought text (tests/test_thought_end.py), and lets a token run on
  from the end marker into the answer.

The tool call is written in the json_tools format of tests/agent_model.py (mlx-lm infers
that parser from the template), so the server parses it as any model's call.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.agent_model import AGENT_TOKENS, agent_template

# tool name -> the arguments the model calls it with
SCRIPTS = {
    "Bash": {"command": "echo radix-mlx-tool-ran", "description": "Print a word"},  # Claude Code
    "exec_command": {"cmd": "echo radix-mlx-tool-ran"},  # Codex
    "get_weather": {"city": "Paris"},  # the Python clients' tests
}
ANSWER = "The tool ran: all done."
_GENERATION_PROMPT = (
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% else %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
# in place of the agent template's generation prompt
_SCRIPTED_PROMPT = (
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% set think = enable_thinking is defined and enable_thinking %}"
    "{% if think %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}"
    "{% set ns = namespace(call='', answered=false) %}"
    "{% for m in messages %}{% if m.role == 'tool' %}{% set ns.answered = true %}{% endif %}"
    "{% endfor %}"
    "{% for t in tools or [] %}{% set f = t.function if t.function is defined else t %}"
    "{% if f.name in @NAMES@ and not ns.call %}{% set ns.call = f.name %}{% endif %}{% endfor %}"
    "{% set kind = 'script-think' if think else 'script' %}"
    "{% if ns.call and not ns.answered %}<|{{ kind }}:{{ ns.call }}|>{% else %}<|{{ kind }}|>"
    "{% endif %}"
    "{% endif %}"
)


def tool_call_text(name: str) -> str:
    """What the model writes to call tool `name` (one token of its vocabulary)."""
    call = {"name": name, "arguments": SCRIPTS[name]}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def scripted_template() -> str:
    template = agent_template()
    assert template.endswith(_GENERATION_PROMPT)
    names = json.dumps(list(SCRIPTS))
    return template[: -len(_GENERATION_PROMPT)] + _SCRIPTED_PROMPT.replace("@NAMES@", names)


def _chain() -> list[tuple[str, str]]:
    """(token, its successor) pairs of the script, as token contents."""
    outputs = {"": ANSWER} | {f":{name}": tool_call_text(name) for name in SCRIPTS}
    pairs = []
    for key, text in outputs.items():
        closed = f"</think>{text}"
        pairs += [(f"<|script{key}|>", text), (text, "<|im_end|>")]
        pairs += [(f"<|script-think{key}|>", closed), (closed, "<|im_end|>")]
    return pairs


def build_scripted_agent_model(tiny_model: str, out_dir: Path) -> str:
    """The tiny Qwen3 model turned into the scripted agent (built once per directory)."""
    import mlx.core as mx

    script = json.dumps({"template": scripted_template(), "chain": _chain()})
    if (out_dir / "script.json").exists():
        if (out_dir / "script.json").read_text() == script:
            return str(out_dir)
        shutil.rmtree(out_dir)  # built from an older script
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tiny_model, tmp)
    pairs = _chain()
    markers = [t for t, _ in pairs if t.startswith("<|script")]
    ids = _add_tokens(tmp, AGENT_TOKENS + markers + [s for _, s in pairs if s != "<|im_end|>"])
    config_path = tmp / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = scripted_template()
    config_path.write_text(json.dumps(config))
    ids["<|im_end|>"] = _token_id(tmp, "<|im_end|>")

    weights = mx.load(str(tmp / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    hidden = embed.shape[1]
    extra = 0.02 * mx.random.normal((len(ids), hidden), key=mx.random.key(11))
    embed = mx.concatenate([embed, extra.astype(embed.dtype)])
    head = mx.array(embed)  # untied: the same random rows, then the script's columns
    sources = [t for t, _ in pairs]
    assert len(sources) <= hidden
    for dim, (token, successor) in enumerate(pairs):
        one_hot = mx.zeros((hidden,), embed.dtype).at[dim].add(1.0)
        embed[ids[token]] = one_hot
        head[:, dim] = 0.0
        head[ids[successor], dim] = 4.0  # x RMSNorm's sqrt(hidden) = 8: a logit of 32
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(weights[name])
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(tmp / "model.safetensors"), weights)
    model_config = json.loads((tmp / "config.json").read_text())
    model_config |= {"vocab_size": embed.shape[0], "tie_word_embeddings": False}
    (tmp / "config.json").write_text(json.dumps(model_config, indent=2))
    (tmp / "script.json").write_text(script)
    tmp.rename(out_dir)
    return str(out_dir)


def _token_id(model_dir: Path, content: str) -> int:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    for t in tok["added_tokens"]:
        if t["content"] == content:
            return t["id"]
    return tok["model"]["vocab"][content]


def _add_tokens(model_dir: Path, contents: list[str]) -> dict[str, int]:
    """Append `contents` to the tokenizer's added tokens; their ids."""
    path = model_dir / "tokenizer.json"
    tok = json.loads(path.read_text())
    first = 1 + max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])])
    ids = {}
    for i, content in enumerate(contents):
        ids[content] = first + i
        tok["added_tokens"].append({
            "id": first + i, "content": content, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": False,
        })  # fmt: skip
    path.write_text(json.dumps(tok))
    return ids
