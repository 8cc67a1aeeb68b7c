"""Every response of the OpenAI-compatible front says how the mesh served it: a `hypic` object
(non-streaming: at the top level of the body; streaming: on the last chunk before [DONE] — the
usage chunk when usage is asked for, else the finish_reason chunk) and x-hypic-* headers with the
same figures (streaming: from the first Timings, sent as the response starts). Driven by the
official `openai` client (`with_raw_response` for the headers) against a real mesh and front on the
bundled model: chat and completions, streaming and not, cold then warm (reused > 0), and the
full and prefix modes."""

from __future__ import annotations

import random

import openai
import pytest

from bench.quality.tasks import eval_prompt, make_query
from hypic.launcher import Mesh

pytestmark = [pytest.mark.processes, pytest.mark.timeout(400)]

MODEL = "hypic-tiny-qwen35"
SEAM = 8  # the router's default seam width
FIGURES = ("reused", "built", "recomputed", "seam", "mode", "shadowed", "request_id")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with Mesh(None, tmp_path_factory.mktemp("transparency"), n_scatter=1, threads=1, front=True,
              start_timeout_s=240,
              extra_args={"segcache": ["--host-bytes", "64MiB", "--disk-bytes", "128MiB"]}) as m:
        yield m


@pytest.fixture(scope="module")
def api(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.front_url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


def documents_and_question(index: int) -> tuple[list[str], str]:
    """One retrieval world of the quality evaluation: its documents and a question on them."""
    world, _ = eval_prompt("retrieval", index)
    q = make_query(random.Random(index), world, "retrieval")
    return [" ".join(d) for d in world.docs], " ".join(q.words[1:-1])


def messages(docs: list[str], question: str) -> list[dict]:
    return [{"role": "user", "content": d} for d in docs] + [{"role": "user", "content": question}]


def from_headers(headers) -> dict:
    """The x-hypic-* headers as the body's object spells them (numbers, booleans, strings)."""
    out = {}
    for name in FIGURES:
        value = headers["x-hypic-" + name.replace("_", "-")]
        out[name] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
    return out


def whole(create, **kw) -> tuple[dict, dict, object]:
    """(the body's hypic object, the headers' figures, the parsed response) of a non-streamed call."""
    raw = create.with_raw_response.create(model=MODEL, max_tokens=2, temperature=0, **kw)
    r = raw.parse()
    assert raw.headers["x-hypic-request-id"] == raw.headers["x-request-id"]
    return r.model_extra["hypic"], from_headers(raw.headers), r


def streamed(create, **kw) -> tuple[dict, dict, list]:
    """(the last chunk's hypic object, the headers' figures, the chunks) of a streamed call;
    no chunk but the last carries the object."""
    raw = create.with_raw_response.create(model=MODEL, max_tokens=3, temperature=0, stream=True, **kw)
    headers = from_headers(raw.headers)
    chunks = list(raw.parse())
    assert all("hypic" not in (c.model_extra or {}) for c in chunks[:-1])
    return chunks[-1].model_extra["hypic"], headers, chunks


def test_chat_cold_then_warm(api) -> None:
    docs, question = documents_and_question(21)
    n = len(docs)
    cold, headers, r = whole(api.chat.completions, messages=messages(docs, question))
    assert cold == headers
    assert {k: cold[k] for k in FIGURES[:-1]} == dict(reused=0, built=n, recomputed=0, seam=SEAM,
                                                     mode="hypic", shadowed=False)
    assert r.id == "chatcmpl-" + cold["request_id"]
    warm, headers, r = whole(api.chat.completions, messages=messages(docs[::-1], question),
                             extra_headers={"x-request-id": "transparency-warm-1"})
    assert warm == headers and warm["request_id"] == "transparency-warm-1"
    assert warm["reused"] == n > 0 and warm["built"] == 0 and warm["recomputed"] == 0
    assert r.usage.prompt_tokens_details.cached_tokens > 0  # the same hits, as usage counts them


def test_chat_streamed_says_it_on_the_finish_chunk_and_in_the_headers(api) -> None:
    docs, question = documents_and_question(22)
    n = len(docs)
    body, headers, chunks = streamed(api.chat.completions, messages=messages(docs, question))
    assert body == headers and chunks[-1].choices[0].finish_reason is not None
    assert (body["reused"], body["built"], body["recomputed"], body["seam"]) == (0, n, 0, SEAM)
    # with usage: on the usage chunk (no choices), after the finish_reason chunk
    body, headers, chunks = streamed(api.chat.completions, messages=messages(docs[1:], question),
                                     stream_options={"include_usage": True})
    assert body == headers and chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-2].choices[0].finish_reason is not None
    assert (body["reused"], body["built"], body["mode"]) == (n - 1, 0, "hypic")


def test_completions_streamed_and_not(api) -> None:
    docs, question = documents_and_question(23)
    prompt = " # # ".join([*docs, f"<q> {question} <a>"])  # LMCache-style: segments on the separator
    n = len(docs)
    body, headers, chunks = streamed(api.completions, prompt=prompt)
    assert body == headers and chunks[-1].choices[0].finish_reason is not None
    assert (body["reused"], body["built"], body["recomputed"]) == (0, n, 0)
    body, headers, chunks = streamed(api.completions, prompt=prompt, stream_options={"include_usage": True})
    assert body == headers and chunks[-1].usage is not None and (body["reused"], body["built"]) == (n, 0)
    body, headers, r = whole(api.completions, prompt=prompt)
    assert body == headers and r.id == "cmpl-" + body["request_id"]
    assert (body["reused"], body["built"], body["seam"], body["shadowed"]) == (n, 0, SEAM, False)


def test_full_and_prefix_modes_say_what_they_recomputed(api) -> None:
    docs, question = documents_and_question(24)
    n = len(docs)

    def served(mode: str, stream: bool) -> dict:
        kw = dict(messages=messages(docs, question), extra_body={"hypic": {"mode": mode}})
        body, headers, _ = streamed(api.chat.completions, **kw) if stream else whole(api.chat.completions, **kw)
        assert body == headers and body["mode"] == mode
        return {k: body[k] for k in ("reused", "built", "recomputed", "seam")}

    assert served("full", stream=False) == dict(reused=0, built=0, recomputed=n, seam=0)
    assert served("full", stream=True) == dict(reused=0, built=0, recomputed=n, seam=0)
    assert served("prefix", stream=True) == dict(reused=0, built=0, recomputed=n, seam=0)  # cold
    # combine's prefix cache now holds the prompt's every segment boundary
    assert served("prefix", stream=False) == dict(reused=n, built=0, recomputed=0, seam=0)
    assert served("prefix", stream=True) == dict(reused=n, built=0, recomputed=0, seam=0)
