"""The bundled model says what it is wherever a user meets it (/v1/models' card), and its length
limit is the model's own (config max_position_embeddings / tokenizer model_max_length: 4096 for
the bundled model, not the router's 32768 default): a longer prompt is a clean 400 at the front
and INVALID_ARGUMENT at the router, with no transformers warning in the router's log."""

from __future__ import annotations

import json
import time

import httpx
import pytest

import hypic
from hypic import errors
from hypic.launcher import DEFAULT_MODEL, Mesh
from hypic.model_card import model_card

pytestmark = pytest.mark.timeout(300)

MODEL = "hypic-tiny-qwen35"
BUNDLED_LIMIT = 4096  # models/hypic-tiny-qwen35: max_position_embeddings and model_max_length


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with Mesh(None, tmp_path_factory.mktemp("card"), n_scatter=0, threads=1, front=True,
              start_timeout_s=240,
              extra_args={"segcache": ["--host-bytes", "16MiB", "--disk-bytes", "64MiB"]}) as m:
        yield m


def test_the_bundled_model_has_a_card_saying_it_is_a_toy() -> None:
    card = model_card(DEFAULT_MODEL)
    assert "demo model" in card["description"] and "--model DIR" in card["description"]
    assert 0 < card["trained_prompt_tokens"] < BUNDLED_LIMIT


@pytest.mark.processes
def test_models_card_and_the_models_own_length_limit(mesh) -> None:
    [card] = httpx.get(mesh.front_url + "/v1/models").json()["data"]
    assert card["id"] == MODEL and card["max_model_len"] == BUNDLED_LIMIT
    assert card["description"] == model_card(DEFAULT_MODEL)["description"]
    assert card["trained_prompt_tokens"] == model_card(DEFAULT_MODEL)["trained_prompt_tokens"]

    too_long = " ".join(["vufar"] * (BUNDLED_LIMIT + 10))
    r = httpx.post(mesh.front_url + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": too_long, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and str(BUNDLED_LIMIT) in err["message"]

    with hypic.Client(mesh.router_address, timeout=60) as client:
        with pytest.raises(errors.InvalidArgument, match=str(BUNDLED_LIMIT)):
            client.generate(segments=[too_long], query="find vufar", max_tokens=1, stream=False)
        info = client.info()
    assert info.max_prompt_tokens == BUNDLED_LIMIT
    log = mesh.log("router")
    assert "indexing errors" not in log and "Token indices sequence length" not in log
    model_line = next(json.loads(ln) for ln in log.splitlines()
                      if ln.startswith("{") and json.loads(ln).get("event") == "model")
    assert model_line["max_model_len"] == BUNDLED_LIMIT


def _gauges(mesh, name: str) -> dict[str, float]:
    text = httpx.get(mesh.front_url + "/metrics", timeout=30).text
    assert "_created" not in text
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
            if ln.startswith(name + "{")}


@pytest.mark.processes
def test_front_waiting_and_cache_usage_gauges(mesh) -> None:
    docs = ["<doc> these vufar lopo . very Duven Ziven bufal rozo .",
            "<doc> an since used was palar vumul . those Duven tadon lofi ."]
    r = httpx.post(mesh.front_url + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": "<q> find vufar <a>", "max_tokens": 1,
                         "hypic": {"segments": docs}})
    assert r.status_code == 200, r.text
    assert _gauges(mesh, "hypic_num_requests_waiting") == \
        {f'hypic_num_requests_waiting{{model_name="{MODEL}"}}': 0.0}
    deadline = time.monotonic() + 30  # the built entries reach segcache after the answer
    while True:
        usage = _gauges(mesh, "hypic_cache_usage_perc")
        host = usage.get(f'hypic_cache_usage_perc{{model_name="{MODEL}",tier="host"}}', 0.0)
        if host > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert 0 < host < 1, usage
    assert all(0 <= v <= 1 for v in usage.values())
