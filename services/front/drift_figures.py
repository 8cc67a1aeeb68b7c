"""The front's shadow recompute gauges (issue 26, docs/drift.md): the router's counts and rolling
figures (Router.Info's DriftSummary, through the SDK's Info.drift), refreshed when /metrics is
scraped, as cache_usage refreshes the cache gauge. With no router answering the gauges keep their
last values."""

from __future__ import annotations

from hypic.messages import DriftSummary
from services.front import metrics as m
from services.front.routers import RouterPool

COUNTS = ("sampled", "shadowed", "dropped", "over_threshold")


def publish(drift: DriftSummary, model_name: str) -> None:
    m.SHADOW_KL_MEAN.labels(model_name).set(drift.kl_mean)
    m.SHADOW_TOP1_RATE.labels(model_name).set(drift.top1_rate)
    m.SHADOW_AGREEMENT_MEAN.labels(model_name).set(drift.agreement_mean)
    m.SHADOW_WINDOW.labels(model_name).set(drift.window)
    m.SHADOW_SAMPLE_RATE.labels(model_name).set(drift.sample_rate)
    for count in COUNTS:
        m.SHADOW_COUNTS.labels(model_name, count).set(getattr(drift, count))


async def refresh(pool: RouterPool, model_name: str) -> None:
    info = await pool.info()
    if info is not None:
        publish(info.drift, model_name)
