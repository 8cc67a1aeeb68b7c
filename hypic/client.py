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
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Sequence, Union

import grpc

from hypic import errors
from hypic.targets import balancing_options, channel_target
from protos.hypic.v1 import router_pb2 as router_pb
from protos.hypic.v1 import router_pb2_grpc as router_grpc

REQUEST_ID_KEY = "x-request-id"
AUTHORIZATION_KEY = "authorization"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# Prefill mode names, read off the proto enum (PREFILL_MODE_ADDITIVE -> "additive"): the wire
# contract is their one home on this side. "naive" (the additive ablation's old name, an enum
# alias) is accepted for one version; MODE_NAMES are the canonical ones.
MODES = {name.removeprefix("PREFILL_MODE_").lower(): value for name, value in router_pb.PrefillMode.items()}
MODE_NAMES = tuple(name for name, value in MODES.items()
                   if router_pb.PrefillMode.Name(value) == "PREFILL_MODE_" + name.upper())

SegmentLike = Union[str, Sequence[int]]


# ---- result types ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Token:
    id: int
    text: str          # detokenized piece ("" when the router has no tokenizer, or mid-character)
    index: int         # 0 for the first generated token
    logits: list[float] | None = None   # first token only, with return_logits=True


@dataclass(frozen=True)
class SegmentTrace:
    """Where one segment's entry came from: "segcache" (tier), "scatter" (worker) or "local"."""
    index: int
    source: str
    worker: str = ""
    tier: str = ""
    fetch_s: float = 0.0
    build_s: float = 0.0
    tokens: int = 0
    via_nixl: bool = False


@dataclass(frozen=True)
class Timings:
    """Where each segment came from and how long each stage took (seconds)."""
    tokenize_s: float = 0.0
    lookup_s: float = 0.0
    scatter_s: float = 0.0
    transfer_s: float = 0.0
    compose_s: float = 0.0
    seams_s: float = 0.0
    query_prefill_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0
    segments: int = 0
    hits: int = 0
    misses: int = 0
    prompt_tokens: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)
    cached_tokens: int = 0    # prompt tokens served from cache (segcache hits' bodies)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    trace: tuple[SegmentTrace, ...] = ()  # per segment, in the final timings

    @classmethod
    def from_proto(cls, t: router_pb.Timings) -> "Timings":
        return cls(tokenize_s=t.tokenize_s, lookup_s=t.lookup_s, scatter_s=t.scatter_s,
                   transfer_s=t.transfer_s, compose_s=t.compose_s, seams_s=t.seams_s,
                   query_prefill_s=t.query_prefill_s, ttft_s=t.ttft_s, total_s=t.total_s,
                   segments=t.segments, hits=t.hits, misses=t.misses,
                   prompt_tokens=t.prompt_tokens, hits_by_tier=dict(t.hits_by_tier),
                   cached_tokens=t.cached_tokens,
                   cached_tokens_by_tier=dict(t.cached_tokens_by_tier),
                   trace=tuple(SegmentTrace(index=s.index, source=s.source, worker=s.worker, tier=s.tier,
                                            fetch_s=s.fetch_s, build_s=s.build_s, tokens=s.tokens,
                                            via_nixl=s.via_nixl) for s in t.trace))


@dataclass
class GenerateResult:
    tokens: list[int]
    text: str
    timings: Timings | None
    logits: list[float] | None
    request_id: str


@dataclass(frozen=True)
class Info:
    model_type: str
    model_fingerprint: str
    vocab_size: int
    seam: int
    dtype: str
    max_prompt_tokens: int
    scatter_addresses: list[str]
    combine_addresses: list[str]
    segcache_address: str

    @classmethod
    def from_proto(cls, r: router_pb.InfoResponse) -> "Info":
        return cls(model_type=r.model_type, model_fingerprint=r.model_fingerprint,
                   vocab_size=r.vocab_size, seam=r.seam, dtype=r.dtype,
                   max_prompt_tokens=r.max_prompt_tokens,
                   scatter_addresses=list(r.scatter_addresses),
                   combine_addresses=list(r.combine_addresses),
                   segcache_address=r.segcache_address)


# ---- request building ----------------------------------------------------------------------------

def _segment(value: Any, what: str) -> router_pb.Segment:
    if isinstance(value, router_pb.Segment):
        return value
    if isinstance(value, str):
        return router_pb.Segment(text=value)
    if isinstance(value, (bytes, bytearray)):
        raise errors.InvalidArgument(f"{what}: pass text as str, not bytes")
    try:
        ids = [int(t) for t in value]
    except (TypeError, ValueError):
        raise errors.InvalidArgument(f"{what}: expected str or a list of token ids, "
                                     f"got {type(value).__name__}") from None
    if any(t < 0 or t >= 1 << 32 for t in ids):
        raise errors.InvalidArgument(f"{what}: token ids must be in [0, 2^32)")
    return router_pb.Segment(token_ids=ids)


def build_request(segments: Sequence[SegmentLike], query: SegmentLike, *, max_tokens: int = 16,
                  temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  mode: str = "hypic", return_logits: bool = False, stop_at_eos: bool = True,
                  request_id: str | None = None) -> router_pb.GenerateRequest:
    """The GenerateRequest for these arguments (client-side type checks only; the router
    validates the content)."""
    if isinstance(segments, (str, bytes)) or isinstance(segments, router_pb.Segment):
        raise errors.InvalidArgument("segments must be a list (of str or token-id lists)")
    mode_value = MODES.get(mode.strip().lower()) if isinstance(mode, str) else (
        mode if mode in MODES.values() else None)
    if mode_value is None:
        raise errors.InvalidArgument(f"unknown mode {mode!r}; one of {', '.join(MODE_NAMES)}")
    if not isinstance(max_tokens, int) or max_tokens < 0 or max_tokens >= 1 << 32:
        raise errors.InvalidArgument("max_tokens must be an int > 0")
    return router_pb.GenerateRequest(
        segments=[_segment(s, f"segment {i}") for i, s in enumerate(segments)],
        query=_segment(query, "query"), max_tokens=max_tokens, temperature=float(temperature),
        top_k=int(top_k), top_p=float(top_p), seed=int(seed), mode=mode_value,
        return_logits=bool(return_logits), stop_at_eos=bool(stop_at_eos),
        request_id=request_id or uuid.uuid4().hex[:16])


