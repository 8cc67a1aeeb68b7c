"""A bounded fuzz of the mesh (issue 14 item 9): a few hundred calls on every RPC of the four
services — random bytes, mutated valid messages, messages with hostile field values, garbage on
the raw ports — each must end in a clean status (never UNKNOWN or INTERNAL, no exception text),
every process must live, and the answer to a fixed request must be the same afterwards.

Real processes on 127.0.0.1 (hypic.launcher.Mesh); the seed is fresh each run (printed)."""
from __future__ import annotations

import math
import random
import socket
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message_factory import GetMessageClass

import hypic
from hypic.launcher import Mesh
from protos.hypic.v1 import combine_pb2, router_pb2, scatter_pb2, segcache_pb2
from tiny import PIC_CONFIGS, save_tiny

pytestmark = pytest.mark.timeout(600)
SEAM = 8
CALL_TIMEOUT_S = 5.0
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS,
         grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.CANCELLED}
LEAKS = ("Traceback", "Unexpected <class", "Error:", "Exception", "File \"")
SERVICES = {"router": (router_pb2, "Router"), "combine": (combine_pb2, "Combine"),
            "scatter": (scatter_pb2, "Scatter"), "segcache": (segcache_pb2, "Segcache")}

INTS = [0, 1, 2, 7, 255, 2**31 - 1, 2**31, 2**32 - 1]
INTS64 = INTS + [2**63 - 1, 2**64 - 1]
FLOATS = [0.0, -1.0, 1e-45, 1e-30, 0.5, 1e38, math.inf, -math.inf, math.nan]
STRINGS = ["", "a", "ab" * 20, "\u00e9\u2603\x00", "x" * 600, "127.0.0.1:1", "../../etc/passwd"]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    model = save_tiny("qwen3_5_text", tmp_path_factory.mktemp("model"), seed=5,
                      **PIC_CONFIGS["qwen3_5_text"])
    with Mesh(model, tmp_path_factory.mktemp("data"), n_scatter=1, threads=1, seam=SEAM,
              start_timeout_s=180, extra_args={"router": ["--max-prompt-tokens", "512"],
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
