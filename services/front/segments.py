"""From an OpenAI request to Hypic's segments and query, three ways:

- chat messages: every message is a segment and the last user message is the query; a message
  whose content is a list of text parts gives one segment per part (one per retrieved document;
  in the last user message the parts before the last are segments, the last is the query). The
  model's chat template (tokenizer_config.json) is applied to each segment alone, so a message
  tokenizes the same wherever it stands: segments without, the query with the generation prompt.
- explicit: `"hypic": {"segments": [...], "query": "...", "mode": "...", "keep_whole": false}` in the body (the
  openai client's `extra_body`) on both endpoints; segments and query are sent as given (text or
  token ids); without "query", the chat's last user message or the completion prompt is the query.
- LMCache-style: a completions prompt split on the configured separator; the last piece is the query.

A prompt with nothing before its query (one message, a prompt without separator) is cached as
one segment: every token but the last, which is the query.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from common.mesh.tokenizer import FastTokenizer, load_transformers_tokenizer
from services.front.chat_render import ChatRenderer, chat_template_refusal
from services.front.config import MODE_NAMES
from services.front.errors import bad_request

SegmentLike = Union[str, list[int]]
ROLES = ("system", "developer", "user", "assistant", "tool")
EXTENSION_KEYS = {"segments", "query", "mode", "keep_whole"}


@dataclass
class Prompt:
    segments: list[SegmentLike]
    query: SegmentLike
    mode: str | None = None
    keep_whole: bool = False     # the router caches every segment whole (no cut into pieces)


class ChatTemplate:
    """The model's tokenizer and chat template, applied one message at a time. Without a
    tokenizer (a model served as token ids) messages are sent as their plain text."""

    def __init__(self, tokenizer: Any = None, renderer: ChatRenderer | None = None):
        self.tokenizer = tokenizer  # FastTokenizer or a transformers tokenizer
        self.renderer = renderer  # transformers' rendering without transformers, where it applies
        self.has_template = renderer is not None or bool(getattr(tokenizer, "chat_template", None))

    @classmethod
    def load(cls, model_dir: Path) -> "ChatTemplate":
        # Without transformers (1.5-2 CPU s of the front's start) where the tokenizer and the
        # template are what AutoTokenizer would give (chat_render.chat_template_refusal).
        if chat_template_refusal(model_dir) is None:
            return cls(FastTokenizer(model_dir), ChatRenderer.load(model_dir))
        return cls(load_transformers_tokenizer(model_dir))

    def render(self, role: str, text: str, *, query: bool) -> str:
        if not self.has_template:
            return text
        messages = [{"role": role, "content": text}]
        if self.renderer is not None:
            return self.renderer.render(messages, add_generation_prompt=query)
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=query)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("the model has no tokenizer: send segments (hypic.segments or "
                              "several messages)")
        return list(self.tokenizer([text], add_special_tokens=False)["input_ids"][0])

    def eos_ids(self) -> set[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return {int(eos)} if eos is not None else set()


# ---- pieces of the request ------------------------------------------------------------------------

def _text_parts(content: Any, where: str) -> list[str]:
    """A message's content as its text parts (a string is one part)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list) or not content:
        raise bad_request(f"{where}.content must be a string or a non-empty list of text parts",
                          param=f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str):
            raise bad_request(f"{where}.content[{j}]: only text parts are supported",
                              param=f"{where}.content")
        parts.append(part["text"])
    return parts


def _segment_like(value: Any, param: str) -> SegmentLike:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        return value
    raise bad_request(f"{param} must be a non-empty string or a list of token ids", param=param)


