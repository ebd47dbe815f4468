# SPDX-License-Identifier: Apache-2.0
"""Every lease goes when its request ends, whatever the timing of its lookup; a stuck lookup
holds up neither the scheduler nor other requests' lookups.

The real scheduler and worker sides of the connector (:class:`Rig`) with a disk tier, so
lookups run off the scheduler thread as in vLLM, in process (the worker answers on a daemon
thread under the deadline) and over the lookup socket (as with tensor parallelism). A request
is aborted at each point of its life: lookup in flight, answered, scheduled before its load,
loaded; and preempted. vLLM's abort reaches the connector as ``request_finished`` (scheduler)
then ``get_finished`` (worker), in that order. Afterwards no request holds a lease: the worker
holds no hit and every chunk in the CPU tier has only the tier's own reference.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, LoadSpec, ReqMeta
from lmcache_vllm.scheduler.lookup_client import LookupClient

from .test_lease_on_lookup import BLOCK, PROMPT, Rig, _prompt, _request


class GatedLookups:
    """Makes the worker's lookups of chosen prompts wait, after finding and leasing their
    hit, until released: a lookup in flight at a chosen moment (disk reads take that long)."""

    def __init__(self, rig: Rig) -> None:
        engine = rig.worker.lmcache_engine
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.returned = threading.Event()
        self.prompts: list[list[int]] = []
        real = engine.lookup_and_lease

        def gated(tokens, **kw):
            hit = real(tokens, **kw)
            if list(tokens) in self.prompts:
                self.entered.set()
                self.gate.wait(30)
            return hit

        engine.lookup_and_lease = gated
        real_lookup = rig.worker._lookup

        def lookup(query):
            try:
                return real_lookup(query)
            finally:
                if list(query.tokens) in self.prompts:
                    self.returned.set()

        # the lookup server was given the bound method at registration: patch what it calls
        rig.worker._lookup_server._lookup = lookup


def _no_request_holds_anything(rig: Rig) -> None:
    assert rig.worker.held_leases == 0
    engine = rig.worker.lmcache_engine
    for lower in engine.lower_tiers:  # queued disk writes hold shares until written
        assert lower.flush(10)
    tier = engine.tier
    with tier.pool.lease_counts() as refs:
        extra = sum(refs(e.lease) - 1 for e in tier._entries.values())
    assert extra == 0, f"{extra} leases beyond the tier's own"


def _answer(rig: Rig, req, timeout: float = 30.0) -> int:
    """Ask until the asynchronous lookup's answer is in (vLLM asks at every step)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = rig.scheduler.get_num_new_matched_tokens(req, 0)
        if got is not None:
            return got
        time.sleep(0.01)
    raise AssertionError("no answer")


def _abort(rig: Rig, req) -> None:
    rid = req.request_id
    rig.scheduler.request_finished(req, [])
    rig.worker.get_finished({rid})


@pytest.fixture(params=["in-process", "socket"])
def disk_rig(tmp_path, request, layerwise) -> Iterator[Rig]:
    rig = Rig(
        tmp_path,
        budget_chunks=32,  # no eviction: every hit is whole
        use_layerwise=layerwise,
        local_disk=str(tmp_path / "kv"),
        max_local_disk_size=0.05,
    )
    assert rig.scheduler.async_lookups
    if request.param == "socket":
        rig.scheduler.lookups.client = LookupClient(
            rig.scheduler.engine_key, 1, timeout_s=30.0, in_process=False
        )
    yield rig
    rig.close()


@pytest.fixture(params=[False, True], ids=["batched", "layerwise"])
def layerwise(request):
    return request.param


