# SPDX-License-Identifier: Apache-2.0
"""A request that vLLM rolls back (a failed load, recompute policy) saves its chunks again.

The workers store no chunk computed over a failed load
(:mod:`lmcache_vllm.worker.failed_loads`), but the scheduler side had counted them saved.
A rollback (a running request scheduled from below its last computed end) now counts the chunks
from the restart's chunk on as unsaved, so the recompute stores them.
"""

from __future__ import annotations

from types import SimpleNamespace

from lmcache_vllm import vllm_v1_adapter as adapter
from lmcache_vllm.connector_metadata import Tracker

from .test_scheduler_side import CHUNK, make_impl, request, sched_out, schedule_new


def _cached_step(impl, rid, start, scheduled, resumed=False, blocks=None):
    cached = SimpleNamespace(
        req_ids=[rid],
        new_block_ids=[blocks],
        num_computed_tokens=[start],
        resumed_req_ids={rid} if resumed else set(),
    )
    out = sched_out(cached=cached)
    out.num_scheduled_tokens = {rid: scheduled}
    return impl.build_connector_meta(out)


def test_tracker_rollback_lowers_saved_to_the_chunk_floor():
    t = Tracker("r", prompt_len=400, block_ids=[], salt="", num_saved=0)
    t.computed(0, 384, CHUNK)
    t.num_saved = 384
    t.computed(384, 385, CHUNK)  # the next step: no rollback
    assert t.num_saved == 384
    t.computed(200, 400, CHUNK)  # rolled back to token 200: chunk 3 on is unsaved
    assert (t.num_saved, t.computed_end) == (192, 400)
    t.computed(100, 101, CHUNK, resumed=True)  # a resumed request keeps what it stored
    assert t.num_saved == 192


def test_failed_load_rollback_saves_the_recomputed_chunks():
    impl, _ = make_impl(hit=256)
    req = request("f", list(range(400)))
    ext, meta = schedule_new(impl, req, 0, list(range(1, 26)), 400 - 256)
    assert ext == 256
    (r,) = meta.requests
    assert r.load.load_end == 256 and r.save == adapter.SaveSpec(skip=256, end=384)
    # async scheduling: the next step (a decode) was scheduled before vLLM heard of the failure
    assert _cached_step(impl, "f", 400, 1).requests == []
    # vLLM rolls the request back to the first failed block (token 192) and recomputes
    (r,) = _cached_step(impl, "f", 192, 208).requests
    assert r.computed_start == 192
    assert r.save == adapter.SaveSpec(skip=192, end=384)  # chunks 3-5 are stored again
    assert r.token_ids == list(range(384))


def test_steps_without_rollback_save_nothing_twice():
    impl, _ = make_impl(hit=0)
    req = request("g", list(range(300)))
    _, meta = schedule_new(impl, req, 0, list(range(1, 20)), 200)
    assert meta.requests[0].save == adapter.SaveSpec(skip=0, end=192)
    (r,) = _cached_step(impl, "g", 200, 100).requests
    assert r.save == adapter.SaveSpec(skip=192, end=256)
    # preempted and resumed from vLLM's prefix cache hit: what was stored stays stored
    assert (
        _cached_step(impl, "g", 128, 172, resumed=True, blocks=[list(range(30, 49))]).requests == []
    )
