"""A bounded fuzz of the mesh: a few hundred calls on every RPC of the four
services — random bytes, mutated valid messages, messages with hostile field values, garbage on
the raw ports — each must end in a clean status (never UNKNOWN or INTERNAL, no exception text),
every process must live, and the answer to a fixed request must be the same afterwards. The
HTTP front the same way: a couple of hundred mutated OpenAI requests (bad JSON, wrong types,
huge numbers, NaN, unknown fields, odd methods, paths and headers) each answered — never a
dropped connection — with 200 or a 4xx/5xx in OpenAI's error shape, never a 500 or a traceback.

Real processes on 127.0.0.1 (hypic.launcher.Mesh); the seed is fresh each run (printed)."""
from __future__ import annotations

import http.client
import json
import math
import random
import shutil
import socket
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message_factory import GetMessageClass

import hypic
from hypic.launcher import DEFAULT_MODEL, Mesh
from protos.hypic.v1 import combine_pb2 as combine_pb, router_pb2 as router_pb, scatter_pb2 as scatter_pb, segcache_pb2 as segcache_pb
from tests.support.tiny import PIC_CONFIGS, save_tiny

pytestmark = [pytest.mark.timeout(600), pytest.mark.processes]
SEAM = 8
CALL_TIMEOUT_S = 5.0
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
         grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.CANCELLED}
LEAKS = ("Traceback", "Unexpected <class", "Error:", "Exception", "File \"")
SERVICES = {"router": (router_pb, "Router"), "combine": (combine_pb, "Combine"),
            "scatter": (scatter_pb, "Scatter"), "segcache": (segcache_pb, "Segcache")}

INTS = [0, 1, 2, 7, 255, 2**31 - 1, 2**31, 2**32 - 1]
INTS64 = INTS + [2**63 - 1, 2**64 - 1]
FLOATS = [0.0, -1.0, 1e-45, 1e-30, 0.5, 1e38, math.inf, -math.inf, math.nan]
STRINGS = ["", "a", "ab" * 20, "\u00e9\u2603\x00", "x" * 600, "127.0.0.1:1", "../../etc/passwd"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    model = save_tiny("qwen3_5_text", tmp_path_factory.mktemp("model"), seed=5,
                      **PIC_CONFIGS["qwen3_5_text"])
    for name in ("tokenizer.json", "tokenizer_config.json"):  # text for the front (ids < its vocab)
        shutil.copy(DEFAULT_MODEL / name, model / name)
    with Mesh(model, tmp_path_factory.mktemp("data"), n_scatter=1, threads=1, seam=SEAM,
              start_timeout_s=180, front=True,
              extra_args={"router": ["--max-prompt-tokens", "512"],
                          "combine": ["--max-new-tokens", "16"]}) as m:
        yield m


def random_value(field, rng: random.Random, depth: int):
    t = field.type
    if t == F.TYPE_MESSAGE:
        return random_message(GetMessageClass(field.message_type), rng, depth + 1)
    if t == F.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values] + [7, 2**31 - 1])
    if t in (F.TYPE_UINT32, F.TYPE_FIXED32):
        return rng.choice(INTS)
    if t in (F.TYPE_UINT64, F.TYPE_FIXED64):
        return rng.choice(INTS64)
    if t in (F.TYPE_INT32, F.TYPE_SINT32, F.TYPE_SFIXED32):
        return rng.choice([0, 1, -1, 2**31 - 1, -2**31])
    if t in (F.TYPE_INT64, F.TYPE_SINT64, F.TYPE_SFIXED64):
        return rng.choice([0, 1, -1, 2**63 - 1, -2**63])
    if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return rng.choice(FLOATS)
    if t == F.TYPE_BOOL:
        return rng.random() < 0.5
    if t == F.TYPE_STRING:
        return rng.choice(STRINGS)
    if t == F.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 1, 16, 300]))
    raise AssertionError(f"unhandled field type {t}")


