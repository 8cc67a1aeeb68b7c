"""Malformed HTTP/2 and HTTP/1.1 traffic written byte by byte (no h2 library: the frames are
few and simple), for the tests that a service answers it and logs it at most once per connection.

    http2_reset_storm(port, "/hypic.v1.Segcache/Put", 500)   # HEADERS + RST_STREAM pairs
    http11_smuggle(port, "/v1/completions")                  # Content-Length and chunked together
"""
from __future__ import annotations

import socket
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x7
END_STREAM, END_HEADERS = 0x1, 0x4
CANCEL = 0x8


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _hpack_string(text: str) -> bytes:
    raw = text.encode()
    assert len(raw) < 127, "one-byte lengths only"
    return bytes([len(raw)]) + raw


def hpack_literals(headers: list[tuple[str, str]]) -> bytes:
    """Headers as HPACK literals without indexing, new names, no Huffman (RFC 7541 6.2.2)."""
    return b"".join(b"\x00" + _hpack_string(k) + _hpack_string(v) for k, v in headers)


def grpc_headers(path: str, authority: str) -> bytes:
    return hpack_literals([(":method", "POST"), (":scheme", "http"), (":path", path),
                           (":authority", authority), ("content-type", "application/grpc"),
                           ("te", "trailers")])


def http2_reset_storm(port: int, path: str, pairs: int, host: str = "127.0.0.1") -> bytes:
    """One connection: `pairs` streams, each opened with HEADERS and reset (CANCEL) at once; then
    GOAWAY. Returns what the server sent back (read until it closes or goes quiet)."""
    block = grpc_headers(path, f"{host}:{port}")
    out = [PREFACE, frame(SETTINGS, 0, 0, b"")]
    for i in range(pairs):
        stream = 2 * i + 1
        out.append(frame(HEADERS, END_HEADERS, stream, block))
        out.append(frame(RST_STREAM, 0, stream, struct.pack(">I", CANCEL)))
    out.append(frame(GOAWAY, 0, 0, struct.pack(">II", 2 * pairs - 1, 0)))
    return exchange(host, port, b"".join(out))


def http11_smuggle(port: int, path: str, host: str = "127.0.0.1") -> bytes:
    """A POST with both Content-Length and Transfer-Encoding: chunked (RFC 9112 6.1: malformed)."""
    body = b"5\r\nhello\r\n0\r\n\r\n"
    req = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(body)}\r\nTransfer-Encoding: chunked\r\n\r\n").encode() + body
    return exchange(host, port, req)


def exchange(host: str, port: int, data: bytes, quiet_s: float = 2.0) -> bytes:
    got = bytearray()
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(data)
        s.settimeout(quiet_s)
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    return bytes(got)
