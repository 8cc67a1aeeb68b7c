"""Combine connects only to the segcache members it knows (its --segcache-address ring): a plan
naming another address is INVALID_ARGUMENT before anything is dialled, while plans naming a known
member, or none (the ring), still answer like the in-process engine."""

from __future__ import annotations

import grpc
import pytest

from common.mesh.abort import Abort
from protos.hypic.v1 import combine_pb2 as combine_pb
from services.combine.segcache_members import SegcacheMembers, planned_segcache
from tests.support.dns_server import LoopbackDNS
from tests.support.worker_mesh import (arun, assert_matches, execute, make_plan, prompt, reference,
                                       status_of)


def test_planned_segcache_accepts_only_ring_members():
    ring = "10.0.0.1:50061, 10.0.0.2:50061"
    assert planned_segcache("", ring) == ring, "a plan naming none: the ring"
    assert planned_segcache("10.0.0.2:50061", ring) == "10.0.0.2:50061"
    assert planned_segcache("10.0.0.2:50061,10.0.0.1:50061", ring) == "10.0.0.2:50061,10.0.0.1:50061"
    for foreign in ("10.0.0.3:50061", "10.0.0.1:50061,evil.example:443", "10.0.0.1:50062",
                    "localhost:50061"):
        with pytest.raises(Abort) as e:
            planned_segcache(foreign, ring)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(Abort):
        planned_segcache("10.0.0.1:50061", None)  # no ring: no plan chooses one
    assert planned_segcache("", None) is None


def test_a_dns_target_accepts_its_members_as_resolved_now():
    """With --segcache-address dns:///name:port, the router's plans name the resolved members:
    those are accepted (a member that joined since is found by re-resolving), others are not."""
    import asyncio

    async def scenario(dns: LoopbackDNS) -> None:
        target = dns.target("segcache.test", 50061)
        members = SegcacheMembers(target, min_refresh_s=0.0)
        dns.set("segcache.test", ["127.0.0.2"])
        known = await members.known("127.0.0.2:50061")
        assert planned_segcache("127.0.0.2:50061", target, known) == "127.0.0.2:50061"
        dns.set("segcache.test", ["127.0.0.2", "127.0.0.3"])  # a member joins
        known = await members.known("127.0.0.3:50061")
        assert planned_segcache("127.0.0.3:50061,127.0.0.2:50061", target, known)
        for foreign in ("127.0.0.4:50061", "127.0.0.2:50062"):
            with pytest.raises(Abort) as e:
                planned_segcache(foreign, target, await members.known(foreign))
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # a plan naming none is placed over the members, not over the target's name
        assert planned_segcache("", target, await members.known("")) == "127.0.0.2:50061,127.0.0.3:50061"
        # a member that joins right after a refresh is found once the rate limit allows another
        slow = SegcacheMembers(target, min_refresh_s=0.3)
        assert "127.0.0.3:50061" in await slow.known("127.0.0.3:50061")
        dns.set("segcache.test", ["127.0.0.2", "127.0.0.3", "127.0.0.5"])
        assert "127.0.0.5:50061" in await slow.known("127.0.0.5:50061")

    with LoopbackDNS() as dns:
        asyncio.run(scenario(dns))


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_plan_naming_an_unknown_segcache_is_invalid(mesh, engine):
    segs, query = prompt(21, (26, 19))
    ref_logits, ref_tokens = reference(engine, segs, query)
    listener_port = int(mesh.segcache.target.rsplit(":", 1)[1])
    for foreign in (f"localhost:{listener_port}",  # the live instance, spelled otherwise: not a member
                    "127.0.0.1:1", f"{mesh.segcache.target},203.0.113.9:50061"):
        plan = make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE, segcache=foreign)
        assert arun(status_of(execute(mesh.combine.target, plan))) == grpc.StatusCode.INVALID_ARGUMENT, foreign
    log = mesh.combine.log()
    assert '"event": "plan rejected"' in log and "203.0.113.9" in log
    # the known members still work: cold (built by scatter, stored), then hits from the member named
    cold = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SCATTER)))
    assert_matches(cold, ref_logits, ref_tokens, len(segs))
    warm = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE)))
    assert_matches(warm, ref_logits, ref_tokens, len(segs))
    assert warm.sources() == [combine_pb.SOURCE_SEGCACHE] * len(segs)
    # a plan naming none uses the whole ring (the live member and one that refuses): still right
    ring = arun(execute(mesh.combine.target, make_plan(engine, mesh, segs, query, combine_pb.SOURCE_SEGCACHE,
                                                       segcache="")))
    assert_matches(ring, ref_logits, ref_tokens, len(segs))
