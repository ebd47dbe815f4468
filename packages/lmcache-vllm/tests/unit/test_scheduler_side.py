# SPDX-License-Identifier: Apache-2.0
"""Scheduler-side bookkeeping of LMCacheConnectorV1Impl with a fake lookup and fake vLLM
objects: what is loaded, what is saved, slot mappings, picklable metadata."""

from __future__ import annotations

import pickle
import time
from types import SimpleNamespace

import pytest
import torch

from lmcache_vllm import vllm_v1_adapter as adapter
from lmcache_vllm.scheduler.request_keys import RequestKeyer
from lmcache_vllm.transfer.transfer_plan import save_mask, slot_mapping

CHUNK, BLOCK = 64, 16


class FakeClient:
    """Stands in for the worker ranks' lookup servers (tested on real sockets in test_lookup)."""

    def __init__(self, hit: int) -> None:
        self.hit = hit
        self.queries = []

    def lookup(self, query):
        self.queries.append(query)
        return min(self.hit, len(query.tokens))

    def close(self):
        pass


def make_impl(hit: int, kv_role: str = "kv_both", **lmcache):
    extra = {"lmcache.chunk_size": CHUNK, **{f"lmcache.{k}": v for k, v in lmcache.items()}}
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role=kv_role,
            engine_id="e",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="fail",
        ),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0),
        instance_id="i0",
    )
    impl = adapter.LMCacheConnectorV1Impl(cfg, SimpleNamespace(name="SCHEDULER"), None)
    impl.scheduler.lookups.client = FakeClient(hit)
    return impl, cfg


def make_worker():
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role="kv_both",
            engine_id="e",
            kv_connector_extra_config={"lmcache.chunk_size": CHUNK},
        ),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0),
        instance_id="i0",
    )
    impl = adapter.LMCacheConnectorV1Impl(cfg, SimpleNamespace(name="WORKER"), None)
    return impl.worker


def request(rid, prompt, salt=None):
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=prompt,
        num_tokens=len(prompt),
        cache_salt=salt,
        all_token_ids=list(prompt),
    )


def sched_out(new=(), cached=None, finished=()):
    return SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached
        or SimpleNamespace(
            req_ids=[], new_block_ids=[], num_computed_tokens=[], resumed_req_ids=set()
        ),
        num_scheduled_tokens={},
        finished_req_ids=set(finished),
    )


def schedule_new(impl, req, num_local, blocks, scheduled):
    ext = impl.get_num_new_matched_tokens(req, num_local)
    impl.update_state_after_alloc(req, ext)
    new = SimpleNamespace(
        req_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        block_ids=(blocks,),
        num_computed_tokens=num_local + ext,
    )
    out = sched_out([new])
    out.num_scheduled_tokens = {req.request_id: scheduled}
    return ext, impl.build_connector_meta(out)


def test_config_and_failure_policy_left_as_set():
    impl, cfg = make_impl(0)
    assert impl.config.chunk_size == CHUNK
    assert cfg.kv_transfer_config.kv_load_failure_policy == "fail"  # the user's, untouched


def test_partial_hit_loads_beyond_vllm_and_saves_the_rest():
    impl, _ = make_impl(hit=192)
    req = request("a", list(range(300)), salt="t1")
    ext, meta = schedule_new(impl, req, num_local=64, blocks=list(range(1, 20)), scheduled=108)
    assert ext == 128
    (r,) = meta.requests
    assert r.load == adapter.LoadSpec(vllm_cached=64, lmcache_hit=192, load_end=192)
    assert r.save == adapter.SaveSpec(skip=192, end=256)  # 300 computed: 4 full chunks
    # the salt travels as a fixed-size digest of the request's cache_salt, the same one the
    # lookup used (so the worker's keys match the scheduler's promise)
    (query,) = impl.scheduler.lookups.client.queries
    assert r.salt == query.salt == RequestKeyer(CHUNK).key(req).salt
    assert (
        len(r.salt) == 32 and r.salt != RequestKeyer(CHUNK).key(request("a", [1], salt="t2")).salt
    )
    assert r.token_ids == list(range(256))
    restored = pickle.loads(pickle.dumps(meta))
    assert restored.requests[0] == r


def test_full_hit_reports_one_token_less():
    impl, _ = make_impl(hit=256)
    ext, meta = schedule_new(impl, request("b", list(range(256))), 0, list(range(1, 17)), 1)
    assert ext == 240  # before the last token, on a block boundary (block 16)
    assert meta.requests[0].load.load_end == 240
    assert meta.requests[0].save is None  # all 4 chunks are stored already


def test_never_below_vllm_prefix_cache():
    impl, _ = make_impl(hit=128)
    ext, meta = schedule_new(impl, request("c", list(range(300))), 192, list(range(1, 20)), 108)
    assert ext == 0
    assert meta.requests[0].load is None
    assert meta.requests[0].save == adapter.SaveSpec(skip=0, end=256)


