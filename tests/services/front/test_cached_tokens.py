"""usage.prompt_tokens_details.cached_tokens counts the prompt tokens served from cache: the
bodies of the segments that were cache hits (a hit's seam window is recomputed), never those of
segments built for this request. Checked on a cold request, a mixed one (two documents cached,
two new) and a warm one, through the OpenAI-compatible front of a real mesh on the bundled model.
The operators' figure, the front's hypic_prompt_tokens_cached_total (summed over tiers), grows by
the same count."""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from bench.quality.tasks import eval_prompt, make_query
from hypic.launcher import Mesh

pytestmark = [pytest.mark.processes, pytest.mark.timeout(400)]

MODEL = "hypic-tiny-qwen35"
SEAM = 8  # the router's default seam width


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with Mesh(None, tmp_path_factory.mktemp("cached"), n_scatter=1, threads=1, front=True,
              start_timeout_s=240,
              extra_args={"segcache": ["--host-bytes", "64MiB", "--disk-bytes", "128MiB"]}) as m:
        yield m


def documents_and_question(index: int) -> tuple[list[str], str]:
    """One retrieval world of the quality evaluation: its documents and a question on them."""
    world, _ = eval_prompt("retrieval", index)
    q = make_query(random.Random(index), world, "retrieval")
    return [" ".join(d) for d in world.docs], " ".join(q.words[1:-1])


def cached_metric(mesh) -> float:
    """hypic_prompt_tokens_cached_total over every tier."""
    body = httpx.get(mesh.front_url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in body.splitlines()
               if line.startswith("hypic_prompt_tokens_cached_total{"))


def cached_tokens(mesh, docs: list[str], question: str) -> int:
    """The request's usage.prompt_tokens_details.cached_tokens (checked against the metric)."""
    before = cached_metric(mesh)
    api = openai.OpenAI(base_url=mesh.front_url + "/v1", api_key="unused", timeout=120,
                        max_retries=0)
    r = api.chat.completions.create(
        model=MODEL, max_tokens=1, temperature=0,
        messages=[{"role": "user", "content": d} for d in docs] + [
            {"role": "user", "content": question}])
    cached = r.usage.prompt_tokens_details.cached_tokens
    assert cached_metric(mesh) - before == cached
    return cached


def body_tokens(doc: str) -> int:
    """A cached document's tokens minus its seam (the bundled model: one token per word)."""
    return len(doc.split()) - SEAM


def test_cached_tokens_count_only_the_segments_that_were_hits(mesh) -> None:
    docs, question = documents_and_question(11)
    assert len(docs) >= 4
    a, b, c, d = docs[:4]
    assert cached_tokens(mesh, [a, b], question) == 0                      # cold: all built
    assert cached_tokens(mesh, [c, b, d, a], question) == body_tokens(a) + body_tokens(b)
    assert cached_tokens(mesh, [d, c], question) == body_tokens(c) + body_tokens(d)  # warm
