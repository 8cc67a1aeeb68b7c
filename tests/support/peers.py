"""Peers that are not Hypic services, for tests of how a service treats a bad neighbour: a port
nobody listens on, a port that accepts and never speaks, an HTTP/2 peer that is up but hung."""

from __future__ import annotations

import socket
import threading


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
