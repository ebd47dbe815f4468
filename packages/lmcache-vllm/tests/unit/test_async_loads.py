# SPDX-License-Identifier: Apache-2.0
"""Asynchronous loads with several KV cache groups, without vLLM: the worker's per-request
outcome (:mod:`lmcache_vllm.worker.async_loads`, :class:`GroupedWorkerSide` with fake streams)
and the scheduler side's loads, failures and saves (:mod:`lmcache_vllm.scheduler.async_loads`).
Real vLLM: tests/integration/test_hybrid_load_failures.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from lmcache_vllm import vllm_v1_adapter as adapter
from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, LoadSpec, ReqMeta
from lmcache_vllm.kv_groups import KVGroup, split_metadata
from lmcache_vllm.scheduler.async_loads import AsyncLoadsSchedulerSide
from lmcache_vllm.worker.async_loads import AsyncLoads

from .test_kv_groups import (
    FullAttentionSpec,
    SlidingWindowSpec,
    _Blocks,
    _config,
    _impl,
    _Native,
)
from .test_scheduler_side import request, sched_out

BLOCK, WINDOW, CHUNK = 16, 40, 64
GROUPS = [
    KVGroup(0, "sliding", ("model.layers.0.attn",), BLOCK, WINDOW),
    KVGroup(1, "full", ("model.layers.1.attn",), BLOCK),
]
# a hit of 256 tokens: the sliding group holds blocks from token 208 on (256 - 40 + 1 = 217)
SLIDING_BLOCKS = [0] * 13 + [1, 2, 3, 4]
FULL_BLOCKS = list(range(10, 29))


def _load(rid: str, hit: int = 256, tokens: int | None = None, **changes: Any) -> ReqMeta:
    req = ReqMeta(
        req_id=rid,
        token_ids=list(range(hit if tokens is None else tokens)),
        block_ids=SLIDING_BLOCKS,
        load=LoadSpec(0, hit, hit),
        group_block_ids=[list(SLIDING_BLOCKS), list(FULL_BLOCKS)],
    )
    return dataclasses.replace(req, **changes)


def _step(*reqs: ReqMeta) -> tuple[LMCacheConnectorMetadata, list[LMCacheConnectorMetadata]]:
    meta = LMCacheConnectorMetadata(requests=list(reqs))
    return meta, split_metadata(meta, GROUPS, CHUNK)


# ---------------------------------------------------------------------- worker: AsyncLoads


def test_a_load_that_arrived_in_every_group_is_finished_not_failed():
    loads = AsyncLoads(GROUPS)
    meta, views = _step(_load("a"), ReqMeta(req_id="s", token_ids=[], block_ids=[]))
    loads.start(meta, views)
    assert loads.take() == (set(), set())  # not settled: its outcome is not known yet
    loads.settle([set(), set()])
    assert loads.take() == ({"a"}, set())
    assert loads.take() == (set(), set())  # reported once
    assert loads.take_stats() == {
        "expected_load_tokens": 256.0,
        "loaded_tokens": 256.0,
        "failed_load_tokens": 0.0,
        "num_loads": 1.0,
    }


def test_a_failed_block_of_one_group_fails_its_request_only():
    loads = AsyncLoads(GROUPS)
    b_blocks = [[0] * 13 + [5, 6, 7, 8], list(range(40, 59))]
    b = _load("b", block_ids=b_blocks[0], group_block_ids=b_blocks)
    loads.start(*_step(_load("a"), b))
    loads.settle([{3}, set()])  # the sliding group's block 3: a's last one (4 is past the hit)
    assert loads.take() == ({"a", "b"}, {"a"})
    stats = loads.take_stats()
    assert (stats["loaded_tokens"], stats["failed_load_tokens"]) == (256, 256)


def test_block_ids_are_mapped_within_their_group():
    loads = AsyncLoads(GROUPS)
    loads.start(*_step(_load("a")))
    loads.settle([set(), {11}])  # a full-group block of a's
    assert loads.take() == ({"a"}, {"a"})
    loads.start(*_step(_load("c")))
    loads.settle([{11}, set()])  # 11 is no sliding-group block of c's: unattributed
    assert loads.take() == ({"c"}, {"c"})


def test_unattributed_failed_blocks_fail_every_load_of_the_step(caplog):
    loads = AsyncLoads(GROUPS)
    loads.start(*_step(_load("a"), dataclasses.replace(_load("b"), req_id="b")))
    with caplog.at_level("ERROR"):
        loads.settle([set(), {999}])
    assert loads.take() == ({"a", "b"}, {"a", "b"})
    assert "belong to no request" in caplog.text


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param({"tokens": 200}, id="fewer-tokens-than-the-load"),
        pytest.param({"load": LoadSpec(0, 192, 256)}, id="load-beyond-the-hit"),
        pytest.param({"group_block_ids": [SLIDING_BLOCKS, FULL_BLOCKS[:10]]}, id="blocks-missing"),
        pytest.param({"group_block_ids": [SLIDING_BLOCKS, [0] * 19]}, id="null-blocks"),
        pytest.param({"group_block_ids": [SLIDING_BLOCKS]}, id="a-group-missing"),
    ],
)
def test_a_load_that_cannot_be_performed_fails_and_no_group_writes_it(broken):
    loads = AsyncLoads(GROUPS)
    tokens = broken.pop("tokens", None)
    bad = _load("x", tokens=tokens, **broken)
    meta, views = _step(_load("a"), bad)
    loads.start(meta, views)
    assert [v.requests[1].load for v in views] == [None, None]  # taken out of every group
    assert all(v.requests[0].load is not None for v in views)
    loads.settle([set(), set()])
    assert loads.take() == ({"a", "x"}, {"x"})


def test_the_scheduler_sides_unloadable_load_fails():
    from lmcache_vllm.scheduler.async_loads import _unloadable

    loads = AsyncLoads(GROUPS)
    loads.start(*_step(_unloadable("u", 64)))
    loads.settle([set(), set()])
    assert loads.take() == ({"u"}, {"u"})


def test_streams_not_registered_or_raising_fail_the_step():
    loads = AsyncLoads(GROUPS)
    loads.start(*_step(_load("a")), ready=False)
    loads.settle([set(), set()])
    assert loads.take() == ({"a"}, {"a"})
    loads.start(*_step(_load("b")))
    loads.fail_started("a stream raised")
    loads.settle([set(), set()])
    assert loads.take() == ({"b"}, {"b"})


def test_a_sliding_group_with_nothing_to_write_is_no_failure():
    loads = AsyncLoads(GROUPS)
    req = _load("a", hit=64, group_block_ids=[[0] * 4, list(FULL_BLOCKS[:4])])
    meta, views = _step(
        dataclasses.replace(req, load=LoadSpec(0, 64, 16), token_ids=list(range(64)))
    )
    loads.start(meta, views)
    assert views[0].requests[0].load is None and views[1].requests[0].load is not None
    loads.settle([set(), set()])
    assert loads.take() == ({"a"}, set())


# ---------------------------------------------------------------------- worker: GroupedWorkerSide


class _Stream:
    """Stands in for a group's WorkerSide: records the loads it saw, fails the blocks told."""

    def __init__(self, worker: Any, index: int) -> None:
        self.worker, self.index = worker, index
        self.lmcache_engine = object()
        self.loaded: list[str] = []
        self.errors: set[int] = set()
        self.fail: set[int] = set()
        self.raises = False
        self.raises_at_wait = False

    def bind(self, view: Any) -> None:
        pass

    def handle_preemptions(self, view: Any) -> None:
        pass

    def start_load_kv(self) -> None:
        if self.raises:
            raise RuntimeError("boom")
        view = self.worker._view(self.index)
        self.loaded += [r.req_id for r in view.requests if r.load is not None]

    def wait_for_save(self) -> None:
        if self.raises_at_wait:
            raise RuntimeError("boom")
        self.errors |= self.fail

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def get_finished(self, ids: Any) -> None:
        pass

    def take_stats(self) -> dict[str, float]:
        return {"loaded_tokens": 999.0, "failed_load_tokens": 7.0, "load_seconds": 0.5}

    def shutdown(self) -> None:
        pass


