"""One generation through a router: text deltas (stop strings applied), then the finish reason,
usage and the request's metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from common.engine import modes
from hypic import errors as sdk
from hypic.messages import Served
from services.front import metrics as m
from services.front.errors import from_sdk
from services.front.params import Sampling
from services.front.routers import RouterPool
from services.front.segments import Prompt
from services.front.stops import StopMatcher



@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def router_mode(mode: str) -> str:
    """The canonical name of a mode the front accepted (aliases resolved), as the SDK sends it."""
    return modes.parse_mode(mode)


class Generation:
    """start() opens the stream and reads to its first Timings (errors become ApiError before
    any byte is sent); then iterate deltas(); finish_reason, usage and served are final once
    deltas() is exhausted."""

    def __init__(self, pool: RouterPool, prompt: Prompt, sampling: Sampling, *, mode: str,
                 model_name: str, eos_ids: set[int], request_id: str):
        self.pool = pool
        self.prompt = prompt
        self.sampling = sampling
        self.mode = router_mode(prompt.mode or mode)
        self.model_name = model_name
        self.eos_ids = eos_ids
        self.request_id = request_id
        self.t0 = time.perf_counter()
        self.stream: Any = None
        self.first: Any = None
        self.tokens: list[int] = []
        self.stops = StopMatcher(sampling.stop)
        self.finish_reason = "stop"
        self.usage = Usage()
        self._last_t = 0.0

    async def start(self) -> None:
        s = self.sampling
        try:
            self.stream, self.first = await self.pool.open(
                segments=self.prompt.segments, query=self.prompt.query, max_tokens=s.max_tokens,
                temperature=s.temperature, top_p=s.top_p, seed=s.seed, mode=self.mode,
                stop_at_eos=True, request_id=self.request_id, keep_whole=self.prompt.keep_whole)
        except sdk.HypicError as e:
            raise from_sdk(e) from None
        if self.first is not None:
            now = time.perf_counter()
            m.TTFT.labels(self.model_name).observe(now - self.t0)
            self._last_t = now
        # How the request is served, for the response's headers: the router sends the first
        # Timings right after the first token (no decode step between), so this read does not
        # hold the first token back; a token read meanwhile waits in the stream.
        try:
            await self.stream.read_timings()
        except BaseException as e:
            self.stream.cancel()
            if isinstance(e, sdk.HypicError):
                raise from_sdk(e) from None
            raise

    @property
    def served(self) -> Served | None:
        """How the router served the request (the latest Timings); None without one."""
        return self.stream.served if self.stream is not None else None

    def _token(self, tok: Any) -> str:
        self.tokens.append(tok.id)
        if len(self.tokens) > 1:
            now = time.perf_counter()
            m.ITL.labels(self.model_name).observe(now - self._last_t)
            self._last_t = now
        return self.stops.push(tok.text)

    async def deltas(self) -> AsyncIterator[str]:
        """Text pieces as they become final. Raises ApiError when the router fails mid-way."""
        try:
            if self.first is not None:
                piece = self._token(self.first)
                if piece:
                    yield piece
                if not self.stops.matched:
                    async for tok in self.stream:
                        piece = self._token(tok)
                        if piece:
                            yield piece
                        if self.stops.matched:
                            break
            tail = self.stops.flush()
            if tail:
                yield tail
        except sdk.HypicError as e:
            raise from_sdk(e) from None
        finally:
            if self.stream is not None and not self.stream.done:
                self.stream.cancel()
        self._finish()

    def _finish(self) -> None:
        n = len(self.tokens)
        if not self.stops.matched and n >= self.sampling.max_tokens and (
                not n or self.tokens[-1] not in self.eos_ids):
            self.finish_reason = "length"
        t = self.stream.timings if self.stream is not None else None
        u = self.usage
        u.completion_tokens = n
        if t is not None:
            u.prompt_tokens = t.prompt_tokens
            u.cached_tokens = t.cached_tokens
            u.cached_by_tier = dict(t.cached_tokens_by_tier)
        name = self.model_name
        m.E2E.labels(name).observe(time.perf_counter() - self.t0)
        m.PROMPT_TOKENS.labels(name).inc(u.prompt_tokens)
        m.GENERATION_TOKENS.labels(name).inc(n)
        m.PROMPT_TOKENS_HIST.labels(name).observe(u.prompt_tokens)
        m.GENERATION_TOKENS_HIST.labels(name).observe(n)
        for tier, count in u.cached_by_tier.items():
            m.CACHED_PROMPT_TOKENS.labels(name, m.tier_label(tier)).inc(count)
        m.SUCCESS.labels(name, self.finish_reason).inc()
