# SPDX-License-Identifier: Apache-2.0
"""Decode saves under speculative decoding (scheduler side, fake vLLM objects): a step's draft
tokens are never saved, a chunk they complete is saved once they are accepted, also when the
request finished in that step (end to end on real vLLM: tests/integration/test_spec_decode.py)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from lmcache_vllm import vllm_v1_adapter as adapter

from .test_scheduler_side import make_impl, request, sched_out, schedule_new

BLOCKS = list(range(1, 14))  # 13 blocks of 16 tokens: 208 slots


def _decode_step(impl, req, num_computed: int, scheduled: int):
    """A decode step of ``req`` (its last known token plus ``scheduled - 1`` drafts)."""
    cached = SimpleNamespace(
        req_ids=[req.request_id],
        new_block_ids=[None],
        num_computed_tokens=[num_computed],
        resumed_req_ids=set(),
    )
    out = sched_out(cached=cached)
    out.num_scheduled_tokens = {req.request_id: scheduled}
    return impl.build_connector_meta(out)


def _decoding(known: int):
    """A request with a 128-token prompt (saved) and ``known`` tokens so far."""
    impl, _ = make_impl(hit=0, save_decode_cache=True)
    req = request("s", list(range(128)))
    _, meta = schedule_new(impl, req, 0, BLOCKS, 128)
    assert meta.requests[0].save == adapter.SaveSpec(skip=0, end=128)
    req.all_token_ids = list(range(1000, 1000 + known))
    return impl, req


def test_drafts_crossing_a_chunk_boundary_are_not_saved_until_accepted():
    impl, req = _decoding(known=191)
    # positions 190..193: the last known token and 3 drafts across the boundary at 192
    meta = _decode_step(impl, req, num_computed=190, scheduled=4)
    assert meta.requests == []  # 191 known tokens: no full chunk yet, nothing marked saved
    assert impl.scheduler._trackers["s"].num_saved == 128
    # the 3 drafts were accepted (+1 sampled token): the chunk is known now, and saved
    req.all_token_ids = list(range(1000, 1000 + 195))
    meta = _decode_step(impl, req, num_computed=194, scheduled=4)
    (r,) = meta.requests
    assert r.save == adapter.SaveSpec(skip=128, end=192)
    assert r.token_ids == req.all_token_ids[:192]


def test_chunk_completed_by_the_last_step_is_saved_after_the_request_finished():
    impl, req = _decoding(known=191)
    assert _decode_step(impl, req, num_computed=190, scheduled=4).requests == []
    # vLLM accepted the drafts, then the request stopped: 194 tokens computed, 195 known
    req.all_token_ids = list(range(1000, 1000 + 195))
    req.num_computed_tokens = 194
    impl.request_finished(req, BLOCKS)
    meta = impl.build_connector_meta(sched_out(finished=["s"]))
    assert meta.requests == []
    (r,) = meta.finished
    assert r.save == adapter.SaveSpec(skip=128, end=192)
    assert r.token_ids == req.all_token_ids[:192] and r.block_ids == BLOCKS
    assert r.salt == impl.scheduler._keyer.key(req).salt
    assert pickle.loads(pickle.dumps(meta)).finished == [r]
    assert impl.build_connector_meta(sched_out()).finished == []  # sent once
    assert impl.scheduler.stats["scheduler_failures"] == 0


def test_finished_request_without_new_chunks_saves_nothing():
    impl, req = _decoding(known=191)
    _decode_step(impl, req, num_computed=190, scheduled=1)  # no drafts
    req.all_token_ids = list(range(1000, 1000 + 192))  # stopped at its 64th output token
    req.num_computed_tokens = 191  # the last token's KV is never computed
    impl.request_finished(req, BLOCKS)
    assert impl.build_connector_meta(sched_out(finished=["s"])).finished == []


def test_finished_preempted_request_saves_nothing():
    impl, req = _decoding(known=195)
    req.num_computed_tokens = 0  # vLLM preempted it (its blocks are gone), then it was aborted
    impl.request_finished(req, [])
    assert impl.build_connector_meta(sched_out(finished=["s"])).finished == []
