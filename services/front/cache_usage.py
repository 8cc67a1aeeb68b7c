"""The front's cache-usage gauge (vLLM's kv_cache_usage_perc, for Hypic's segment cache):
refreshed when /metrics is scraped, from the Stats of every segcache the first answering router
names in its Info (the Info /metrics asked every router for once, shared with drift_figures). A segcache that does not answer (down, or under mutual TLS that the front holds no client
certificate for) is left out; with none answering the gauge keeps its last value."""

from __future__ import annotations

import grpc

import hypic.client
from protos.hypic.v1 import segcache_pb2 as segcache_pb, segcache_pb2_grpc as segcache_grpc
from services.front import metrics as m
from services.front.routers import RouterPool


async def tier_usage(pool: RouterPool, info: hypic.client.Info, timeout: float = 1.0) -> dict[str, float]:
    """tier name -> bytes held / byte budget, summed over the segcache instances `info` names."""
    used: dict[str, int] = {}
    budget: dict[str, int] = {}
    for address in filter(None, (a.strip() for a in info.segcache_address.split(","))):
        try:
            async with pool.credentials.open(address, [], aio=True) as channel:
                stats = await segcache_grpc.SegcacheStub(channel).Stats(
                    segcache_pb.StatsRequest(), timeout=timeout,
                    metadata=pool.credentials.metadata())
        except (grpc.RpcError, ValueError):
            continue
        for t in stats.tiers:
            if t.enabled and t.budget_bytes:
                name = segcache_pb.Tier.Name(t.tier).removeprefix("TIER_").lower()
                used[name] = used.get(name, 0) + t.bytes
                budget[name] = budget.get(name, 0) + t.budget_bytes
    return {name: used[name] / budget[name] for name in budget}


async def refresh(pool: RouterPool, model_name: str, infos: list[tuple[str, hypic.client.Info | None]]) -> None:
    """Update the gauge from the first router of `infos` (RouterPool.info_each) that answered."""
    info = next((i for _, i in infos if i is not None), None)
    if info is None:
        return
    for tier, fraction in (await tier_usage(pool, info)).items():
        m.CACHE_USAGE.labels(model_name, tier).set(fraction)
