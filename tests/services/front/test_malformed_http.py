"""Malformed HTTP/1.1 (and an HTTP/2 preface) sent to a real front process is answered 400 and
logged at most once per connection, without a traceback (issue 30: a bad chunked body logged
h11 and ASGI tracebacks)."""
from __future__ import annotations

import time

import pytest

from tests.support.front_process import FrontProcess
from tests.support.raw_traffic import exchange, http2_reset_storm, http11_smuggle

pytestmark = pytest.mark.timeout(240)

BAD_REQUESTS = [
    # Content-Length and chunked together, the chunk size not hex
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    # a chunk that does not end where its size says
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\n{}ZZZ\r\n",
    # two Content-Lengths that disagree
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    b"GET /health HTTP/1.1\r\nHost\r\n\r\n",  # a header without a colon
]
CONNECTIONS = 40


@pytest.mark.processes
def test_malformed_http_is_answered_and_logged_once_per_connection_at_most(tmp_path) -> None:
    with FrontProcess(tmp_path) as front:
        start = len(front.log().splitlines())
        answers = [exchange("127.0.0.1", front.port, BAD_REQUESTS[i % len(BAD_REQUESTS)], quiet_s=0.5)
                   for i in range(CONNECTIONS)]
        answers.append(http11_smuggle(front.port, "/v1/completions"))
        answers.append(http2_reset_storm(front.port, "/v1/completions", 50))
        time.sleep(0.5)
        lines = front.log().splitlines()[start:]
    assert all(a.startswith(b"HTTP/1.1 4") for a in answers), [a[:40] for a in answers]
    problems = [ln for ln in lines if '"level": "error"' in ln or "Traceback" in ln]
    assert not problems, problems[:3]
    warnings = [ln for ln in lines if '"level": "warning"' in ln]
    # rate-limited: far fewer than one per connection
    assert 1 <= len(warnings) <= 3, warnings