def random_message(cls, rng: random.Random, depth: int = 0):
    """A message of `cls` with hostile values in a random subset of its fields."""
    msg = cls()
    if depth > 2:
        return msg
    for field in cls.DESCRIPTOR.fields:
        if rng.random() < 0.4:
            continue
        if field.is_repeated:
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                continue
            n = rng.choice([0, 1, 3, 40])
            values = [random_value(field, rng, depth) for _ in range(n)]
            try:
                getattr(msg, field.name).extend(values)
            except (ValueError, TypeError):  # a value the field's type cannot hold
                pass
        elif field.type == F.TYPE_MESSAGE:
            getattr(msg, field.name).CopyFrom(random_value(field, rng, depth))
        else:
            try:
                setattr(msg, field.name, random_value(field, rng, depth))
            except (ValueError, TypeError):  # a value the field's type cannot hold
                pass
    return msg


def payload(cls, rng: random.Random) -> bytes:
    """Request bytes: random, a mutated hostile message, or a hostile message as it is."""
    kind = rng.randrange(3)
    if kind == 0:
        return rng.randbytes(rng.choice([0, 1, 5, 64, 1000]))
    data = bytearray(random_message(cls, rng).SerializeToString())
    if kind == 1 and data:
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            del data[rng.randrange(len(data)):]
    return bytes(data)