class _Accumulator:
    """Folds GenerateEvents into tokens, text, logits and the latest timings."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.logits: list[float] | None = None
        self.timings: Timings | None = None
        self.done = False

    def feed(self, ev: router_pb.GenerateEvent) -> Token | None:
        if ev.request_id:
            self.request_id = ev.request_id
        kind = ev.WhichOneof("event")
        out = None
        if kind == "token":
            t = ev.token
            logits = list(t.logits) if len(t.logits) else None
            if logits is not None and self.logits is None:
                self.logits = logits
            self.tokens.append(t.token_id)
            self.pieces.append(t.text)
            out = Token(id=t.token_id, text=t.text, index=t.index, logits=logits)
        elif kind == "timings":
            self.timings = Timings.from_proto(ev.timings)
        if ev.done:
            self.done = True
        return out

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def result(self) -> GenerateResult:
        return GenerateResult(tokens=list(self.tokens), text=self.text, timings=self.timings,
                              logits=self.logits, request_id=self.request_id)


@dataclass
class Credentials:
    """How the SDK proves itself to a router (docs/security.md). tls_ca: verify the router's
    certificate against this CA (PEM path; tls=True without it uses the system roots);
    tls_cert/tls_key: a client certificate, for a router that demands one (mutual TLS);
    api_key: sent as "authorization: Bearer <key>" on every call."""
    tls: bool = False
    tls_ca: str | os.PathLike[str] | None = None
    tls_cert: str | os.PathLike[str] | None = None
    tls_key: str | os.PathLike[str] | None = None
    api_key: str | None = None

    @property
    def secure(self) -> bool:
        return self.tls or any(p is not None for p in (self.tls_ca, self.tls_cert, self.tls_key))

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        read = lambda p: None if p is None else Path(p).read_bytes()  # noqa: E731
        return grpc.ssl_channel_credentials(root_certificates=read(self.tls_ca),
                                            private_key=read(self.tls_key),
                                            certificate_chain=read(self.tls_cert))

    def metadata(self, request_id: str | None = None) -> list[tuple[str, str]]:
        md = [(REQUEST_ID_KEY, request_id)] if request_id else []
        return md + ([(AUTHORIZATION_KEY, f"Bearer {self.api_key}")] if self.api_key else [])

    def open(self, address: str, options: list, *, aio: bool) -> Any:
        mod = grpc.aio if aio else grpc
        if self.secure:
            return mod.secure_channel(address, self.channel_credentials(), options=options)
        return mod.insecure_channel(address, options=options)


def _channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000)] + balancing_options()


# ---- synchronous client ------------------------------------------------------------------------

class TokenStream:
    """Iterator of Token for one streamed generation. `timings` holds the latest Timings (the
    first after the first token, the final one once iteration ends); `result()` drains the rest.
    Leaving a `with` block or calling cancel() before the end cancels the request."""

    def __init__(self, call: Any, request_id: str):
        self._call = call
        self._acc = _Accumulator(request_id)

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

    def __iter__(self) -> Iterator[Token]:
        return self

    def __next__(self) -> Token:
        while True:
            try:
                ev = next(self._call)
            except StopIteration:
                self._acc.done = True
                raise
            except grpc.RpcError as e:
                raise errors.from_rpc_error(e, self.request_id) from None
            tok = self._acc.feed(ev)
            if tok is not None:
                return tok

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
            channel_target(address), _channel_options(max_message_bytes), aio=False)
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
                 stop_at_eos: bool = True, request_id: str | None = None
                 ) -> TokenStream | GenerateResult:
        """stream=True: a TokenStream (iterate it for Token events); stream=False: block until
        the generation ends and return a GenerateResult(tokens, text, timings, logits)."""
        req = build_request(segments, query, max_tokens=max_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, mode=mode,
                            return_logits=return_logits,
                            stop_at_eos=stop_at_eos, request_id=request_id)
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
        self._acc = _Accumulator(request_id)
        self._it: AsyncIterator | None = None

    request_id = TokenStream.request_id
    timings = TokenStream.timings
    tokens = TokenStream.tokens
    text = TokenStream.text
    done = TokenStream.done

    def __aiter__(self) -> "AsyncTokenStream":
        return self

    async def __anext__(self) -> Token:
        if self._it is None:
            self._it = self._call.__aiter__()
        while True:
            try:
                ev = await self._it.__anext__()
            except StopAsyncIteration:
                self._acc.done = True
                raise
            except grpc.RpcError as e:
                raise errors.from_rpc_error(e, self.request_id) from None
            tok = self._acc.feed(ev)
            if tok is not None:
                return tok

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
            channel_target(address), _channel_options(max_message_bytes), aio=True)
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
                 stop_at_eos: bool = True, request_id: str | None = None):
        """stream=True: an AsyncTokenStream (`async for tok in ...`); stream=False: a coroutine
        of GenerateResult (`await client.generate(..., stream=False)`)."""
        req = build_request(segments, query, max_tokens=max_tokens, temperature=temperature,
                            top_k=top_k, top_p=top_p, seed=seed, mode=mode,
                            return_logits=return_logits,
                            stop_at_eos=stop_at_eos, request_id=request_id)
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
