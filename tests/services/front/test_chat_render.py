"""services.front.chat_render renders chat templates as transformers' apply_chat_template does,
and the front's ChatTemplate uses it (without transformers) where chat_template_refusal allows."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import jinja2
import pytest

from common.mesh.tokenizer import load_transformers_tokenizer
from hypic.launcher import DEFAULT_MODEL
from services.front.chat_render import ChatRenderer, chat_template_refusal
from services.front.segments import ROLES, ChatTemplate
from tests.support.chat_templates import TEMPLATES

WORDS = ["alpha", "beta", " spaced ", "\n", "<think>", "</think>", "quote\"d", "ümlaut", "<tag>",
         "&amp;", "{{ not_jinja }}", "tab\t", "emoji 🙂", "42"]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 8)))


def _model_dir(tmp_path: Path, template: str, *, as_file: bool) -> Path:
    """The bundled model's tokenizer with `template` as its chat template (in tokenizer_config.json,
    or as chat_template.jinja, which transformers prefers)."""
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(DEFAULT_MODEL / "tokenizer.json", d)
    shutil.copy(DEFAULT_MODEL / "config.json", d)
    cfg = json.loads((DEFAULT_MODEL / "tokenizer_config.json").read_text())
    if as_file:
        cfg["chat_template"] = "{{ 'the file wins' }}"
        (d / "chat_template.jinja").write_text(template, encoding="utf-8")
    else:
        cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _conversation(rng: random.Random) -> list[dict]:
    msgs: list[dict] = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 4)):
        msgs.append({"role": "user", "content": _text(rng)})
        reply: dict = {"role": "assistant", "content": _text(rng)}
        if rng.random() < 0.4:
            reply["reasoning_content"] = _text(rng)
        elif rng.random() < 0.3:
            reply["reasoning"] = _text(rng)  # an older name, aliased to reasoning_content
        if rng.random() < 0.4:
            reply["tool_calls"] = [{"type": "function", "function": {
                "name": "get_weather", "arguments": {"city": _text(rng), "days": rng.randint(1, 9)}}}]
            msgs += [reply, {"role": "tool", "content": _text(rng)}]
        else:
            reply["name"] = None  # None-valued keys are dropped before rendering
            msgs.append(reply)
    msgs.append({"role": "user", "content": _text(rng)})
    return msgs


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather <forecast> & more",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}]
DOCS = [{"title": "Doc <1>", "text": "first & only"}, {"title": "Two", "text": "ümlaut"}]


@pytest.mark.parametrize("as_file", [False, True])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_renders_as_transformers(tmp_path, name, as_file):
    d = _model_dir(tmp_path, TEMPLATES[name], as_file=as_file)
    assert chat_template_refusal(d) is None
    ours, theirs = ChatRenderer.load(d), load_transformers_tokenizer(d)
    assert ours.special_tokens == theirs.special_tokens_map
    rng = random.Random(f"{name}{as_file}")
    for i in range(40):
        msgs = _conversation(rng)
        kw = {"add_generation_prompt": bool(i % 2), "tools": TOOLS if i % 3 == 0 else None,
              "documents": DOCS if i % 4 == 0 else None}
        extra = {"enable_thinking": bool(i % 5)} if i % 7 else {}
        if i % 6 == 0:
            extra["add_eos"] = True
        expected = theirs.apply_chat_template(msgs, tokenize=False, **kw, **extra)
        assert ours.render(msgs, **kw, **extra) == expected, (name, i)
    if name == "qwen3_style":  # a real difference between calls, so the comparison can fail
        assert "<tool_call>" in expected or "<tools>" in ours.render(msgs, tools=TOOLS)


def test_template_errors_are_transformers_errors(tmp_path):
    d = _model_dir(tmp_path, TEMPLATES["llama3_style"], as_file=False)
    msgs = [{"role": "narrator", "content": "x"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role narrator"):
        load_transformers_tokenizer(d).apply_chat_template(msgs, tokenize=False)
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role narrator"):
        ChatRenderer.load(d).render(msgs)
    sneaky = ChatRenderer("{% set ns = namespace() %}{% set ns._x = 1 %}{{ ''.__class__ }}", {})
    with pytest.raises(jinja2.exceptions.SecurityError):
        sneaky.render([{"role": "user", "content": "x"}])


def test_the_front_renders_and_encodes_the_bundled_model_as_transformers():
    fast, reference = ChatTemplate.load(DEFAULT_MODEL), ChatTemplate(
        load_transformers_tokenizer(DEFAULT_MODEL))
    assert fast.renderer is not None and reference.renderer is None and fast.has_template
    assert fast.eos_ids() == reference.eos_ids() != set()
    rng = random.Random(7)
    for _ in range(60):
        text, role, query = _text(rng), rng.choice(ROLES), rng.random() < 0.5
        assert fast.render(role, text, query=query) == reference.render(role, text, query=query)
        assert fast.encode(text) == reference.encode(text)


def test_what_needs_transformers_is_refused(tmp_path):
    d = _model_dir(tmp_path, TEMPLATES["plain_blocks"], as_file=False)
    (d / "special_tokens_map.json").write_text("{}")
    assert chat_template_refusal(d) == "legacy special-token files"
    (d / "special_tokens_map.json").unlink()
    (d / "additional_chat_templates").mkdir()
    assert chat_template_refusal(d) == "several named chat templates"
    shutil.rmtree(d / "additional_chat_templates")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "x"}]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert chat_template_refusal(d) == "several named chat templates"
    assert ChatTemplate.load(d).renderer is None  # transformers' tokenizer renders it