def extension(body: dict) -> dict:
    """The validated "hypic" extension object ({} when absent)."""
    ext = body.get("hypic")
    if ext is None:
        return {}
    if not isinstance(ext, dict):
        raise bad_request("hypic must be an object", param="hypic")
    unknown = set(ext) - EXTENSION_KEYS
    if unknown:
        raise bad_request(f"unknown hypic field(s): {', '.join(sorted(unknown))}", param="hypic")
    out: dict[str, Any] = {}
    if "segments" in ext:
        segs = ext["segments"]
        if not isinstance(segs, list) or not segs:
            raise bad_request("hypic.segments must be a non-empty list", param="hypic.segments")
        out["segments"] = [_segment_like(s, f"hypic.segments[{i}]") for i, s in enumerate(segs)]
    if "query" in ext:
        out["query"] = _segment_like(ext["query"], "hypic.query")
    if "mode" in ext:
        mode = ext["mode"]
        if not isinstance(mode, str) or mode.lower() not in MODE_NAMES:
            raise bad_request(f"hypic.mode must be one of {', '.join(MODE_NAMES)}",
                              param="hypic.mode")
        out["mode"] = mode.lower()
    if "keep_whole" in ext:
        if not isinstance(ext["keep_whole"], bool):
            raise bad_request("hypic.keep_whole must be a boolean", param="hypic.keep_whole")
        out["keep_whole"] = ext["keep_whole"]
    return out


def _with_options(prompt: Prompt, ext: dict) -> Prompt:
    """The extension's per-request options (mode, keep_whole) set on a prompt."""
    prompt.mode = ext.get("mode")
    prompt.keep_whole = ext.get("keep_whole", False)
    return prompt


def _split_last_token(template: ChatTemplate, text: str, param: str) -> Prompt:
    ids = template.encode(text)
    if len(ids) < 2:
        raise bad_request(f"{param}: a prompt with no segments needs at least two tokens",
                          param=param)
    return Prompt(segments=[ids[:-1]], query=[ids[-1]])


# ---- the two endpoints ------------------------------------------------------------------------------

def chat_prompt(body: dict, template: ChatTemplate) -> Prompt:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    rendered: list[tuple[str, list[str]]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise bad_request(f"{where}: a message needs a role ({', '.join(ROLES)})",
                              param="messages")
        rendered.append((msg["role"], _text_parts(msg.get("content"), where)))
    role, last_parts = rendered[-1]
    if role != "user":
        raise bad_request("the last message must be from the user (it is the query)",
                          param="messages")
    ext = extension(body)
    query_text = template.render("user", last_parts[-1], query=True)
    query: SegmentLike = ext.get("query", query_text)
    if "segments" in ext:
        return _with_options(Prompt(segments=ext["segments"], query=query), ext)
    segments: list[SegmentLike] = [template.render(r, p, query=False)
                                   for r, parts in rendered[:-1] for p in parts if p]
    segments += [template.render("user", p, query=False) for p in last_parts[:-1] if p]
    if not segments:
        if "query" in ext:
            raise bad_request("no segments: send earlier messages or hypic.segments",
                              param="messages")
        return _with_options(_split_last_token(template, query_text, "messages"), ext)
    return _with_options(Prompt(segments=segments, query=query), ext)


def completion_prompt(body: dict, template: ChatTemplate, separator: str) -> Prompt:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ext = extension(body)
    if "segments" in ext:
        if "query" in ext:
            return _with_options(Prompt(ext["segments"], ext["query"]), ext)
        return _with_options(Prompt(ext["segments"], _segment_like(prompt, "prompt")), ext)
    if not isinstance(prompt, str) or not prompt:
        raise bad_request("prompt must be a non-empty string (batches of prompts are not "
                          "supported)", param="prompt")
    pieces = [p for p in prompt.split(separator)] if separator else [prompt]
    pieces = [p for p in pieces if p.strip()]
    if not pieces:
        raise bad_request("prompt has no text besides separators", param="prompt")
    if len(pieces) == 1:
        out = _split_last_token(template, pieces[0], "prompt")
    else:
        out = Prompt(segments=pieces[:-1], query=pieces[-1])
    if "query" in ext:
        out = Prompt(segments=[*out.segments, out.query] if len(pieces) > 1 else pieces,
                     query=ext["query"])
    return _with_options(out, ext)
