"""The router: its LPT planner and cost model (pure), and the service as real processes.

Combine and scatter are not needed here: the router is run against unreachable or silent
(black-hole) combine / segcache / scatter addresses, and a real segcache process for lookups.
What the router decided (hits, misses, workers) is read from its JSON log lines.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from common.engine.fingerprint import model_fingerprint, segment_key
from hypic.launcher import Service
from protos.hypic.v1 import router_pb2 as pb
from protos.hypic.v1 import router_pb2_grpc as pb_grpc
from services.router.config import RouterConfig
from services.router.planner import (CostModel, Job, Planner, contiguous, lpt, makespan,
                                     round_robin)

pytestmark = pytest.mark.timeout(180)

CORPUS = ["alice likes tea . bob likes milk . carol likes juice .",
          "the quick brown fox jumps over the lazy dog ."]


# ==== planner and cost model (pure) ==========================================================

def test_cost_model_prior_is_sane_before_data() -> None:
    cm = CostModel((0.02, 2e-4, 2e-9))
    assert cm.n == 0
    a, b, c = cm.coefficients
    assert math.isclose(a, 0.02, rel_tol=1e-6) and math.isclose(b, 2e-4, rel_tol=1e-6)
    assert math.isclose(c, 2e-9, rel_tol=1e-6)
    preds = [cm.predict(L) for L in (1, 16, 256, 4096, 32768)]
    assert all(p > 0 for p in preds) and preds == sorted(preds)
    assert cm.predict(0) == 0.0


def test_cost_model_fits_quadratic_online(fresh_seed: int) -> None:
    rng = random.Random(fresh_seed)
    true = (0.015, 3e-5, 4e-9)
    cm = CostModel()
    for _ in range(300):
        L = int(2 ** rng.uniform(4, 14))  # segment lengths span orders of magnitude
        t = (true[0] + true[1] * L + true[2] * L * L) * rng.uniform(0.97, 1.03)
        assert cm.observe(L, t)
    for L in (64, 1024, 4096, 16000):
        want = true[0] + true[1] * L + true[2] * L * L
        assert abs(cm.predict(L) - want) / want < 0.06, (L, cm.predict(L), want)
    assert all(c >= 0 for c in cm.coefficients)


def test_cost_model_ignores_bad_numbers_and_follows_one_length() -> None:
    cm = CostModel()
    for bad in [(0, 1.0), (100, 0.0), (100, -1.0), (100, float("nan")), (float("inf"), 1.0)]:
        assert not cm.observe(*bad)
    assert cm.n == 0
    for _ in range(50):
        cm.observe(100, 0.5)  # much slower than the prior at one length only
    assert abs(cm.predict(100) - 0.5) < 0.05
    assert cm.predict(1000) >= cm.predict(100) > cm.predict(10) > 0  # still increasing


def test_lpt_beats_round_robin_and_contiguous_on_skewed_lengths() -> None:
    # A RAG-like prompt: a few long documents next to each other, many short ones.
    lengths = [8192, 6144, 4096, 4096] + [256] * 20 + [2048, 1024] + [128] * 6
    cm = CostModel()
    costs = [cm.predict(L) for L in lengths]
    m = 4
    span = {name: makespan(costs, f(costs, m), m)
            for name, f in (("lpt", lpt), ("rr", round_robin), ("contiguous", contiguous))}
    lower = max(max(costs), sum(costs) / m)
    assert span["lpt"] < span["rr"] and span["lpt"] < span["contiguous"], span
    assert span["lpt"] <= 1.2 * lower, (span, lower)
    # The planner (load-aware LPT from an idle state) places exactly like lpt().
    p = Planner(m, cm)
    ticket = p.assign([Job(i, f"k{i}", L) for i, L in enumerate(lengths)])
    placed = [a.worker for a in ticket.assignments]
    assert math.isclose(makespan(costs, placed, m), span["lpt"])
    assert math.isclose(max(p.loads()), span["lpt"])


def test_lpt_list_scheduling_bound_random(fresh_seed: int) -> None:
    rng = random.Random(fresh_seed)
    for _ in range(200):
        m = rng.randint(1, 8)
        costs = [rng.paretovariate(1.2) for _ in range(rng.randint(1, 40))]
        span = makespan(costs, lpt(costs, m), m)
        assert span <= sum(costs) / m + (1 - 1 / m) * max(costs) + 1e-9
        assert span >= max(max(costs), sum(costs) / m) - 1e-9


def test_planner_load_aware_across_requests() -> None:
    p = Planner(2, CostModel((0.0, 1e-3, 0.0)))
    big = p.assign([Job(0, "big", 4000)])           # 4 s on worker 0
    assert big.assignments[0].worker == 0 and math.isclose(p.load(0), 4.0)
    small = p.assign([Job(i, f"s{i}", 1000) for i in range(4)])   # 4 × 1 s
    assert [a.worker for a in small.assignments] == [1, 1, 1, 1]  # fills up to the busy one
    assert math.isclose(p.load(1), 4.0)
    nxt = p.assign([Job(0, "n", 1000)])
    assert nxt.assignments[0].worker == 0            # tie on load: fewer builds wins
    # SegmentReady of the big one: its load leaves worker 0, the cost model learns.
    assert p.complete(big, "big", tokens=4000, build_s=3.0)
    assert p.cost.n == 1 and math.isclose(p.load(0), 1.0)
    for t in (big, small, nxt):
        p.release(t)
    assert p.loads() == [0.0, 0.0] and p.inflight_keys() == {}
    # What a worker reports (Scatter.Load) counts too; a down worker gets nothing.
    p.set_external_load(0, in_flight=3, queued_tokens=3000)
    assert [a.worker for a in p.assign([Job(0, "x", 10)]).assignments] == [1]
    p.set_external_load(0, 0, 0)
    p.mark_down(1)
    assert {a.worker for a in p.assign([Job(i, f"y{i}", 10) for i in range(3)]).assignments} == {0}
    p.mark_down(0)  # every worker down: still assign (combine falls back)
    assert len(p.assign([Job(0, "z", 10)]).assignments) == 1


def test_planner_single_flight() -> None:
    p = Planner(3, CostModel((0.0, 1e-3, 0.0)))
    a = p.assign([Job(0, "K", 2000), Job(1, "A", 500)])
    wk = a.assignments[0].worker
    loads_before = p.loads()
    b = p.assign([Job(0, "B", 500), Job(1, "K", 2000), Job(2, "K", 2000)])  # K twice, in flight
    k_b = [x for x in b.assignments if x.key == "K"]
    assert all(x.worker == wk and x.shared for x in k_b)
    assert sum(p.loads()) == pytest.approx(sum(loads_before) + 0.5)  # only B added load
    # Duplicates inside one new request share one build too.
    c = p.assign([Job(0, "D", 700), Job(1, "D", 700)])
    assert c.assignments[0].worker == c.assignments[1].worker
    assert not c.assignments[0].shared and c.assignments[1].shared
    # The request that started K goes away: K stays in flight for b.
    p.release(a)
    assert p.inflight_keys()["K"] == wk
    # b's SegmentReady for K retires it and feeds the model once; a second report does not.
    assert p.complete(b, "K", tokens=2000, build_s=1.7)
    assert not p.complete(b, "K", tokens=2000, build_s=1.7)
    assert "K" not in p.inflight_keys() and p.cost.n == 1
    # A new request for K after completion is a fresh placement (segcache will have it).
    d = p.assign([Job(0, "K", 2000)])
    assert not d.assignments[0].shared
    for t in (b, c, d):
        p.release(t)
    assert p.inflight_keys() == {} and p.loads() == [0.0, 0.0, 0.0]


def test_router_config_from_flags_and_env() -> None:
    from common.mesh.config import ConfigError, load_config

    cfg = load_config(RouterConfig, ["--scatter-addresses", "a:1, b:2", "--seam", "4"],
                      env={"HYPIC_ROUTER_COMBINE_ADDRESSES": "c:3,d:4",
                           "HYPIC_ROUTER_MAX_IN_FLIGHT": "7"}, env_prefix="HYPIC_ROUTER_")
    assert cfg.scatters == ["a:1", "b:2"] and cfg.combines == ["c:3", "d:4"]
    assert cfg.seam == 4 and cfg.max_in_flight == 7
    with pytest.raises(ConfigError):
        load_config(RouterConfig, ["--combine-addresses", ""], env={}, env_prefix="HYPIC_ROUTER_")
    with pytest.raises(ConfigError):
        load_config(RouterConfig, ["--dtype", "int8"], env={}, env_prefix="HYPIC_ROUTER_")


# ==== the router as a process ================================================================

def make_tiny_model(out: Path) -> Path:
    """A tiny random Qwen3.5 checkpoint (tests/support/tiny.py) with a small byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.support.tiny import QWEN_BASE, save_tiny

    save_tiny("qwen3_5_text", out, **QWEN_BASE)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out)
    return out


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class BlackHole:
    """A TCP port that accepts connections (kernel backlog) and never says a word."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


class HungHttp2:
    """An HTTP/2 endpoint that completes the connection handshake (SETTINGS, PING acks) and
    then never answers a request: a peer that is up but hung. Not a mock of any Hypic service:
    it speaks no gRPC method at all."""

    def __init__(self):
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @staticmethod
    def _frame(ftype: int, flags: int, payload: bytes = b"") -> bytes:
        return len(payload).to_bytes(3, "big") + bytes([ftype, flags]) + b"\0\0\0\0" + payload

    def _accept(self) -> None:
        import threading

        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            conn.sendall(self._frame(0x4, 0))  # our (empty) SETTINGS
            preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                if buf.startswith(preface):
                    buf = buf[len(preface):]
                while len(buf) >= 9:
                    n = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + n:
                        break
                    ftype, flags, payload = buf[3], buf[4], buf[9:9 + n]
                    buf = buf[9 + n:]
                    if ftype == 0x4 and not flags & 1:
                        conn.sendall(self._frame(0x4, 1))           # SETTINGS ack
                    elif ftype == 0x6 and not flags & 1:
                        conn.sendall(self._frame(0x6, 1, payload))  # PING ack
        except OSError:
            return

    def close(self) -> None:
        self._closed = True
        self.sock.close()
        for c in self.conns:
            c.close()


def log_events(svc: Service, event: str, request_id: str | None = None) -> list[dict]:
    out = []
    for line in svc.log().splitlines():
        if not line.startswith("{"):
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("event") == event and (request_id is None or d.get("request_id") == request_id):
            out.append(d)
    return out


def wait_log(svc: Service, event: str, request_id: str, timeout: float = 5.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = log_events(svc, event, request_id)
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"no {event!r} log line for {request_id}:\n{svc.log_tail()}")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """segcache (real) and two routers:
    A: combines [refused port, black hole], scatter workers on refused ports, the real segcache;
    B: a hung combine (HTTP/2 up, never answers), a black-hole segcache, max_in_flight 2."""
    base = tmp_path_factory.mktemp("router")
    model = make_tiny_model(base / "model")
    hole_c, hole_s, hung = BlackHole(), BlackHole(), HungHttp2()
    run, logs = base / "run", base / "logs"
    seg = Service("segcache", "segcache", ["--data-dir", str(base / "lmdb"), "--host-bytes",
                                           "16MiB", "--disk-bytes", "64MiB", "--no-nixl"],
                  run, logs)
    seg.start()
    seg.wait_ready(time.monotonic() + 60)
    common = ["--model", str(model), "--log-level", "debug", "--load-poll-s", "0.2"]
    ra = Service("routerA", "router", common + [
        "--combine-addresses", f"127.0.0.1:{closed_port()},{hole_c.address}",
        "--segcache-address", seg.address,
        "--scatter-addresses", f"127.0.0.1:{closed_port()},127.0.0.1:{closed_port()}",
        "--max-prompt-tokens", "64", "--metrics-port", "0"], run, logs)
    rb = Service("routerB", "router", common + [
        "--combine-addresses", hung.address, "--segcache-address", hole_s.address,
        "--lookup-timeout-s", "0.3", "--max-in-flight", "2"], run, logs)
    ra.start()
    rb.start()
    try:
        deadline = time.monotonic() + 90
        ra.wait_ready(deadline)
        rb.wait_ready(deadline)
        yield {"model": model, "segcache": seg, "a": ra, "b": rb, "hole": hole_c.address}
        for svc in (ra, rb, seg):  # graceful shutdown on SIGTERM
            assert svc.stop(grace_s=15) == 0, svc.log_tail()
    finally:
        for svc in (ra, rb, seg):
            svc.stop(grace_s=5)
        for h in (hole_c, hole_s, hung):
            h.close()


def stub(svc: Service) -> pb_grpc.RouterStub:
    return pb_grpc.RouterStub(grpc.insecure_channel(svc.address))


def call(svc: Service, req: pb.GenerateRequest, timeout: float = 10.0,
         rid: str | None = None) -> tuple[grpc.StatusCode, str, float]:
    md = [("x-request-id", rid)] if rid else None
    t = time.monotonic()
    try:
        list(stub(svc).Generate(req, timeout=timeout, metadata=md))
    except grpc.RpcError as e:
        return e.code(), e.details(), time.monotonic() - t
    return grpc.StatusCode.OK, "", time.monotonic() - t


def seg(text: str = "", ids=()) -> pb.Segment:
    return pb.Segment(text=text, token_ids=list(ids))


def test_info_and_fingerprint_contract(mesh) -> None:
    info = stub(mesh["a"]).Info(pb.InfoRequest(), timeout=5)
    fp = model_fingerprint(mesh["model"])
    assert info.model_fingerprint == fp == mesh["a"].info["fingerprint"]
    assert info.vocab_size == 512 and info.model_type == "qwen3_5_text"
    assert info.seam == 8 and info.dtype == "float32" and info.max_prompt_tokens == 64
    assert info.segcache_address == mesh["segcache"].address
    assert len(info.scatter_addresses) == 2 and len(info.combine_addresses) == 2
    # The engine (scatter, combine) reads the same checkpoint as the same fingerprint.
    from common.engine.hybrid_engine import HybridEngine
    assert HybridEngine.from_pretrained(Path(mesh["model"])).fingerprint == fp


def test_segment_key_is_stable_and_covers_every_field() -> None:
    """Keys are content addresses kept in LMDB across versions: a change of the function would
    orphan every cached entry, so its value is pinned; and each input must change the key."""
    fp, ids = "f" * 64, [3, 1, 4, 1, 5, 9, 2, 6]
    key = segment_key(fp, 8, "float32", ids)
    assert key == "814f60edc9f7b1f04864d5d004fd8603187e4d09"
    variants = [segment_key("e" + fp[1:], 8, "float32", ids), segment_key(fp, 0, "float32", ids),
                segment_key(fp, 8, "bfloat16", ids), segment_key(fp, 8, "float32", ids[:-1]),
                segment_key(fp, 8, "float32", ids[::-1]), segment_key(fp, 8, "float32", ids + [0])]
    assert len({key, *variants}) == 1 + len(variants)


@pytest.mark.parametrize("name,req", [
    ("no segments", pb.GenerateRequest(query=seg("hi"), max_tokens=1)),
    ("empty segment", pb.GenerateRequest(segments=[seg("a"), seg()], query=seg("q"), max_tokens=1)),
    ("empty query", pb.GenerateRequest(segments=[seg("a")], max_tokens=1)),
    ("id >= vocab", pb.GenerateRequest(segments=[seg(ids=[1, 512])], query=seg("q"), max_tokens=1)),
    ("max_tokens 0", pb.GenerateRequest(segments=[seg("a")], query=seg("q"), max_tokens=0)),
    ("over max_prompt_tokens", pb.GenerateRequest(segments=[seg(ids=[1] * 40), seg(ids=[2] * 20)],
                                                  query=seg(ids=[3] * 5), max_tokens=1)),
    ("text over max_prompt_tokens", pb.GenerateRequest(segments=[seg("alice " * 100)],
                                                       query=seg("q"), max_tokens=1)),
    ("mixed", pb.GenerateRequest(segments=[seg("abc", ids=[1, 2])], query=seg("q"), max_tokens=1)),
    ("unknown mode", pb.GenerateRequest(segments=[seg("a")], query=seg("q"), max_tokens=1, mode=9)),
    ("nan temperature", pb.GenerateRequest(segments=[seg("a")], query=seg("q"), max_tokens=1,
                                           temperature=float("nan"))),
    ("max_tokens over limit", pb.GenerateRequest(segments=[seg("a")], query=seg("q"),
                                                 max_tokens=100_000)),
    ("denormal temperature", pb.GenerateRequest(segments=[seg("a")], query=seg("q"), max_tokens=1,
                                                temperature=1e-45)),
    ("inf temperature", pb.GenerateRequest(segments=[seg("a")], query=seg("q"), max_tokens=1,
                                           temperature=float("inf"))),
])
def test_invalid_arguments(mesh, name, req) -> None:
    code, details, dt = call(mesh["a"], req)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
    assert dt < 2.0


# Field 1, length-delimited, announcing 127 bytes that never come: no message decodes from it.
UNDECODABLE = b"\x0a\x7f\x01"


def test_undecodable_bytes_are_invalid_argument_on_router_and_segcache(mesh) -> None:
    with grpc.insecure_channel(mesh["a"].address) as ch:
        gen = ch.unary_stream("/hypic.v1.Router/Generate")
        with pytest.raises(grpc.RpcError) as e:
            list(gen(UNDECODABLE, timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert ch.unary_unary("/hypic.v1.Router/Info")(b"", timeout=10)  # still serving
    with grpc.insecure_channel(mesh["segcache"].address) as ch:
        for method, kind in (("Lookup", "unary_unary"), ("Get", "unary_stream"), ("Put", "stream_unary"),
                             ("Delete", "unary_unary"), ("Pin", "unary_unary")):
            rpc = getattr(ch, kind)(f"/hypic.v1.Segcache/{method}")
            arg = iter([UNDECODABLE]) if kind == "stream_unary" else UNDECODABLE
            with pytest.raises(grpc.RpcError) as e:
                out = rpc(arg, timeout=10)
                if kind == "unary_stream":
                    list(out)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())


def test_client_messages_carry_no_addresses_and_request_ids_are_ascii(mesh) -> None:
    """A non-ASCII request id is cleaned (not INTERNAL); the UNAVAILABLE answer names no internal
    address (they are in the log, under the request id)."""
    req = pb.GenerateRequest(segments=[seg(ids=[1, 2, 3])], query=seg(ids=[4]), max_tokens=1,
                             request_id="r\u00e9q-\u2603-\x07id")
    code, details, _ = call(mesh["a"], req, timeout=2.0)
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "127.0.0.1" not in details and mesh["hole"] not in details
    assert "rq--id" in details  # the cleaned id, to find the log lines by
    assert wait_log(mesh["a"], "combine unavailable; trying the next", "rq--id")


def test_invalid_modes_share_one_metric_label(mesh) -> None:
    for mode in (9, 17, 1000, 2**31 - 1):
        code, _, _ = call(mesh["a"], pb.GenerateRequest(segments=[seg("a")], query=seg("q"),
                                                         max_tokens=1, mode=mode))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    port = mesh["a"].info["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    modes = {line.split('mode="', 1)[1].split('"', 1)[0] for line in text.splitlines()
             if line.startswith("hypic_router_requests_total{")}
    assert "unknown" in modes and modes <= {"unknown", "full", "prefix", "additive", "hypic"}, modes


def test_unreachable_combines_unavailable_within_deadline_and_lookup_hits_planned(mesh) -> None:
    """A real segcache holds one of two segments: the router plans 2 hits + 1 miss (assigned to
    a scatter worker), tries both combines (one refuses, one never completes a connection) and
    answers UNAVAILABLE before the client's deadline."""
    from common.mesh.segcache_client import SegcacheClient

    fp = model_fingerprint(mesh["model"])
    cached, fresh = [5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]
    key = segment_key(fp, 8, "float32", cached)

    async def put() -> None:
        async with SegcacheClient(mesh["segcache"].address) as sc:
            await sc.put(key, b"entry-bytes", recompute_cost_s=0.1, token_count=len(cached),
                         model_fingerprint=fp)

    asyncio.run(put())
    rid = "rid-hit-plan"
    req = pb.GenerateRequest(segments=[seg(ids=cached), seg(ids=fresh), seg(ids=cached)],
                             query=seg("bob likes"), max_tokens=4)
    code, details, dt = call(mesh["a"], req, timeout=2.0, rid=rid)
    assert code == grpc.StatusCode.UNAVAILABLE, details
    assert "no combine service available" in details and dt < 2.0
    tried = {d["combine"] for d in wait_log(mesh["a"], "combine unavailable; trying the next", rid)}
    assert len(tried) == 2 and mesh["hole"] in tried
    planned = wait_log(mesh["a"], "planned", rid)[0]
    assert planned["hits"] == 2 and planned["misses"] == 1 and len(planned["workers"]) == 1
    assert planned["prompt_tokens"] > 2 * len(cached) + len(fresh)  # + the tokenized query
    # ADDITIVE keys use seam 0, so the seam-8 entry is not a hit there; FULL does no lookup.
    for mode, rid2, hits in ((pb.PREFILL_MODE_ADDITIVE, "rid-additive", 0),
                             (pb.PREFILL_MODE_FULL, "rid-full", None)):
        req.mode = mode
        code, _, dt = call(mesh["a"], req, timeout=1.0, rid=rid2)
        assert code == grpc.StatusCode.UNAVAILABLE and dt < 1.0
        lines = log_events(mesh["a"], "planned", rid2)
        if hits is None:
            assert lines == []
        else:
            assert lines and lines[0]["hits"] == hits and lines[0]["misses"] == 3