def test_vllm_declining_the_load_drops_it():
    impl, _ = make_impl(hit=128)
    req = request("d", list(range(200)))
    assert impl.get_num_new_matched_tokens(req, 0) == 128
    impl.update_state_after_alloc(req, 0)
    assert "d" not in impl.scheduler._load_specs


def test_chunked_prefill_saves_chunk_aligned_then_the_tail():
    impl, _ = make_impl(hit=0, save_unfull_chunk=True)
    req = request("e", list(range(150)))
    _, meta = schedule_new(impl, req, 0, list(range(1, 11)), 100)  # first 100 tokens
    assert meta.requests[0].save == adapter.SaveSpec(skip=0, end=64)
    cached = SimpleNamespace(
        req_ids=["e"], new_block_ids=[None], num_computed_tokens=[100], resumed_req_ids=set()
    )
    out = sched_out(cached=cached)
    out.num_scheduled_tokens = {"e": 50}
    meta = impl.build_connector_meta(out)
    assert meta.requests[0].save == adapter.SaveSpec(skip=64, end=150)  # complete prompt


def test_decode_saved_only_with_save_decode_cache():
    for flag, expected in ((False, None), (True, adapter.SaveSpec(skip=128, end=192))):
        impl, _ = make_impl(hit=0, save_decode_cache=flag)
        req = request("f", list(range(128)))
        schedule_new(impl, req, 0, list(range(1, 9)), 128)
        req.all_token_ids = list(range(200))
        cached = SimpleNamespace(
            req_ids=["f"],
            new_block_ids=[([9, 10, 11, 12],)],
            num_computed_tokens=[199],
            resumed_req_ids=set(),
        )
        out = sched_out(cached=cached)
        out.num_scheduled_tokens = {"f": 1}
        meta = impl.build_connector_meta(out)
        got = meta.requests[0].save if meta.requests else None
        assert got == expected


def test_finished_requests_are_forgotten():
    impl, _ = make_impl(hit=0)
    req = request("g", list(range(100)))
    schedule_new(impl, req, 0, list(range(1, 8)), 100)
    # vLLM frees the blocks at once (workers fence their reuse until queued saves copied them)
    assert impl.request_finished(req, [1, 2]) == (False, None)
    assert "g" not in impl.scheduler._trackers and impl.get_kv_events() == []


def test_slot_mapping_and_mask():
    impl = make_worker()
    req = adapter.ReqMeta("x", list(range(40)), block_ids=[7, 3, 9])
    slots = slot_mapping(req.block_ids, impl.block_size, 40)
    assert slots[:3].tolist() == [112, 113, 114]
    assert slots[16].item() == 48 and slots[39].item() == 9 * 16 + 7
    assert slot_mapping(req.block_ids, impl.block_size, 50)[48:].tolist() == [-1, -1]
    mask = save_mask(200, 130, impl.chunk_size)
    assert mask is not None and not mask[:128].any() and mask[128:].all()
    assert save_mask(200, impl.chunk_size - 1, impl.chunk_size) is None  # no whole chunk skipped


def test_load_shortfall_reports_blocks():
    impl = make_worker()
    req = adapter.ReqMeta(
        "y",
        list(range(256)),
        block_ids=list(range(10, 26)),
        load=adapter.LoadSpec(vllm_cached=32, lmcache_hit=256, load_end=255),
    )
    loaded = torch.zeros(256, dtype=torch.bool)
    loaded[:128] = True  # chunks 0-1 loaded, 2-3 missing
    impl._loads.record(req, loaded)
    assert impl.get_block_ids_with_load_errors() == set(range(18, 26))
    assert impl.get_block_ids_with_load_errors() == set()


@pytest.mark.parametrize("hit", [64, 256])
def test_kv_producer_never_loads(hit):
    producer, _ = make_impl(hit=hit, kv_role="kv_producer")
    assert producer.get_num_new_matched_tokens(request("z", list(range(300))), 0) == 0
    both, _ = make_impl(hit=hit)  # control: the same hit is loaded with kv_both
    assert both.get_num_new_matched_tokens(request("z", list(range(300))), 0) == hit


def test_ranks_on_other_nodes_turn_loads_off_with_one_clear_line(caplog):
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_both", engine_id="e"),
        cache_config=SimpleNamespace(block_size=BLOCK),
        instance_id="i",
    )
    from lmcache.config import LMCacheConfig
    from lmcache_vllm.scheduler.side import SchedulerSide

    side = SchedulerSide(cfg, LMCacheConfig(chunk_size=CHUNK), world_size=4, local_world_size=2)
    side.lookups.client = FakeClient(256)
    assert side.get_num_new_matched_tokens(request("x", list(range(300))), 0) == 0
    (line,) = [r.getMessage() for r in caplog.records if "span several nodes" in r.getMessage()]
    assert "loads nothing" in line and "only stores" in line
    local = SchedulerSide(cfg, LMCacheConfig(chunk_size=CHUNK), world_size=4, local_world_size=4)
    local.lookups.client = FakeClient(256)  # control: all ranks on this node
    assert local.get_num_new_matched_tokens(request("x", list(range(300))), 0) == 256


