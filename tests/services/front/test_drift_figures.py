"""The front's shadow histograms (services/front/drift_figures.py): the routers' bucket counts
summed per model, figure and seam into cumulative Prometheus histograms; a router of another
bucket layout is left out rather than added wrongly; a router's last answer stays counted."""

from __future__ import annotations

import random

from hypic.messages import DriftHistogram
from services.front.drift_figures import RouterHistograms

BOUNDS = (0.001, 0.01, 0.1, 1.0)


def histogram(rng: random.Random, figure: str = "kl", seam: int = 8, bounds=BOUNDS) -> DriftHistogram:
    counts = tuple(rng.randint(0, 9) for _ in range(len(bounds) + 1))
    return DriftHistogram(figure, seam, bounds, counts, rng.uniform(0.1, 5.0))


def collected(c: RouterHistograms) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for family in c.collect():
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_histograms_are_summed_over_routers_and_cumulative():
    rng = random.Random()
    c = RouterHistograms()
    a8, b8, a32 = histogram(rng), histogram(rng), histogram(rng, seam=32)
    agree = histogram(rng, figure="agreement", bounds=(0.5, 0.9, 1.0))
    c.update("m", "router-a", (a8, a32, agree))
    c.update("m", "router-b", (b8,))
    got = collected(c)
    kl = got["hypic_front_shadow_kl_bucket"]
    summed = [x + y for x, y in zip(a8.counts, b8.counts)]
    for i, le in enumerate([*map(str, BOUNDS), "+Inf"]):
        assert kl[(("le", le), ("model_name", "m"), ("seam", "8"))] == sum(summed[:i + 1])
        assert kl[(("le", le), ("model_name", "m"), ("seam", "32"))] == sum(a32.counts[:i + 1])
    assert got["hypic_front_shadow_kl_count"][(("model_name", "m"), ("seam", "8"))] == sum(summed)
    assert got["hypic_front_shadow_kl_sum"][(("model_name", "m"), ("seam", "8"))] == a8.sum + b8.sum
    assert got["hypic_front_shadow_agreement_count"][(("model_name", "m"), ("seam", "8"))] == sum(agree.counts)


def test_other_buckets_are_left_out_and_a_routers_last_answer_stays():
    rng = random.Random()
    c = RouterHistograms()
    a, other = histogram(rng), histogram(rng, bounds=(0.5, 2.0))
    c.update("m", "router-a", (a,))
    c.update("m", "router-old", (other,))
    count = collected(c)["hypic_front_shadow_kl_count"][(("model_name", "m"), ("seam", "8"))]
    # routers are added in address order: router-a sets the layout, router-old's counts are not added
    assert count == sum(a.counts)
    c = RouterHistograms()
    c.update("m", "router-a", (a,))
    c.update("m", "router-b", (histogram(rng),))
    before = collected(c)["hypic_front_shadow_kl_count"]
    # a scrape where router-b did not answer leaves its last histograms in place (refresh skips it)
    c.update("m", "router-a", (a,))
    assert collected(c)["hypic_front_shadow_kl_count"] == before
