"""The Hypic client SDK: a thin typed layer over the router's gRPC API (hypic.v1.Router).

    import hypic

    with hypic.Client("127.0.0.1:50051") as client:
        result = client.generate(segments=["doc one ...", "doc two ..."], query="question?",
                                 max_tokens=32, stream=False)
        print(result.text, result.timings.ttft_s)

        stream = client.generate(segments=[[1, 2, 3], "text"], query=[4, 5], max_tokens=8)
        for tok in stream:                      # Token(id, text, index, logits)
            print(tok.text, end="")
        print(stream.timings)                   # final Timings once the stream is done

    async with hypic.AsyncClient("127.0.0.1:50051") as client:
        result = await client.generate(segments=[...], query="...", stream=False)
        async for tok in client.generate(segments=[...], query="...", stream=True):
            ...

A secured router (docs/security.md): Client(address, tls_ca="ca.pem", tls_cert=..., tls_key=...,
api_key=...) or Client(address, credentials=hypic.Credentials(...)).

Segments and the query are text (tokenized by the router) or token-id lists. gRPC errors are
raised as the typed exceptions of hypic.errors (InvalidArgument, ResourceExhausted,
Unavailable, DeadlineExceeded, ...). With stream=True they are raised while iterating.
"""

from __future__ import annotations

import os
from typing import Any, AsyncIterator, Iterator, Sequence

import grpc

from hypic import errors
from hypic.credentials import AUTHORIZATION_KEY, REQUEST_ID_KEY, Credentials, channel_options  # noqa: F401
from hypic.messages import (MODE_NAMES, MODES, Accumulator, GenerateResult, Info,  # noqa: F401
                            SegmentLike, SegmentTrace, Served, Timings, Token, build_request)
from hypic.targets import channel_target
from protos.hypic.v1 import router_pb2 as router_pb
from protos.hypic.v1 import router_pb2_grpc as router_grpc

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


# ---- synchronous client ------------------------------------------------------------------------

class TokenStream:
    """Iterator of Token for one streamed generation. `timings` holds the latest Timings (the
    first after the first token, the final one once iteration ends) and `served` how the request
    is served (known with that first Timings); `read_timings()` reads on to it without handing
    out tokens. `result()` drains the rest. Leaving a `with` block or calling cancel() before the
    end cancels the request."""

    def __init__(self, call: Any, request_id: str):
        self._call = call
        self._acc = Accumulator(request_id)

    @property
    def request_id(self) -> str:
        return self._acc.request_id

    @property
    def timings(self) -> Timings | None:
        return self._acc.timings

    @property
    def tokens(self) -> list[int]:
        return list(self._acc.tokens)

    @property
    def text(self) -> str:
        return self._acc.text

    @property
    def done(self) -> bool:
        return self._acc.done

    @property
    def served(self) -> Served | None:
        """How the request is served (reused, built, recomputed, seam, mode, shadowed); None
        before the first Timings."""
        return self._acc.timings.served if self._acc.timings is not None else None

    def __iter__(self) -> Iterator[Token]:
        return self

    def _read(self) -> Token | None:
        """Feed the next event; its Token, if it was one. StopIteration at the end."""
        try:
            ev = next(self._call)
        except StopIteration:
            self._acc.done = True
            raise
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, self.request_id) from None
        return self._acc.feed(ev)

    def __next__(self) -> Token:
        if self._acc.pending:
            return self._acc.pending.popleft()
        while True:
            tok = self._read()
            if tok is not None:
                return tok

    def read_timings(self) -> Timings | None:
        """Read on until a Timings has arrived (the router sends one right after the first
        token), keeping any token read meanwhile for the iteration; the Timings, or None when
        the stream ended without one."""
        while self._acc.timings is None:
            try:
                tok = self._read()
            except StopIteration:
                break
            if tok is not None:
                self._acc.pending.append(tok)
        return self._acc.timings

    def result(self) -> GenerateResult:
        for _ in self:
            pass
        return self._acc.result()

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> "TokenStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._acc.done:
            self.cancel()