def _worker() -> tuple[Any, list[_Stream], list[Any]]:
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role="kv_both", engine_id="e", kv_connector_extra_config={"lmcache.chunk_size": 64}
        ),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0),
        instance_id="i0",
    )
    bound: list[Any] = [None]
    parent = _Native(_config(SlidingWindowSpec(), FullAttentionSpec()))
    parent._get_connector_metadata = lambda: bound[0]
    impl = adapter.LMCacheConnectorV1Impl(cfg, SimpleNamespace(name="WORKER"), parent)
    worker = impl.worker
    for stream in worker.streams:
        stream.shutdown()
    worker.streams = [_Stream(worker, i) for i in range(2)]
    return impl, worker.streams, bound


def _run_step(impl: Any, bound: list[Any], *reqs: ReqMeta) -> tuple[set[str], set[str]]:
    bound[0] = LMCacheConnectorMetadata(requests=list(reqs))
    impl.bind_connector_metadata(bound[0])
    impl.start_load_kv(None)
    impl.wait_for_save()
    return impl.get_transfer_results(set())


def test_grouped_worker_reports_each_request_with_every_groups_outcome():
    impl, streams, bound = _worker()
    assert impl.worker.async_loads is not None
    assert _run_step(impl, bound, _load("a")) == ({"a"}, set())
    assert streams[0].loaded == ["a"] and streams[1].loaded == ["a"]
    streams[1].fail = {12}
    assert _run_step(impl, bound, _load("b")) == ({"b"}, {"b"})
    streams[1].fail = set()
    assert impl.get_block_ids_with_load_errors() == set()  # never block-level to vLLM
    stats = impl.take_stats()  # per request over every group, not the streams' counts
    assert stats["loaded_tokens"] == 256 and stats["failed_load_tokens"] == 256
    assert stats["num_loads"] == 2 and stats["load_seconds"] == 1.0
    streams[0].raises = True
    assert _run_step(impl, bound, _load("c")) == ({"c"}, {"c"})
    streams[0].raises = False
    bad = _load("d", tokens=10)
    assert _run_step(impl, bound, bad) == ({"d"}, {"d"})
    assert "d" not in streams[0].loaded + streams[1].loaded  # no group wrote it
    impl.shutdown()


