"""bench/driver.py's summary of a mode's records: percentiles, and hit rates taken over the cache
entries the router looked up (a long segment cut into pieces counts as its pieces), never above 1."""
from __future__ import annotations

import pytest

from bench.driver import summarize


def rec(i: int, ttft: float, segments: int, hits: int, misses: int, tiers: dict) -> dict:
    return dict(i=i, ttft_s=ttft, itl_s=[0.01], e2e_s=ttft + 0.01, tokens=2, segments=segments,
                prompt_tokens=100 * segments, hits=hits, misses=misses, tiers=tiers)


def test_hit_rate_is_over_the_entries_looked_up_not_the_segments_sent():
    # two segments each, the first request's long document cut into 3 pieces (4 entries), all hit
    recs = [rec(0, 0.5, 2, hits=4, misses=0, tiers={"host": 3, "disk": 1}),
            rec(1, 0.7, 2, hits=1, misses=1, tiers={"host": 1})]
    s = summarize(recs, wall=2.0)
    assert s["hit_rate"] == pytest.approx(5 / 6)  # not 5 / 4 (segments sent)
    assert s["hits_by_tier"] == pytest.approx({"disk": 1 / 6, "host": 4 / 6})
    assert s["requests_with_hit"] == 1.0 and s["n"] == 2 and s["errors"] == 0
    assert s["ttft_p50_s"] == pytest.approx(0.6) and s["throughput_rps"] == 1.0


def test_no_lookups_means_no_cache_and_errors_are_counted():
    recs = [rec(0, 0.5, 2, hits=0, misses=0, tiers={}), {"i": 1, "segments": 2, "error": "boom"}]
    s = summarize(recs, wall=1.0)
    assert s["hit_rate"] is None and s["errors"] == 1 and s["errors_sample"] == ["boom"]
    assert summarize(recs[:1], 1.0, prefix_reused=[1])["hit_rate"] == 0.5  # the replayed prefix cache