def test_an_abort_at_any_point_leaves_no_lease(disk_rig: Rig) -> None:
    rig = disk_rig
    prompts = [_prompt(60 + i) for i in range(5)]
    for i, p in enumerate(prompts):
        rig.store(f"w{i}", p)
    gated = GatedLookups(rig)
    promised = PROMPT - BLOCK

    # 1. Aborted while its lookup is in flight: the lease the lookup takes later goes at once.
    gated.prompts = [prompts[0]]
    req = _request("in-flight", prompts[0])
    assert rig.scheduler.get_num_new_matched_tokens(req, 0) is None
    assert gated.entered.wait(10)
    _abort(rig, req)
    gated.gate.set()
    assert gated.returned.wait(10)
    _no_request_holds_anything(rig)
    assert rig.worker._leases.late == 1

    # 2. Aborted once answered (vLLM had not taken the answer yet): an answer that lands after
    # the scheduler's quick wait.
    for event in (gated.gate, gated.entered, gated.returned):
        event.clear()
    gated.prompts = [prompts[1]]
    req = _request("answered", prompts[1])
    assert rig.scheduler.get_num_new_matched_tokens(req, 0) is None
    assert gated.entered.wait(10)
    gated.gate.set()
    assert gated.returned.wait(10)
    assert _wait(lambda: rig.worker.held_leases == 1)
    _abort(rig, req)
    _no_request_holds_anything(rig)

    # 3. Aborted after vLLM took the answer and allocated its blocks, before its load.
    req = _request("scheduled", prompts[2])
    assert _answer(rig, req) == promised
    rig.scheduler.update_state_after_alloc(req, promised)
    assert rig.worker.held_leases == 1
    _abort(rig, req)
    _no_request_holds_anything(rig)

    # 4. Aborted after its load.
    req = _request("loaded", prompts[3])
    assert _answer(rig, req) == promised
    rig.step(ReqMeta("loaded", prompts[3], rig.blocks(PROMPT), load=LoadSpec(0, PROMPT, promised)))
    assert rig.worker.get_block_ids_with_load_errors() == set()
    _abort(rig, req)
    _no_request_holds_anything(rig)

    # 5. Preempted after its lookup, then aborted while waiting to resume. The preemption keeps
    # the lease: with asynchronous scheduling the request may have been looked up (and leased)
    # again before the step that preempted it binds.
    req = _request("preempted", prompts[4])
    assert _answer(rig, req) == promised
    rig.meta = LMCacheConnectorMetadata(preempted=["preempted"])
    rig.worker.bind(rig.meta)
    assert rig.worker.held_leases == 1
    assert _answer(rig, req) == promised  # resumed: asked again, the same lease
    _abort(rig, req)
    _no_request_holds_anything(rig)


def test_a_lookup_past_its_deadline_is_a_miss_and_its_late_lease_goes_with_the_request(
    disk_rig: Rig,
) -> None:
    rig = disk_rig
    target, other = _prompt(70), _prompt(71)
    rig.store("w", target)
    rig.store("w2", other)
    client = rig.scheduler.lookups.get_client()
    client.timeout_s = 0.5  # the deadline of this test's lookups
    if client._direct is not None:
        client._direct.timeout = 0.5
    gated = GatedLookups(rig)
    gated.prompts = [target]

    slow = _request("slow", target)
    started = time.monotonic()
    assert rig.scheduler.get_num_new_matched_tokens(slow, 0) is None
    # Meanwhile another request's lookup (a CPU-tier hit) is answered: the slow one is held at
    # its gate until the end of this test, so this proves it is not queued behind it. (No tight
    # time bound: on a loaded 2-core machine the socket round trip alone can take a while.)
    assert _answer(rig, _request("fast", other), 5.0) == PROMPT - BLOCK
    assert not gated.gate.is_set()
    assert _answer(rig, slow, 10.0) == 0  # past the deadline: computed, never a wait
    assert time.monotonic() - started < 0.5 + 2.0
    stats = rig.scheduler.take_stats()
    assert stats is not None and stats["lookup_timeouts"] == 1
    gated.gate.set()
    assert gated.returned.wait(10)
    assert rig.worker.held_leases == 2  # the late hit of "slow", and "fast"'s own
    _abort(rig, slow)
    _abort(rig, _request("fast", other))
    _no_request_holds_anything(rig)


def _wait(cond, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_a_stuck_worker_in_this_process_is_a_miss_then_the_client_backs_off(tmp_path) -> None:
    """``direct_deadline``: a lookup served in this process that never returns is a miss at the
    deadline (counted), its thread abandoned; after three in a row the client asks nothing for
    a while (one log line) instead of taking more threads, then probes again."""
    import tempfile

    from lmcache_vllm.lookup_wire import LookupQuery
    from lmcache_vllm.worker.lookup_server import LookupServer

    gate = threading.Event()
    calls: list[str] = []

    def lookup(query: LookupQuery) -> int:
        calls.append(query.req_id)
        if query.req_id.startswith("stuck"):
            gate.wait(30)
        return len(query.tokens)

    with tempfile.TemporaryDirectory(prefix="lmc-dl-") as base:
        server = LookupServer("dl", 0, lookup, lambda: None, base=base)
        client = LookupClient("dl", 1, timeout_s=0.3, base=base, direct_deadline=True)
        try:
            assert client._direct is not None
            client._direct.breaker.cooldown = 0.5
            for i in range(3):
                started = time.monotonic()
                assert client.lookup(LookupQuery(f"stuck{i}", [1, 2, 3], "", {})) == 0
                assert time.monotonic() - started < 0.3 + 0.5
            assert client.timeouts == 3 and client._direct.stuck == 3
            assert client.lookup(LookupQuery("fine", [1, 2], "", {})) == 0  # backing off
            assert calls[-1] == "stuck2"  # not even asked
            time.sleep(0.6)
            assert client.lookup(LookupQuery("probe", [1, 2], "", {})) == 2  # answered again
            gate.set()
            assert _wait(lambda: client._direct.stuck == 0)
        finally:
            gate.set()
            client.close()
            server.close()