def test_lookups_that_may_read_lower_tiers_never_block_the_scheduler():
    """With a disk or remote tier the lookup runs off the scheduler thread: ``None`` (vLLM's
    "ask again later") until the ranks answer, then the same numbers as a synchronous lookup."""
    import threading

    impl, _ = make_impl(hit=192, local_disk="/nonexistent/lmcache", max_local_disk_size=1.0)
    client = impl.scheduler.lookups.client
    gate = threading.Event()
    answer = client.lookup
    client.lookup = lambda query: (gate.wait(10), answer(query))[1]
    req = request("a", list(range(300)))
    assert impl.get_num_new_matched_tokens(req, 64) is None
    assert impl.get_num_new_matched_tokens(req, 64) is None  # in flight: not asked twice
    gate.set()
    impl.scheduler.lookups.pending["a"][0].result(10)
    assert impl.get_num_new_matched_tokens(req, 64) == 128  # 192 found, vLLM holds 64
    assert len(client.queries) == 1
    # A request that finishes while its lookup is in flight is forgotten with it.
    gate.clear()
    other = request("b", list(range(300)))
    assert impl.get_num_new_matched_tokens(other, 0) is None
    impl.request_finished(other, [])
    assert "b" not in impl.scheduler.lookups.pending
    gate.set()
    impl.scheduler.close()


def test_cuda_lookups_run_off_the_scheduler_thread_when_hits_are_verified():
    """On CUDA the worker checks a hit on the GPU before answering (it waits for the hit's
    copy): such lookups run in the background and vLLM asks again, as for a disk tier. An
    answer that comes within the quick wait (a miss, mostly) is returned at once."""
    import threading

    impl, cfg = make_impl(hit=0)
    assert impl.scheduler.async_lookups is False  # no device_config: not CUDA
    for device, checksum, expected in [
        ("cuda", None, True),
        ("cuda", False, False),
        ("cpu", None, False),
    ]:
        cfg.device_config = SimpleNamespace(device_type=device)
        extra = cfg.kv_transfer_config.kv_connector_extra_config
        extra.pop("lmcache.checksum", None)
        if checksum is not None:
            extra["lmcache.checksum"] = checksum
        again = adapter.LMCacheConnectorV1Impl(cfg, SimpleNamespace(name="SCHEDULER"), None)
        assert again.scheduler.async_lookups is expected, (device, checksum)
        client = again.scheduler.lookups.client = FakeClient(CHUNK * 2)
        gate = threading.Event()  # a hit's check on the GPU takes a while
        answer = client.lookup
        client.lookup = lambda query, _a=answer, _g=gate: (_g.wait(10), _a(query))[1]
        req = request(f"r-{device}-{checksum}", list(range(3 * CHUNK)))
        if not expected:
            gate.set()
        first = again.get_num_new_matched_tokens(req, 0)
        gate.set()
        if expected:  # asked in the background; the answer comes at a later step
            assert first is None
            deadline = time.monotonic() + 5
            got = None
            while got is None and time.monotonic() < deadline:
                time.sleep(0.01)
                got = again.get_num_new_matched_tokens(req, 0)
            assert got == 2 * CHUNK
        else:
            assert first == 2 * CHUNK
        quick = request(f"q-{device}-{checksum}", list(range(3 * CHUNK)))
        with pytest.MonkeyPatch.context() as mp:  # a loaded test machine: a generous wait
            mp.setattr("lmcache_vllm.scheduler.prefix_lookups.QUICK_ANSWER_S", 10.0)
            assert again.get_num_new_matched_tokens(quick, 0) == 2 * CHUNK  # answered at once


def test_no_lookup_when_vllm_holds_every_token_lmcache_could_offer():
    """vLLM's own prefix-cache hit already reaches the last full block before the prompt's last
    token: lmcache could add nothing, so it asks no worker (no lease, no device copy)."""
    impl, _ = make_impl(hit=4 * CHUNK)
    prompt = list(range(2 * CHUNK + 5))
    full = (len(prompt) - 1) // BLOCK * BLOCK
    assert impl.get_num_new_matched_tokens(request("r-full", prompt), full) == 0
    assert impl.scheduler.lookups.client.queries == []
    assert impl.get_num_new_matched_tokens(request("r-part", prompt), full - BLOCK) == BLOCK
    assert len(impl.scheduler.lookups.client.queries) == 1