def test_a_stream_raising_at_wait_for_save_fails_the_steps_loads():
    impl, streams, bound = _worker()
    streams[1].raises_at_wait = True
    bound[0] = LMCacheConnectorMetadata(requests=[_load("a")])
    impl.bind_connector_metadata(bound[0])
    impl.start_load_kv(None)
    with pytest.raises(RuntimeError, match="boom"):
        impl.wait_for_save()
    assert impl.get_transfer_results(set()) == ({"a"}, {"a"})
    impl.shutdown()


def test_outcome_is_reported_once_wait_for_save_settled_it():
    """vLLM may call ``get_transfer_results`` before ``wait_for_save`` (a draft model's
    forward): the load is then reported at the next step's."""
    impl, _, bound = _worker()
    bound[0] = LMCacheConnectorMetadata(requests=[_load("a")])
    impl.bind_connector_metadata(bound[0])
    impl.start_load_kv(None)
    assert impl.get_transfer_results(set()) == (set(), set())
    impl.wait_for_save()
    assert _run_step(impl, bound) == ({"a"}, set())
    impl.shutdown()


# ---------------------------------------------------------------------- scheduler side


def test_a_failed_load_is_not_looked_up_again_and_recomputes_everything():
    impl = _impl(300, SlidingWindowSpec(), FullAttentionSpec())
    assert isinstance(impl.scheduler, AsyncLoadsSchedulerSide)
    req = request("a", list(range(300)))
    assert impl.get_num_new_matched_tokens(req, 0) == 256
    impl.update_state_after_alloc(req, 256, _Blocks(SLIDING_BLOCKS, FULL_BLOCKS))
    (load,) = impl.build_connector_meta(sched_out()).requests
    assert load.load == LoadSpec(0, 300, 256)
    impl.update_connector_output({"a"}, {"a"})  # vLLM recomputes it from token 0
    queries = len(impl.scheduler.lookups.client.queries)
    assert impl.get_num_new_matched_tokens(req, 0) == 0
    assert len(impl.scheduler.lookups.client.queries) == queries  # no rank was asked
    impl.update_state_after_alloc(req, 0, _Blocks(SLIDING_BLOCKS, FULL_BLOCKS))
    new = SimpleNamespace(
        req_id="a", prompt_token_ids=req.prompt_token_ids,
        block_ids=([0] * 13 + [5, 6, 7, 8], FULL_BLOCKS), num_computed_tokens=0,
    )  # fmt: skip
    out = sched_out([new])
    out.num_scheduled_tokens = {"a": 300}
    (r,) = impl.build_connector_meta(out).requests
    assert r.load is None and r.save is not None and r.save.skip == 0  # every chunk again
    assert impl.request_finished_all_groups(req, new.block_ids) == (False, None)
    assert not impl.scheduler._failed_loads and not impl.scheduler._hit_saved


def test_a_hit_vllm_accepted_is_always_sent_even_when_building_it_fails():
    impl = _impl(300, SlidingWindowSpec(), FullAttentionSpec())
    req = request("a", list(range(300)))
    assert impl.get_num_new_matched_tokens(req, 0) == 256
    impl.update_state_after_alloc(req, 256, object())  # no block ids: cannot be built
    (r,) = impl.build_connector_meta(sched_out()).requests
    assert r.req_id == "a" and r.load is not None and r.token_ids == []  # the workers fail it
    assert impl.take_stats()["scheduler_failures"] == 1
    # a hit vLLM accepted without a lookup answer (e.g. after a scheduler failure)
    impl.update_state_after_alloc(request("b", list(range(300))), 64, _Blocks([1], [2]))
    (r,) = impl.build_connector_meta(sched_out()).requests
    assert r.req_id == "b" and r.token_ids == [] and r.load == LoadSpec(0, 0, 64)


def test_an_aborted_requests_load_is_still_sent():
    """vLLM holds an aborted request's blocks until the workers report its load."""
    impl = _impl(300, SlidingWindowSpec(), FullAttentionSpec())
    req = request("a", list(range(300)))
    impl.get_num_new_matched_tokens(req, 0)
    impl.update_state_after_alloc(req, 256, _Blocks(SLIDING_BLOCKS, FULL_BLOCKS))
    impl.request_finished_all_groups(req, (SLIDING_BLOCKS, FULL_BLOCKS))
    (r,) = impl.build_connector_meta(sched_out(finished=["a"])).requests
    assert r.req_id == "a" and r.load == LoadSpec(0, 300, 256)


def test_a_dense_model_keeps_synchronous_loads():
    impl = _impl(300, FullAttentionSpec())
    assert type(impl.scheduler).__name__ == "SchedulerSide" and not impl.async_loads
    req = request("a", list(range(300)))
    assert impl.get_num_new_matched_tokens(req, 0) == 288 and not impl.loads_async(288)