def test_slow_segcache_and_hung_combine(mesh) -> None:
    """Router B: segcache never answers (lookup budget 0.3 s → all misses, logged, not fatal);
    the combine accepts the call and never answers → DEADLINE_EXCEEDED at the client's deadline."""
    rid = "rid-hung"
    req = pb.GenerateRequest(segments=[seg("alice likes tea")], query=seg("bob"), max_tokens=2)
    code, details, dt = call(mesh["b"], req, timeout=1.5, rid=rid)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (code, details)
    assert dt < 2.5
    assert wait_log(mesh["b"], "segcache lookup failed; serving every segment as a miss", rid)
    assert wait_log(mesh["b"], "planned", rid)[0]["misses"] == 1


def test_resource_exhausted_and_cancellation(mesh) -> None:
    """max_in_flight 2: two hanging requests fill the router, a third is refused; cancelling
    the two frees the slots (the router notices the client went away)."""
    ch = grpc.insecure_channel(mesh["b"].address)
    s = pb_grpc.RouterStub(ch)
    req = pb.GenerateRequest(segments=[seg(ids=[1, 2, 3])], query=seg(ids=[4]), max_tokens=2)
    hanging = [s.Generate(req, timeout=60) for _ in range(2)]
    time.sleep(1.0)  # both past the lookup (0.3 s) and waiting on the hung combine
    code, details, dt = call(mesh["b"], req, timeout=5)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert dt < 1.0
    for h in hanging:
        h.cancel()
    deadline = time.monotonic() + 5
    while True:  # in-flight slots come back once the router sees the cancellations
        code, details, _ = call(mesh["b"], req, timeout=1.0)
        if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            break
        assert time.monotonic() < deadline, "cancelled requests still hold their slots"
        time.sleep(0.1)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(log_events(mesh["b"], "request cancelled")) >= 2
    ch.close()


