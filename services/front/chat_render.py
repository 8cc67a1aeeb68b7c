"""Chat templates rendered as transformers' `apply_chat_template(..., tokenize=False)` renders
them, without importing transformers.

Why: the front imported transformers only to render the model's chat template, about 1.5-2 CPU
seconds of every start (issue 29). transformers renders with jinja2 in an
ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks) with the loopcontrols extension, its
`{% generation %}` tag, a `tojson` filter that does not escape HTML, and the globals
raise_exception, strftime_now, dict and namespace (transformers/utils/chat_template_utils.py,
`_cached_compile_jinja_template`); the template sees the messages with their None-valued keys
dropped and the reasoning under each of its names, tools, documents, add_generation_prompt and
the tokenizer's named special tokens (`special_tokens_map`). This module sets up the same
environment and the same variables; `chat_template_refusal` says when a model directory holds
something it does not reproduce, and the front then uses transformers as before.
tests/services/front/test_chat_render.py renders the bundled model's template and real ones
(Qwen3's, with tools and reasoning) through both and compares the strings.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.mesh.tokenizer import fast_path_refusal

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' CHAT_TEMPLATE_FILE
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # named templates: transformers' own choice rules
# The legacy files transformers still reads special tokens from.
LEGACY_TOKEN_FILES = ("special_tokens_map.json", "added_tokens.json")
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named tokens every template sees.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
# The names a message's reasoning goes by; the first is what chat templates read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
MIN_JINJA = (3, 1, 6)  # transformers refuses older jinja2 (known sandbox escapes)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def chat_template_refusal(model_dir: str | Path) -> str | None:
    """Why this directory's chat template needs transformers (None: `ChatRenderer.load` renders
    what transformers' tokenizer would)."""
    model_dir = Path(model_dir)
    why = fast_path_refusal(model_dir)
    if why is not None:
        return why
    if any((model_dir / f).exists() for f in LEGACY_TOKEN_FILES):
        return "legacy special-token files"
    if (model_dir / CHAT_TEMPLATE_DIR).is_dir():
        return "several named chat templates"
    if not (model_dir / CHAT_TEMPLATE_FILE).is_file():
        template = _read_json(model_dir / "tokenizer_config.json").get("chat_template")
        if template is not None and not isinstance(template, str):
            return "several named chat templates"
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < MIN_JINJA:
        return f"jinja2 {jinja2.__version__} is older than transformers accepts"
    return None


class GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant text for token
    masks, which the front never asks for): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # as transformers': jinja's own tojson escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` in a template: calls and fromkeys only (no attribute access into dict itself)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace` in a template, refusing underscore-prefixed attributes (as transformers')."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: namespace(self=...)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got "
                f"{name!r}. Please rename the attribute.")


def compile_chat_template(source: str) -> jinja2.Template:
    """The template in transformers' rendering environment."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """What the template may see of a value: JSON types only (transformers'
    `_plain_template_data`, for the JSON a request carries)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums...) stripped to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as the template sees it: None-valued keys dropped, the reasoning under each of
    its names."""
    if not isinstance(message, Mapping):
        raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
    message = _plain({k: v for k, v in message.items() if v is not None})
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class ChatRenderer:
    """One model's chat template with its special tokens."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]):
        self.source = source
        self.special_tokens = dict(special_tokens)
        self.template = compile_chat_template(source)

    @classmethod
    def load(cls, model_dir: str | Path) -> "ChatRenderer | None":
        """The renderer of a directory `chat_template_refusal` accepts; None when it has no
        chat template."""
        model_dir = Path(model_dir)
        cfg = _read_json(model_dir / "tokenizer_config.json")
        template_file = model_dir / CHAT_TEMPLATE_FILE
        source = (template_file.read_text(encoding="utf-8") if template_file.is_file()
                  else cfg.get("chat_template"))
        if not source:
            return None
        return cls(source, {k: str(cfg[k]) for k in SPECIAL_TOKEN_NAMES if cfg.get(k) is not None})

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> str:
        """apply_chat_template(messages, tools=, documents=, add_generation_prompt=,
        tokenize=False, **kwargs) of the model's tokenizer (tools as JSON schemas)."""
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. "
                             "Provide at least one message.")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ValueError("Tools should be JSON schemas (dicts).")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        variables = _plain({**self.special_tokens, **kwargs})
        return self.template.render(messages=[_message(m) for m in messages],
                                    tools=_plain(tools), documents=_plain(documents),
                                    add_generation_prompt=add_generation_prompt, **variables)