def call_raw(channel: grpc.Channel, path: str, method, data_list: list[bytes]) -> tuple[grpc.StatusCode, str]:
    """One call with raw request bytes; (status, details). Response streams are read to the end."""
    try:
        if method.client_streaming:
            channel.stream_unary(path)(iter(data_list), timeout=CALL_TIMEOUT_S)
        elif method.server_streaming:
            for _ in channel.unary_stream(path)(data_list[0], timeout=CALL_TIMEOUT_S):
                pass
        else:
            channel.unary_unary(path)(data_list[0], timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def fixed_answer(mesh) -> list[int]:
    g = random.Random(42)
    segs = [[g.randrange(1, 500) for _ in range(n)] for n in (30, 17)]
    with hypic.Client(mesh.router_address, timeout=120) as c:
        return c.generate(segments=segs, query=[5, 6, 7], max_tokens=4, stream=False).tokens


def test_fuzz_every_rpc_clean_statuses_live_processes_same_answer(mesh, fresh_seed: int) -> None:
    before = fixed_answer(mesh)
    rng = random.Random(fresh_seed)
    targets = []
    for kind, (module, service) in SERVICES.items():
        desc = module.DESCRIPTOR.services_by_name[service]
        names = [n for n in mesh.names if n.rstrip("0123456789") == kind]
        for method in desc.methods:
            cls = GetMessageClass(method.input_type)
            for name in names:
                targets.append((name, f"/{desc.full_name}/{method.name}", method, cls))
    channels = {name: grpc.insecure_channel(mesh[name].address) for name in mesh.names}
    unclean: list[str] = []
    calls = 0
    t0 = time.monotonic()
    try:
        for _ in range(20):  # every method, 20 rounds: 300 calls
            for name, path, method, cls in targets:
                n = rng.randint(1, 3) if method.client_streaming else 1
                code, details = call_raw(channels[name], path, method, [payload(cls, rng) for _ in range(n)])
                calls += 1
                if code not in CLEAN or any(s in details for s in LEAKS):
                    unclean.append(f"{name} {path}: {code.name} {details[:200]!r}")
    finally:
        for ch in channels.values():
            ch.close()
    # garbage on the raw ports
    for name, addr in mesh.addresses.items():
        host, port = addr.rsplit(":", 1)
        for prefix in (b"", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"):
            with socket.create_connection((host, int(port)), timeout=10) as s:
                try:
                    s.sendall(prefix + rng.randbytes(100_000))
                except OSError:
                    pass
    print(f"[fuzz] {calls} calls on {len(targets)} (service, method) pairs in "
          f"{time.monotonic() - t0:.1f} s; unclean: {len(unclean)}")
    assert not unclean, "\n".join(unclean[:30])
    assert calls >= 200
    time.sleep(0.5)
    assert mesh.dead() == []
    mesh.wait_healthy(timeout_s=30)
    assert fixed_answer(mesh) == before


# ---- the HTTP front ---------------------------------------------------------------------------------
HOSTILE = [None, True, False, -1, 0, 1, 2**31, 2**63, 2**64, 10**30, 1e308, -1e308, 1e-45,
           math.nan, math.inf, -math.inf, "", "x" * 20_000, "\u00e9\u2603\x00", "NaN", [], {},
           [1, 2, 3], [2**40], [-5], ["a", 1], {"a": 1}, [[[]]], list(range(300)),
           [{"role": "user", "content": 5}], [{"type": "image_url"}]]
RAW_BODIES = [b"", b"{", b'{"model": ', b"[]", b"null", b"1", b'"x"', b"\xff\xfe\x00{}",
              b"[" * 100_000 + b"]" * 100_000, b'{"max_tokens": ' + b"9" * 5000 + b"}",
              b'{"a": ' * 5000 + b"1" + b"}" * 5000, b'{"prompt": "a\\ud800b"}', b"NaN",
              b'{"prompt": "hello world", "max_tokens": 1e999}']
ERROR_KEYS = {"message", "type", "param", "code"}


def base_bodies(model: str) -> dict[str, dict]:
    return {"/v1/completions": {"model": model, "prompt": "the cat sat # # on the mat", "max_tokens": 2,
                                "temperature": 0},
            "/v1/chat/completions": {"model": model, "max_tokens": 2, "temperature": 0,
                                     "messages": [{"role": "system", "content": "be brief"},
                                                  {"role": "user", "content": "hello there"}]}}


def mutate(body: dict, rng: random.Random):
    """A hostile variant of a valid body: a value replaced (top level or nested), a field added
    or removed, or the hypic extension with hostile contents."""
    body = json.loads(json.dumps(body))
    kind = rng.randrange(5)
    if kind == 0:
        body[rng.choice(sorted(body))] = rng.choice(HOSTILE)
    elif kind == 1:
        body[rng.choice(["stream", "stream_options", "n", "seed", "stop", "top_p", "logprobs",
                         "frequency_penalty", "tools", "zzz_unknown", "max_completion_tokens",
                         "response_format", "user"])] = rng.choice(HOSTILE + [True, "stop"])
    elif kind == 2:
        del body[rng.choice(sorted(body))]
    elif kind == 3:
        body["hypic"] = {k: rng.choice(HOSTILE + [[[1, 2, 3], "doc"], "hypic", "FULL"])
                         for k in rng.sample(["segments", "query", "mode", "bogus"], rng.randint(1, 3))}
    elif "messages" in body:
        msg = body["messages"][-1]
        msg[rng.choice(["role", "content", "name"])] = rng.choice(HOSTILE)
    else:
        body["prompt"] = rng.choice(HOSTILE + [["a", "b"], [[1, 2]], " # # "])
    if rng.random() < 0.3:
        body["stream"] = True
    return body


def http_call(address: str, method: str, path: str, body: bytes | None,
              headers: dict[str, str]) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def unclean_answer(status: int, data: bytes) -> str | None:
    """Why an answer is not clean, or None."""
    text = data.decode("utf-8", "replace")
    if any(s in text for s in ("Traceback", 'File "')):
        return "a traceback in the body"
    if status == 200:
        return None
    if status == 500 or not 400 <= status < 600:
        return f"status {status}"
    try:
        err = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without OpenAI's error shape: {text[:120]!r}"
    if set(err) != ERROR_KEYS or not isinstance(err["message"], str) or not isinstance(err["type"], str):
        return f"{status} error of the wrong shape: {err!r:.160}"
    return None


def stream_events_clean(data: bytes) -> str | None:
    """A 200 stream: SSE data lines, each JSON (a chunk or an OpenAI error), ending with [DONE]."""
    lines = [ln for ln in data.decode().split("\n") if ln]
    if not lines or lines[-1] != "data: [DONE]":
        return f"stream does not end with [DONE]: {lines[-2:]!r}"
    for ln in lines[:-1]:
        obj = json.loads(ln.removeprefix("data: "))
        if "error" in obj and set(obj["error"]) != ERROR_KEYS:
            return f"error event of the wrong shape: {obj!r:.160}"
    return None


def front_answer(address: str, model: str) -> str:
    body = json.dumps({"model": model, "prompt": "one two # # three four", "max_tokens": 4,
                       "temperature": 0}).encode()
    status, data = http_call(address, "POST", "/v1/completions", body, {"content-type": "application/json"})
    assert status == 200, data
    return json.loads(data)["choices"][0]["text"]


def test_fuzz_the_front_clean_openai_errors_live_process_same_answer(mesh, fresh_seed: int) -> None:
    address = mesh["front"].address
    status, data = http_call(address, "GET", "/v1/models", None, {})
    model = json.loads(data)["data"][0]["id"]
    before = front_answer(address, model)
    rng = random.Random(fresh_seed)
    bases = base_bodies(model)
    unclean: list[str] = []
    statuses: dict[int, int] = {}
    t0 = time.monotonic()
    calls = []
    for _ in range(160):  # mutated bodies on both endpoints
        path = rng.choice(sorted(bases))
        body = mutate(bases[path], rng)
        calls.append(("POST", path, json.dumps(body).encode(), {"content-type": "application/json"}))
    for raw in RAW_BODIES:  # bodies that are not (sound) JSON
        calls.append(("POST", rng.choice(sorted(bases)), raw, {"content-type": "application/json"}))
    odd_headers = [{"content-type": "text/plain"}, {"x-request-id": "\u00e9" * 3},
                   {"x-request-id": "r" * 5000}, {"authorization": "Bearer \u00e9"},
                   {"content-type": "application/json; charset=latin-1"}]
    for h in odd_headers:
        path = rng.choice(sorted(bases))
        calls.append(("POST", path, json.dumps(bases[path]).encode(), h))
    for method, path in [("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"),
                         ("DELETE", "/v1/models"), ("POST", "/v1/models"), ("GET", "/v1/nothing"),
                         ("GET", "/" + "a" * 3000), ("POST", "/v1/completions/../models"),
                         ("GET", "/v1/completions?x=%ff%fe"), ("OPTIONS", "/v1/completions")]:
        calls.append((method, path, b"{}" if method != "GET" else None, {"content-type": "application/json"}))
    for method, path, body, headers in calls:
        try:
            status, data = http_call(address, method, path, body, headers)
        except (OSError, http.client.HTTPException) as e:
            unclean.append(f"{method} {path} {body[:80] if body else b''!r}: no answer ({type(e).__name__}: {e})")
            continue
        statuses[status] = statuses.get(status, 0) + 1
        why = unclean_answer(status, data)
        if why is None and status == 200 and b"text/event-stream" and data.startswith(b"data:"):
            why = stream_events_clean(data)
        if why is not None:
            unclean.append(f"{method} {path} {headers} {body[:120] if body else b''!r}..."
                           f"{body[-300:] if body else b''!r}: {why}")
    # raw bytes on the port: not HTTP, broken HTTP, an endless header
    host, port = address.rsplit(":", 1)
    for garbage in (rng.randbytes(50_000), b"GET / HTTP/1.1\r\n" + b"x" * 100_000 + b"\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n{",
                    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + rng.randbytes(200)):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            try:
                s.sendall(garbage)
                s.shutdown(socket.SHUT_WR)
                s.recv(1000)
            except OSError:
                pass
    print(f"\n[fuzz front] {len(calls)} requests in {time.monotonic() - t0:.1f} s; statuses "
          f"{dict(sorted(statuses.items()))}; unclean: {len(unclean)}")
    assert not unclean, "\n".join(unclean[:30])
    assert statuses.get(200, 0) >= 10 and sum(v for k, v in statuses.items() if 400 <= k < 500) >= 50
    assert mesh["front"].alive() and mesh.dead() == []
    assert front_answer(address, model) == before