def test_garbage_bytes_do_not_kill_the_router(mesh) -> None:
    host, port = mesh["a"].address.rsplit(":", 1)
    junk = random.Random(1).randbytes(10 << 20)
    for payload in (junk, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + junk[: 1 << 20]):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            try:
                s.sendall(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server hung up on us: fine
    assert mesh["a"].alive()
    info = stub(mesh["a"]).Info(pb.InfoRequest(), timeout=5)
    assert info.vocab_size == 512
    code, _, _ = call(mesh["a"], pb.GenerateRequest(query=seg("x"), max_tokens=1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_health_metrics_and_request_ids(mesh) -> None:
    from hypic.healthcheck import check, status

    assert check(mesh["a"].address)
    assert status(mesh["a"].address, "hypic.v1.Router") == "SERVING"
    assert status(f"127.0.0.1:{closed_port()}", timeout=0.5) == "UNAVAILABLE"
    rid = "rid-metrics-1"
    call(mesh["a"], pb.GenerateRequest(segments=[seg("a")], query=seg("q"), max_tokens=0), rid=rid)
    failed = wait_log(mesh["a"], "request failed", rid)[0]
    assert failed["code"] == "INVALID_ARGUMENT" and failed["service"] == "router"
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{mesh['a'].info['metrics_port']}/metrics", timeout=5).read().decode()
    assert 'hypic_router_requests_total{code="INVALID_ARGUMENT",mode="hypic"}' in body
    assert "hypic_router_cost_model" in body
    assert 'hypic_rpc_total{code="OK",method="Info",service="router"}' in body
