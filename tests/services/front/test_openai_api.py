"""The OpenAI-compatible front (services/front), driven by the official `openai` client (sync and
async, streaming and not, chat and completions) and raw HTTP (httpx) for the error cases, against
one real mesh on the bundled model (segcache, scatter, combine, router, front as processes).
Answers equal the gRPC SDK's for the same segments and query."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import openai
import pytest
from starlette.testclient import TestClient

import hypic
from bench.quality.tasks import eval_prompt, make_query
from common.mesh.config import load_config
from hypic.launcher import DEFAULT_MODEL, Mesh
from protos.hypic.v1 import router_pb2 as router_pb
from services.front.app import create_app
from services.front.config import ENV_PREFIX, FrontConfig
from services.front.segments import ChatTemplate, chat_prompt, completion_prompt
from services.front.stops import StopMatcher, stop_reference
from services.router.servicer import stop_at_eos

pytestmark = pytest.mark.timeout(300)

MODEL = "hypic-tiny-qwen35"
MAX_PROMPT_TOKENS = 1500


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with Mesh(None, tmp_path_factory.mktemp("front"), n_scatter=1, threads=1, front=True,
              start_timeout_s=240,
              extra_args={"router": ["--max-prompt-tokens", str(MAX_PROMPT_TOKENS)],
                          "segcache": ["--host-bytes", "64MiB", "--disk-bytes", "128MiB"]}) as m:
        yield m


@pytest.fixture(scope="module")
def api(mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=mesh.front_url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


@pytest.fixture(scope="module")
def sdk(mesh):
    with hypic.Client(mesh.router_address, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate.load(DEFAULT_MODEL)


def session(index: int, n_questions: int = 3, seed: int = 7):
    """Documents (text, each '<doc> ...') and (question, expected answer) pairs of one
    retrieval world of the quality evaluation."""
    world, _ = eval_prompt("retrieval", index)
    rng = random.Random(seed + index)
    qs = [make_query(rng, world, "retrieval") for _ in range(n_questions)]
    return [" ".join(d) for d in world.docs], [(" ".join(q.words[1:-1]), q.answer[0]) for q in qs]


def sdk_text(sdk, docs, query, max_tokens=1, **kw) -> str:
    return sdk.generate(segments=docs, query=query, max_tokens=max_tokens, stream=False,
                        **kw).text


# ---- the openai client, answers equal the SDK's ----------------------------------------------------

@pytest.mark.processes
def test_models_and_health(mesh, api) -> None:
    models = api.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(mesh.front_url + "/health").status_code == 200


@pytest.mark.processes
def test_chat_each_message_a_segment(api, sdk) -> None:
    docs, questions = session(0)
    right = 0
    for question, expected in questions:
        messages = [{"role": "user", "content": d} for d in docs] + \
            [{"role": "user", "content": question}]
        r = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                        temperature=0)
        answer = r.choices[0].message.content
        assert answer == sdk_text(sdk, docs, f"<q> {question} <a>")
        assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
        assert r.usage.completion_tokens == 1 and r.usage.prompt_tokens > 400
        right += answer.strip() == expected
    assert right >= 2, "the bundled model answers retrieval through the chat template"


@pytest.mark.processes
def test_chat_content_parts_and_system_messages(api, sdk, template) -> None:
    docs, [(question, _)] = session(1, 1)
    bare = [d.removeprefix("<doc> ") for d in docs]  # the template adds "<doc> "
    parts = [{"type": "text", "text": d} for d in bare[2:]] + [{"type": "text", "text": question}]
    messages = [{"role": "system", "content": bare[0]}, {"role": "user", "content": bare[1]},
                {"role": "user", "content": parts}]
    prompt = chat_prompt({"messages": messages}, template)
    assert prompt.segments == docs and prompt.query == f"<q> {question} <a>"
    r = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert r.choices[0].message.content == sdk_text(sdk, docs, prompt.query, 2)


@pytest.mark.processes
def test_explicit_segments_on_both_endpoints(api, sdk) -> None:
    docs, [(question, _)] = session(2, 1)
    query = f"<q> {question} <a>"
    want = sdk_text(sdk, docs, query, 3)
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "ignored when hypic.query is given"}],
        max_tokens=3, temperature=0, extra_body={"hypic": {"segments": docs, "query": query}})
    assert chat.choices[0].message.content == want
    comp = api.completions.create(model=MODEL, prompt=query, max_tokens=3, temperature=0,
                                  extra_body={"hypic": {"segments": docs}})
    assert comp.choices[0].text == want and comp.object == "text_completion"
    full = api.completions.create(model=MODEL, prompt=query, max_tokens=3, temperature=0,
                                  extra_body={"hypic": {"segments": docs, "mode": "full"}})
    assert full.choices[0].text == sdk_text(sdk, docs, query, 3, mode="full")
    assert full.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.processes
def test_completions_separator_splits_segments(api, sdk, template) -> None:
    docs, [(question, _)] = session(3, 1)
    query = f"<q> {question} <a>"
    prompt = " # # ".join(docs + [query])
    parsed = completion_prompt({"prompt": prompt}, template, " # # ")
    assert parsed.segments == docs and parsed.query == query
    r = api.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert r.choices[0].text == sdk_text(sdk, docs, query, 2)


@pytest.mark.processes
def test_streaming_sync_chat_and_async_completions(mesh, api, sdk) -> None:
    docs, [(question, _)] = session(4, 1)
    query = f"<q> {question} <a>"
    want = sdk_text(sdk, docs, query, 4)
    messages = [{"role": "user", "content": d} for d in docs] + \
        [{"role": "user", "content": question}]
    chunks = list(api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens > 400

    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=mesh.front_url + "/v1", api_key="x", max_retries=0)
        try:
            stream = await client.completions.create(
                model=MODEL, prompt=query, max_tokens=4, temperature=0, stream=True,
                extra_body={"hypic": {"segments": docs}})
            streamed = "".join([c.choices[0].text async for c in stream])
            whole = await client.completions.create(model=MODEL, prompt=query, max_tokens=4,
                                                    temperature=0,
                                                    extra_body={"hypic": {"segments": docs}})
            return streamed, whole.choices[0].text
        finally:
            await client.close()

    streamed, whole = asyncio.run(run())
    assert streamed == whole == want


@pytest.mark.processes
def test_raw_sse_ends_with_done(mesh) -> None:
    docs, [(question, _)] = session(4, 1)
    body = {"model": MODEL, "prompt": question, "max_tokens": 2, "temperature": 0,
            "stream": True, "hypic": {"segments": docs}}
    with httpx.stream("POST", mesh.front_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"


@pytest.mark.processes
def test_second_request_in_another_order_reports_cached_tokens(api) -> None:
    docs, [(question, _)] = session(5, 1)
    first = api.chat.completions.create(
        model=MODEL, max_tokens=1, temperature=0,
        messages=[{"role": "user", "content": d} for d in docs] + [
            {"role": "user", "content": question}])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    shuffled = docs[::-1]
    second = api.chat.completions.create(
        model=MODEL, max_tokens=1, temperature=0,
        messages=[{"role": "user", "content": d} for d in shuffled] + [
            {"role": "user", "content": question}])
    cached = second.usage.prompt_tokens_details.cached_tokens
    seam = 8
    assert cached == sum(len(d.split()) - seam for d in docs)  # every body, seams recomputed
    assert second.usage.prompt_tokens == first.usage.prompt_tokens


@pytest.mark.processes
def test_sampling_seed_top_p_and_stop(api, sdk) -> None:
    docs, [(question, _)] = session(6, 1)
    query = f"<q> {question} <a>"
    ext = {"hypic": {"segments": docs}}
    kw = dict(model=MODEL, prompt=query, max_tokens=6, temperature=1.0, top_p=0.9,
              extra_body=ext)
    a = api.completions.create(seed=11, **kw).choices[0].text
    b = api.completions.create(seed=11, **kw).choices[0].text
    assert a == b == sdk_text(sdk, docs, query, 6, temperature=1.0, top_p=0.9, seed=11)
    greedy = api.completions.create(model=MODEL, prompt=query, max_tokens=6, temperature=0,
                                    extra_body=ext)
    full = greedy.choices[0].text
    stop = full.split()[1] if len(full.split()) > 1 else full.split()[0]
    want, matched = stop_reference(full, [stop])
    assert matched
    for stream in (False, True):
        r = api.completions.create(model=MODEL, prompt=query, max_tokens=6, temperature=0,
                                   stop=[stop, "never-said"], extra_body=ext, stream=stream,
                                   **({"stream_options": {"include_usage": True}} if stream else {}))
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
        assert text == want and finish == "stop"
        assert usage.prompt_tokens > 400 and 1 <= usage.completion_tokens <= 6


# ---- errors, raw HTTP ---------------------------------------------------------------------------------

def _post(mesh, path: str, **kw) -> httpx.Response:
    return httpx.post(mesh.front_url + path, timeout=60, **kw)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.processes
def test_error_statuses_and_shape(mesh) -> None:
    docs, [(question, _)] = session(0, 1)
    ok = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 1}
    _error(_post(mesh, "/v1/chat/completions", content=b'{"model": '), 400)
    _error(_post(mesh, "/v1/chat/completions", content=b"[1, 2]"), 400)
    assert _error(_post(mesh, "/v1/chat/completions", json={**ok, "model": "gpt-9"}),
                  404)["code"] == "model_not_found"
    for bad, param in (({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                       ({"frequency_penalty": 0.5}, "frequency_penalty"),
                       ({"made_up": 1}, "made_up"), ({"temperature": -1}, "temperature"),
                       ({"top_p": 0}, "top_p"), ({"stop": [1]}, "stop"),
                       ({"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
                       ({"messages": [{"role": "user", "content": [
                           {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
                       ({"hypic": {"segments": []}}, "hypic.segments"),
                       ({"hypic": {"mode": "bogus"}}, "hypic.mode"),
                       ({"hypic": {"keep_whole": "yes"}}, "hypic.keep_whole")):
        assert _error(_post(mesh, "/v1/chat/completions", json={**ok, **bad}), 400)["param"] == param
    # neutral values of unsupported parameters are accepted
    r = _post(mesh, "/v1/chat/completions", json={**ok, "n": 1, "frequency_penalty": 0,
                                                   "logprobs": False, "temperature": 0})
    assert r.status_code == 200, r.text
    long_prompt = " # # ".join(docs * 4 + [f"<q> {question} <a>"])  # > MAX_PROMPT_TOKENS
    err = _error(_post(mesh, "/v1/completions", json={"model": MODEL, "prompt": long_prompt}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    _error(_post(mesh, "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}), 400)
    _error(httpx.get(mesh.front_url + "/v1/nothing-here"), 404)


@pytest.mark.processes
def test_metrics_vllm_names_with_model_label(mesh, api) -> None:
    api.completions.create(model=MODEL, prompt="<q> find x <a>", max_tokens=2, temperature=0,
                           extra_body={"hypic": {"segments": session(0)[0]}})
    text = httpx.get(mesh.front_url + "/metrics").text
    for name in ("hypic_time_to_first_token_seconds_count", "hypic_e2e_request_latency_seconds_count",
                 "hypic_inter_token_latency_seconds_count", "hypic_prompt_tokens_total",
                 "hypic_generation_tokens_total", "hypic_request_success_total"):
        line = next(ln for ln in text.splitlines() if ln.startswith(name + "{"))
        assert f'model_name="{MODEL}"' in line and float(line.split()[-1]) > 0, line
    cached = [ln for ln in text.splitlines() if ln.startswith("hypic_prompt_tokens_cached_total{")]
    assert cached and all('tier="' in ln for ln in cached)
    assert sum(float(ln.split()[-1]) for ln in cached) > 0


# ---- in-process app: API key, no router ---------------------------------------------------------------

@pytest.mark.processes
def test_api_key_from_env_gives_401_without_the_token(mesh, template) -> None:
    cfg = load_config(FrontConfig, ["--router-addresses", mesh.router_address],
                      env={ENV_PREFIX + "API_KEY": "sekret"}, env_prefix=ENV_PREFIX)
    assert cfg.api_key == "sekret"
    with TestClient(create_app(cfg, template)) as http:
        _error(http.get("/v1/models"), 401)
        _error(http.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert http.get("/health").status_code == 200
        wrong = openai.OpenAI(base_url="http://testserver/v1", api_key="nope", http_client=http,
                              max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url="http://testserver/v1", api_key="sekret", http_client=http,
                              max_retries=0)
        assert right.models.list().data[0].id == MODEL


@pytest.mark.processes
def test_overload_is_429_and_a_hung_router_504(template) -> None:
    """A router that accepts the connection and never answers keeps a request in flight at the
    front (--max-in-flight 1): the next one is refused with 429; the first ends at its deadline."""
    import threading

    from tests.support.peers import HungHttp2

    hung = HungHttp2()
    cfg = FrontConfig(router_addresses=hung.address, max_in_flight=1, request_timeout_s=3)
    body = {"model": MODEL, "prompt": "<doc> a b # # <q> c <a>"}
    try:
        with TestClient(create_app(cfg, template)) as http:
            first: list[httpx.Response] = []
            t = threading.Thread(target=lambda: first.append(http.post("/v1/completions", json=body)))
            t.start()
            front = http.app.state.front
            for _ in range(200):
                if front.in_flight:
                    break
                threading.Event().wait(0.01)
            assert front.in_flight == 1
            assert _error(http.post("/v1/completions", json=body), 429)["type"] == "rate_limit_error"
            t.join(30)
            assert _error(first[0], 504)["code"] == "timeout"
            assert front.in_flight == 0
    finally:
        hung.close()


def test_no_router_is_503(template) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    cfg = FrontConfig(router_addresses=f"127.0.0.1:{closed}", request_timeout_s=5)
    with TestClient(create_app(cfg, template)) as http:
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "<doc> a b # # <q> c <a>"})
        assert _error(r, 503)["type"] == "service_unavailable"


# ---- pieces ----------------------------------------------------------------------------------------

def test_stop_matcher_equals_reference_on_random_streams(fresh_seed: int) -> None:
    rng = random.Random(fresh_seed)
    for _ in range(500):
        text = "".join(rng.choice("abc ") for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randrange(1, 4)))
                 for _ in range(rng.randrange(1, 4))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(1, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        m = StopMatcher(stops)
        out = "".join(m.push(p) for p in pieces) + m.flush()
        assert (out, m.matched) == stop_reference(text, stops), (text, stops, pieces)


def test_router_stops_at_eos_unless_told_not_to() -> None:
    assert stop_at_eos(router_pb.GenerateRequest()) is True
    assert stop_at_eos(router_pb.GenerateRequest(stop_at_eos=False)) is False
    assert stop_at_eos(router_pb.GenerateRequest(stop_at_eos=True)) is True
    assert hypic.client.build_request(["a"], "q").stop_at_eos is True


def test_single_message_is_cached_as_one_segment(template) -> None:
    p = chat_prompt({"messages": [{"role": "user", "content": "find dorap"}]}, template)
    ids = template.encode("<q> find dorap <a>")
    assert p.segments == [ids[:-1]] and p.query == [ids[-1]]


def test_keep_whole_reaches_the_request_from_both_endpoints(template) -> None:
    chat = {"messages": [{"role": "system", "content": "d"}, {"role": "user", "content": "q"}]}
    assert chat_prompt(chat, template).keep_whole is False
    assert chat_prompt({**chat, "hypic": {"keep_whole": True}}, template).keep_whole is True
    done = completion_prompt({"prompt": "a # # q", "hypic": {"keep_whole": True}}, template, " # # ")
    assert done.keep_whole is True and done.segments == ["a"]
    assert hypic.client.build_request(["a"], "q", keep_whole=True).keep_whole is True
    assert hypic.client.build_request(["a"], "q").keep_whole is False


@pytest.mark.processes
def test_readme_quick_start_examples_answer(mesh, api) -> None:
    """The README's curl body and openai example, sent as written, answer the document's fact."""
    import json
    import re

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme[readme.index("### From any OpenAI client"):]
    body = json.loads(re.search(r"-d '(\{.*?\})'", section, re.S).group(1))
    r = httpx.post(mesh.front_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].strip() == "lopo"
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = code.replace('OpenAI(base_url="http://127.0.0.1:8000/v1"',
                        f'OpenAI(base_url="{mesh.front_url}/v1"').replace("print(", "out.append(")
    out: list = []
    exec(compile(code, "README", "exec"), {"out": out})
    assert out and out[0][0].strip() == "lopo"


@pytest.mark.processes
def test_bench_serve_against_the_running_front_and_router(mesh, tmp_path) -> None:
    """`bench.serve --base-url` / `--address` replay a JSONL trace against the running mesh:
    every request answers, the repeated documents report cached tokens both ways."""
    import json

    from bench import serve
    from bench.remote import load_trace

    docs, questions = session(7, 2)
    lines = [{"segments": docs[:4], "query": f"<q> {q} <a>", "max_tokens": 3} for q, _ in questions]
    lines.append({"segments": docs[:4][::-1], "query": "<q> find x <a>", "max_tokens": 2})
    trace = tmp_path / "trace.jsonl"  # no arrival times: closed loop, one request after another
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "timed.jsonl").write_text(json.dumps({**lines[0], "arrival_s": 0.5}) + "\n")
    assert [r.arrival_s for r in load_trace(tmp_path / "timed.jsonl", 8)] == [0.5]
    for how, target in (("--base-url", mesh.front_url), ("--address", mesh.router_address)):
        out = serve.main([how, target, "--trace", str(trace), "--out", str(tmp_path),
                          "--tag", how.strip("-")])
        recs = out["records"]
        assert out["summary"]["errors"] == 0, out["summary"]["errors_sample"]
        assert all(1 <= r["tokens"] <= 3 for r in recs)
        assert all(r["ttft_s"] > 0 and r["prompt_tokens"] > 100 for r in recs)
        assert recs[-1]["cached_tokens"] > 0  # the same documents, reversed
        assert (tmp_path / f"serve_remote{how.strip('-')}.json").exists()
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        trace.write_text('{"query": "x"}\n')
        serve.main(["--base-url", mesh.front_url, "--trace", str(trace), "--out", str(tmp_path)])


@pytest.mark.processes
def test_front_process_port_file_and_clean_sigterm(tmp_path) -> None:
    """python -m services.front writes its port file once serving, and on SIGTERM logs (JSON
    lines) and exits 0, like every other service."""
    import json
    import signal
    import subprocess
    import sys
    import time

    port_file = tmp_path / "front.json"
    proc = subprocess.Popen([sys.executable, "-m", "services.front", "--port", "0", "--port-file",
                             str(port_file), "--router-addresses", "127.0.0.1:1"],
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[3])
    try:
        for _ in range(600):
            if port_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.05)
        info = json.loads(port_file.read_text())
        assert info["pid"] == proc.pid and info["model"] == MODEL
        assert httpx.get(f"http://127.0.0.1:{info['port']}/health").status_code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [json.loads(ln) for ln in proc.stderr.read().splitlines() if ln.strip()]
    # the front's own lines (libraries' ones, e.g. uvicorn's access log, name their logger)
    events = [d["event"] for d in lines if "logger" not in d]
    assert events[-3:] == ["serving", "shutting down", "stopped"]
    assert any(d.get("logger") == "uvicorn.access" and d["status"] == 503 for d in lines)


def test_router_statuses_map_to_openai_errors() -> None:
    from hypic import errors as sdk
    from services.front.errors import from_sdk

    cases = [(sdk.InvalidArgument("segment 0 is empty"), 400, None),
             (sdk.InvalidArgument("prompt of 9 tokens is over max_prompt_tokens (8)"), 400,
              "context_length_exceeded"),
             (sdk.ResourceExhausted("64 requests in flight"), 429, "overloaded"),
             (sdk.Unavailable("no combine service available"), 503, "unavailable"),
             (sdk.DeadlineExceeded("deadline exceeded"), 504, "timeout"),
             (sdk.Internal("internal error: KeyError"), 500, "internal")]
    for err, status, code in cases:
        api = from_sdk(err)
        assert (api.status, api.code) == (status, code), err
        assert api.body()["error"]["message"]
