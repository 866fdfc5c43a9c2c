"""`--chat-template FILE` and `--tool-call-parser NAME`: what vLLM users set when a
model's own chat template or its detected tool format is not the one they want.

Both are checked before anything starts (a missing or unparsable template, an unknown
parser: one line, exit 2) and applied to the router's tokenizer, the one place chats are
rendered: the template replaces the tokenizer's, so it also drives mlx-lm's detection of
the thinking switch and the tool format; the parser is set as the tokenizer config's
`tool_parser_type`, where mlx-lm looks first (router.api.chat_format.ChatFormat.of).
"""

from __future__ import annotations

from router.api.chat_format import tool_parser_names


def read_chat_template(path: str) -> str:
    """The template's text, compiled once to check it; ValueError (one line) if it cannot
    be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"--chat-template {path}: cannot read it: {reason}") from None
    try:
        _compile(text)
    except Exception as exc:  # jinja's TemplateSyntaxError and the like
        where = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--chat-template {path}: not a Jinja template{where}: {first}") from None
    return text


def _compile(text: str) -> None:
    """Compile as transformers renders chat templates (its sandbox and extensions)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # its private helper moved: plain jinja in the same sandbox
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        return
    _compile_jinja_template(text)


def check_tool_parser(name: str) -> None:
    """ValueError (one line, listing the choices) for a name no parser has."""
    choices = tool_parser_names()
    if name not in choices:
        raise ValueError(
            f"--tool-call-parser {name!r} is unknown; choose one of: {', '.join(choices)}"
        )


def chat_overrides(args) -> str | None:
    """The template text of --chat-template (None without it), both flags checked;
    ValueError naming the flag at fault."""
    if args.tool_call_parser is not None:
        check_tool_parser(args.tool_call_parser)
    return read_chat_template(args.chat_template) if args.chat_template else None


def apply_chat_overrides(tokenizer, args, template: str | None) -> None:
    """Give the router's tokenizer the template and the tool parser the flags name."""
    if template is not None:
        tokenizer.chat_template = template
    if args.tool_call_parser is not None:
        tokenizer.init_kwargs["tool_parser_type"] = args.tool_call_parser
