"""The front's view of the routers' shadow recompute figures (issue 26, docs/drift.md), refreshed
when /metrics is scraped, as cache_usage refreshes the cache gauge:

- gauges of one router's counts and rolling means (Router.Info's DriftSummary, through the SDK's
  Info.drift): the first router that answers;
- histograms `hypic_front_shadow_kl` and `hypic_front_shadow_agreement`, per seam width: the
  routers' own distributions (DriftSummary.histograms) summed over every router. Each router's
  last answer is kept, so a router that misses one scrape does not make the sums go backwards.
  They carry their own names: a dashboard that sums the routers' `hypic_shadow_*` series over every
  scraped job would otherwise count each shadow twice.

With no router answering, everything keeps its last values."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

import hypic.client
from hypic.messages import DriftHistogram, DriftSummary
from services.front import metrics as m

COUNTS = ("sampled", "shadowed", "dropped", "over_threshold")
HISTOGRAMS = {
    "kl": ("hypic_front_shadow_kl", "KL(full || hypic) at the query of each shadowed request, "
           "nats, over every router"),
    "agreement": ("hypic_front_shadow_agreement", "Fraction of the teacher-forced decode steps whose "
                  "argmax agrees with full recompute, over every router"),
}


def publish(drift: DriftSummary, model_name: str) -> None:
    m.SHADOW_KL_MEAN.labels(model_name).set(drift.kl_mean)
    m.SHADOW_TOP1_RATE.labels(model_name).set(drift.top1_rate)
    m.SHADOW_AGREEMENT_MEAN.labels(model_name).set(drift.agreement_mean)
    m.SHADOW_WINDOW.labels(model_name).set(drift.window)
    m.SHADOW_SAMPLE_RATE.labels(model_name).set(drift.sample_rate)
    for count in COUNTS:
        m.SHADOW_COUNTS.labels(model_name, count).set(getattr(drift, count))


class RouterHistograms(Collector):
    """The routers' shadow histograms, summed per (model_name, figure, seam) at collect time."""

    def __init__(self) -> None:
        self.latest: dict[tuple[str, str], tuple[DriftHistogram, ...]] = {}  # (model_name, router)

    def update(self, model_name: str, router: str, histograms: tuple[DriftHistogram, ...]) -> None:
        self.latest[(model_name, router)] = histograms

    def collect(self) -> Iterator[HistogramMetricFamily]:
        sums: dict[tuple[str, str, int], tuple[tuple[float, ...], list[int], float]] = {}
        for (model_name, _), histograms in sorted(self.latest.items()):
            for h in histograms:
                if h.figure not in HISTOGRAMS or len(h.counts) != len(h.upper_bounds) + 1:
                    continue
                key = (h.figure, model_name, h.seam)
                bounds, counts, total = sums.get(key, (h.upper_bounds, [0] * len(h.counts), 0.0))
                if bounds != h.upper_bounds:  # a router of another version: its buckets cannot be added
                    continue
                sums[key] = (bounds, [a + b for a, b in zip(counts, h.counts)], total + h.sum)
        families = {figure: HistogramMetricFamily(name, doc, labels=["model_name", "seam"])
                    for figure, (name, doc) in HISTOGRAMS.items()}
        for (figure, model_name, seam), (bounds, counts, total) in sorted(sums.items()):
            cumulative, buckets = 0, []
            for le, n in zip([*map(str, bounds), "+Inf"], counts):
                cumulative += n
                buckets.append((le, cumulative))
            families[figure].add_metric([model_name, str(seam)], buckets, total)
        yield from families.values()


ROUTER_HISTOGRAMS = RouterHistograms()
REGISTRY.register(ROUTER_HISTOGRAMS)


def refresh(model_name: str, infos: list[tuple[str, hypic.client.Info | None]]) -> None:
    """Publish the first answering router's rolling figures and every router's histograms from
    `infos` (RouterPool.info_each, asked once per scrape)."""
    published = False
    for router, info in infos:
        if info is None:
            continue
        if not published:
            publish(info.drift, model_name)
            published = True
        ROUTER_HISTOGRAMS.update(model_name, router, info.drift.histograms)
