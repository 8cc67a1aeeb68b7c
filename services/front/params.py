"""Sampling parameters of an OpenAI request, and a clear 400 for every parameter Hypic does not
support (rather than ignoring it): unknown fields, and known ones set to other than their
neutral default."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from services.front.errors import bad_request

COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed",
          "stop", "n", "user", "hypic"}
ENDPOINT_KEYS = {"chat": COMMON | {"messages", "max_completion_tokens"},
                 "completions": COMMON | {"prompt"}}
# Known OpenAI parameters Hypic accepts only at their neutral value.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
    "tool_choice": (None, "none"), "parallel_tool_calls": (None,), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "service_tier": (None, "auto", "default"), "store": (None, False), "metadata": (None, {}),
    "modalities": (None, ["text"]), "prediction": (None,), "audio": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,),
}
MAX_STOPS = 4


@dataclass
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: list[str] = field(default_factory=list)


def check_supported(body: dict, endpoint: str) -> None:
    allowed = ENDPOINT_KEYS[endpoint]
    for key, value in body.items():
        if key in allowed:
            continue
        if key in NEUTRAL:
            if value in NEUTRAL[key]:
                continue
            raise bad_request(f"{key}={value!r} is not supported by Hypic", param=key,
                              code="unsupported_parameter")
        raise bad_request(f"unrecognized request argument: {key}", param=key,
                          code="unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise bad_request("only n=1 is supported", param="n", code="unsupported_parameter")


def _number(body: dict, key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not lo <= v <= hi:
        raise bad_request(f"{key} must be a number in [{lo}, {hi}]", param=key)
    return float(v)


def _int(body: dict, key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{key} must be an integer", param=key)
    return v


def sampling(body: dict, endpoint: str, default_max_tokens: int) -> Sampling:
    max_tokens = _int(body, "max_completion_tokens") if endpoint == "chat" else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens <= 0:
        raise bad_request("max_tokens must be > 0", param="max_tokens")
    seed = _int(body, "seed")
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")  # unseeded requests sample differently
    if not 0 <= seed < 1 << 63:
        raise bad_request("seed must be in [0, 2^63)", param="seed")
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad_request("stop must be a string or a list of strings", param="stop")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"at most {MAX_STOPS} stop strings", param="stop")
    top_p = _number(body, "top_p", 1.0, 0, 1)
    if top_p == 0:
        raise bad_request("top_p must be in (0, 1]", param="top_p")
    return Sampling(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0, 2),
                    top_p=top_p, seed=seed,
                    stop=[s for s in stops if s])


def wants_usage_in_stream(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise bad_request("stream_options must be an object", param="stream_options")
    return bool(opts.get("include_usage"))
