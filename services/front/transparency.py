"""How the mesh served one request, as the front says it (docs/front.md, "How a request was
served"): a `hypic` object in the JSON body — {reused, built, recomputed, seam, mode, shadowed,
request_id} — and the same figures in x-hypic-* headers (x-hypic-reused, ..., x-hypic-request-id).

The figures are the SDK's Served (hypic.messages), read from the router's Timings: a streamed
response's headers from the first Timings (sent right after the first token), its last chunk and
a whole response from the final one; they agree (every segment is in hand before the first
token). A figure not known (no Timings came) is null in the object and left out of the headers.
"""

from __future__ import annotations

from typing import Any

from hypic.messages import Served

FIELDS = ("reused", "built", "recomputed", "seam", "mode", "shadowed")
HEADER_PREFIX = "x-hypic-"


def hypic_object(served: Served | None, request_id: str) -> dict[str, Any]:
    """The body's `hypic` object."""
    figures = {name: getattr(served, name) if served is not None else None for name in FIELDS}
    return {**figures, "request_id": request_id}


def header_value(value: Any) -> str:
    """A figure as a header value: JSON's spelling (true/false, numbers, the mode's name)."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def hypic_headers(served: Served | None, request_id: str) -> dict[str, str]:
    """x-hypic-reused, x-hypic-built, x-hypic-recomputed, x-hypic-seam, x-hypic-mode,
    x-hypic-shadowed and x-hypic-request-id (the known ones)."""
    return {HEADER_PREFIX + name.replace("_", "-"): header_value(value)
            for name, value in hypic_object(served, request_id).items() if value is not None}