class Client:
    """Synchronous client of a Hypic router."""

    def __init__(self, address: str, *, timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 channel: grpc.Channel | None = None, tls: bool = False,
                 tls_ca: str | os.PathLike[str] | None = None,
                 tls_cert: str | os.PathLike[str] | None = None,
                 tls_key: str | os.PathLike[str] | None = None, api_key: str | None = None,
                 credentials: Credentials | None = None):
        self.address = address
        self.timeout = timeout
        self.credentials = credentials or Credentials(tls, tls_ca, tls_cert, tls_key, api_key)
        self._channel = channel or self.credentials.open(
            channel_target(address), channel_options(max_message_bytes), aio=False)
        self._stub = router_grpc.RouterStub(self._channel)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def wait_ready(self, timeout: float = 10.0) -> None:
        """Block until the channel is connected (Unavailable after `timeout` seconds)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise errors.Unavailable(f"{self.address} not reachable within {timeout} s") from None

    def info(self, *, timeout: float | None = None) -> Info:
        try:
            return Info.from_proto(self._stub.Info(router_pb.InfoRequest(),
                                                   timeout=self._timeout(timeout) or 10.0,
                                                   metadata=self.credentials.metadata()))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def generate(self, segments: Sequence[SegmentLike], query: SegmentLike, max_tokens: int = 16,
                 *, stream: bool = True, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0,
                 mode: str = "hypic", timeout: float | None = None, return_logits: bool = False,
                 stop_at_eos: bool = True, request_id: str | None = None, keep_whole: bool = False
                 ) -> TokenStream | GenerateResult:
        """stream=True: a TokenStream (iterate it for Token events); stream=False: block until
        the generation ends and return a GenerateResult(tokens, text, timings, logits)."""
        req = build_request(segments, query, max_tokens=max_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, mode=mode,
                            return_logits=return_logits,
                            stop_at_eos=stop_at_eos, request_id=request_id, keep_whole=keep_whole)
        call = self._stub.Generate(req, timeout=self._timeout(timeout),
                                   metadata=self.credentials.metadata(req.request_id))
        ts = TokenStream(call, req.request_id)
        if stream:
            return ts
        with ts:
            return ts.result()


# ---- asyncio client ----------------------------------------------------------------------------

class AsyncTokenStream:
    """Async iterator of Token; see TokenStream. `await stream.result()` drains the rest."""

    def __init__(self, call: Any, request_id: str):
        self._call = call
        self._acc = Accumulator(request_id)
        self._it: AsyncIterator | None = None

    request_id = TokenStream.request_id
    timings = TokenStream.timings
    tokens = TokenStream.tokens
    text = TokenStream.text
    done = TokenStream.done
    served = TokenStream.served

    def __aiter__(self) -> "AsyncTokenStream":
        return self

    async def _read(self) -> Token | None:
        """Feed the next event; its Token, if it was one. StopAsyncIteration at the end."""
        if self._it is None:
            self._it = self._call.__aiter__()
        try:
            ev = await self._it.__anext__()
        except StopAsyncIteration:
            self._acc.done = True
            raise
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, self.request_id) from None
        return self._acc.feed(ev)

    async def __anext__(self) -> Token:
        if self._acc.pending:
            return self._acc.pending.popleft()
        while True:
            tok = await self._read()
            if tok is not None:
                return tok

    async def read_timings(self) -> Timings | None:
        """See TokenStream.read_timings."""
        while self._acc.timings is None:
            try:
                tok = await self._read()
            except StopAsyncIteration:
                break
            if tok is not None:
                self._acc.pending.append(tok)
        return self._acc.timings

    async def result(self) -> GenerateResult:
        async for _ in self:
            pass
        return self._acc.result()

    def cancel(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> "AsyncTokenStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if not self._acc.done:
            self.cancel()


class AsyncClient:
    """asyncio client of a Hypic router (grpc.aio). Create it inside a running event loop."""

    def __init__(self, address: str, *, timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 channel: grpc.aio.Channel | None = None, tls: bool = False,
                 tls_ca: str | os.PathLike[str] | None = None,
                 tls_cert: str | os.PathLike[str] | None = None,
                 tls_key: str | os.PathLike[str] | None = None, api_key: str | None = None,
                 credentials: Credentials | None = None):
        self.address = address
        self.timeout = timeout
        self.credentials = credentials or Credentials(tls, tls_ca, tls_cert, tls_key, api_key)
        self._channel = channel or self.credentials.open(
            channel_target(address), channel_options(max_message_bytes), aio=True)
        self._stub = router_grpc.RouterStub(self._channel)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def wait_ready(self, timeout: float = 10.0) -> None:
        import asyncio

        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            raise errors.Unavailable(f"{self.address} not reachable within {timeout} s") from None

    async def info(self, *, timeout: float | None = None) -> Info:
        try:
            return Info.from_proto(await self._stub.Info(router_pb.InfoRequest(),
                                                         timeout=self._timeout(timeout) or 10.0,
                                                         metadata=self.credentials.metadata()))
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def generate(self, segments: Sequence[SegmentLike], query: SegmentLike, max_tokens: int = 16,
                 *, stream: bool = True, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0,
                 mode: str = "hypic", timeout: float | None = None, return_logits: bool = False,
                 stop_at_eos: bool = True, request_id: str | None = None, keep_whole: bool = False):
        """stream=True: an AsyncTokenStream (`async for tok in ...`); stream=False: a coroutine
        of GenerateResult (`await client.generate(..., stream=False)`)."""
        req = build_request(segments, query, max_tokens=max_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, mode=mode,
                            return_logits=return_logits,
                            stop_at_eos=stop_at_eos, request_id=request_id, keep_whole=keep_whole)
        def start() -> AsyncTokenStream:
            call = self._stub.Generate(req, timeout=self._timeout(timeout),
                                       metadata=self.credentials.metadata(req.request_id))
            return AsyncTokenStream(call, req.request_id)

        if stream:
            return start()

        async def run() -> GenerateResult:
            async with start() as ts:
                return await ts.result()

        return run()
