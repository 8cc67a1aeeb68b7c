"""The routers behind the front, reached through the SDK's AsyncClient (the gRPC contract):
round-robin, and the next router when one is unreachable before the first token."""

from __future__ import annotations

import asyncio
from typing import Any

import hypic
from hypic import errors


class RouterPool:
    def __init__(self, addresses: list[str], timeout_s: float, tls_ca=None, api_key: str = "",
                 tls_cert=None, tls_key=None):
        self.addresses = addresses
        self.timeout_s = timeout_s
        # the front is the routers' client: TLS, its certificate (for routers that require one:
        # mutual TLS) and the API key as any SDK user passes them
        secure = tls_ca is not None
        self.credentials = hypic.Credentials(
            tls=secure, tls_ca=tls_ca, tls_cert=tls_cert if secure else None,
            tls_key=tls_key if secure else None, api_key=api_key or None)
        self.clients: list[hypic.AsyncClient] = []
        self._next = 0

    def start(self) -> None:
        """Create the channels (inside the running event loop)."""
        self.clients = [hypic.AsyncClient(a, timeout=self.timeout_s, credentials=self.credentials)
                        for a in self.addresses]

    async def close(self) -> None:
        for c in self.clients:
            await c.close()

    def order(self) -> list[hypic.AsyncClient]:
        n = len(self.clients)
        self._next = (self._next + 1) % n
        return [self.clients[(self._next + i) % n] for i in range(n)]

    async def open(self, **kwargs: Any) -> tuple[hypic.client.AsyncTokenStream, Any]:
        """A started generation and its first Token (None when it produced none). Raises the
        SDK's typed error; Unavailable only when no router could take the request."""
        last: errors.HypicError | None = None
        for client in self.order():
            stream = client.generate(stream=True, **kwargs)
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                return stream, None
            except errors.Unavailable as e:
                stream.cancel()
                last = e
                continue
            except BaseException:
                stream.cancel()
                raise
            return stream, first
        raise last or errors.Unavailable("no router configured")

    async def info(self, timeout: float = 2.0) -> hypic.client.Info | None:
        """The first router's Info that answers, or None."""
        for client in self.order():
            try:
                return await client.info(timeout=timeout)
            except errors.HypicError:
                continue
        return None

    async def info_each(self, timeout: float = 2.0) -> list[tuple[str, hypic.client.Info | None]]:
        """Every router's Info, asked at once: (address, Info, or None where it did not answer)."""
        async def one(client: hypic.AsyncClient) -> hypic.client.Info | None:
            try:
                return await client.info(timeout=timeout)
            except errors.HypicError:
                return None
        infos = await asyncio.gather(*(one(c) for c in self.clients))
        return list(zip(self.addresses, infos))
