# SPDX-License-Identifier: Apache-2.0
"""Several KV cache groups (vLLM's hybrid KV cache manager) without vLLM: what each group
stores and loads (:mod:`lmcache_vllm.kv_groups`), and the scheduler side's per-group blocks,
hit alignment and inert mode for groups lmcache cannot store (real vLLM:
tests/integration/test_hybrid_models.py)."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest

from lmcache_vllm import vllm_v1_adapter as adapter
from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec
from lmcache_vllm.kv_groups import (
    KVGroup,
    group_load,
    group_save,
    group_tag,
    hit_alignment,
    kv_groups,
    mamba_states_off,
    split_metadata,
    state_alignment,
    unsupported_kinds,
)

from .test_scheduler_side import CHUNK, FakeClient, request, sched_out

BLOCK, WINDOW = 16, 40
FULL = KVGroup(1, "full", ("model.layers.1.attn",), BLOCK)
SLIDING = KVGroup(0, "sliding", ("model.layers.0.attn",), BLOCK, WINDOW)


class FullAttentionSpec:
    def __init__(self, block_size: int = BLOCK) -> None:
        self.block_size, self.sliding_window = block_size, None


class SlidingWindowSpec:
    def __init__(self, window: int = WINDOW, block_size: int = BLOCK) -> None:
        self.block_size, self.sliding_window = block_size, window


class MambaSpec:
    block_size = 1024


def _config(*specs: object) -> SimpleNamespace:
    groups = [
        SimpleNamespace(kv_cache_spec=s, layer_names=[f"model.layers.{i}.attn"])
        for i, s in enumerate(specs)
    ]
    return SimpleNamespace(kv_cache_groups=groups)


def test_groups_are_told_apart_by_spec_class():
    groups = kv_groups(_config(SlidingWindowSpec(), FullAttentionSpec(), MambaSpec()), 99)
    assert [(g.index, g.kind, g.window, g.block_size) for g in groups] == [
        (0, "sliding", WINDOW, BLOCK),
        (1, "full", 0, BLOCK),
        (2, "mamba", 0, 1024),
    ]
    assert unsupported_kinds(groups) == ["mamba"]
    assert unsupported_kinds(groups, mamba_states=True) == []
    assert unsupported_kinds(groups[:2]) == []
    assert kv_groups(None, 16) == []
    tags = {group_tag(g, 3) for g in groups}
    assert len(tags) == 3 and "sliding window=40" in group_tag(groups[0], 3)


def test_hits_of_a_model_with_a_sliding_group_end_on_chunk_boundaries():
    assert hit_alignment([FULL], CHUNK, BLOCK) == BLOCK
    assert hit_alignment([FULL, SLIDING], CHUNK, BLOCK) == CHUNK
    assert hit_alignment([FULL, SLIDING], 48, 32) == 96


def test_hits_of_a_mamba_model_end_on_state_and_chunk_boundaries():
    mamba = KVGroup(1, "mamba", ("model.layers.1.mixer",), 48)
    assert hit_alignment([FULL, mamba], CHUNK, BLOCK) == 48  # every group's blocks
    assert state_alignment(48, CHUNK) == 192  # and whole chunks (asynchronous loads)


@pytest.mark.parametrize(
    ("mode", "prefix", "async_loads", "off"),
    [
        ("align", True, True, ""),
        ("none", False, True, "--mamba-cache-mode align"),
        ("align", True, False, "failed_recving"),
    ],
)
def test_mamba_states_need_vllms_align_mode_and_failed_recving(mode, prefix, async_loads, off):
    cfg = SimpleNamespace(
        cache_config=SimpleNamespace(mamba_cache_mode=mode, enable_prefix_caching=prefix)
    )
    why = mamba_states_off(cfg, async_loads)
    assert (why == "") if not off else (off in why)


def test_full_group_saves_and_loads_everything():
    save, load = SaveSpec(0, 256), LoadSpec(0, 256, 256)
    assert group_save(FULL, save, [0] * 16, 250, CHUNK) is save
    assert group_load(FULL, load, [0] * 16) is load


def test_sliding_chunk_saved_in_the_step_that_completes_it():
    blocks = list(range(1, 17))  # 256 tokens, every block still held
    # one step computed [200, 256): vLLM freed blocks below 200 - 40 + 1 = 161 (10 blocks), and
    # chunk [192, 256) needs [217, 256) only
    assert group_save(SLIDING, SaveSpec(192, 256), blocks, 200, CHUNK) == SaveSpec(192, 256)
    # a prefill of [0, 256) in one step: every chunk's window part is held
    assert group_save(SLIDING, SaveSpec(0, 256), blocks, 0, CHUNK) == SaveSpec(0, 256)


def test_sliding_chunk_whose_window_vllm_freed_is_not_saved():
    blocks = list(range(1, 17))
    # saved a step late (drafts accepted, or the request finished): computed 300, freed below
    # 261: chunk [192, 256) needs [217, 256), gone
    assert group_save(SLIDING, SaveSpec(192, 256), blocks, 300, CHUNK) is None
    # after vLLM's own prefix-cache hit of 192: blocks below the window are its null block; the
    # chunks [0, 64) and [64, 128) need blocks 1-3 and 5-7, null; [128, 192) needs [153, 192)
    nulls = [0] * 9 + list(range(10, 17))
    assert group_save(SLIDING, SaveSpec(0, 256), nulls, 192, CHUNK) == SaveSpec(128, 256)
    # a partial last chunk is never needed by a hit (hits end on chunk boundaries)
    assert group_save(SLIDING, SaveSpec(0, 300), list(range(1, 20)), 0, CHUNK) == SaveSpec(0, 256)
    assert group_save(SLIDING, SaveSpec(256, 300), list(range(1, 20)), 0, CHUNK) is None


def test_sliding_load_writes_only_the_blocks_vllm_allocated():
    # a hit of 256: vLLM allocated blocks from the one holding 256 - 40 + 1 = 217 on (block 13)
    blocks = [0] * 13 + [5, 6, 7, 8]
    got = group_load(SLIDING, LoadSpec(0, 256, 256), blocks)
    assert got == LoadSpec(vllm_cached=208, lmcache_hit=256, load_end=256)
    assert group_load(SLIDING, LoadSpec(0, 256, 256), [0] * 17) is None
    assert group_load(SLIDING, LoadSpec(64, 256, 256), list(range(1, 17))) == LoadSpec(64, 256, 256)


def test_split_metadata_gives_each_group_its_blocks_and_keeps_every_request():
    req = ReqMeta(
        "r",
        list(range(256)),
        block_ids=[0] * 13 + [5, 6, 7],
        load=LoadSpec(0, 256, 256),
        save=SaveSpec(256, 300),
        group_block_ids=[[0] * 13 + [5, 6, 7, 8], list(range(20, 37))],
        computed_start=256,
    )
    meta = LMCacheConnectorMetadata(requests=[req], preempted=["p"])
    sliding, full = split_metadata(meta, [SLIDING, FULL], CHUNK)
    (s,) = sliding.requests
    (f,) = full.requests
    assert s.block_ids == [0] * 13 + [5, 6, 7, 8] and f.block_ids == list(range(20, 37))
    assert s.load == LoadSpec(208, 256, 256) and f.load == req.load
    assert s.save is None and f.save == req.save  # the sliding group skips the partial chunk
    assert s.group_block_ids is None and sliding.preempted == ["p"]
    assert pickle.loads(pickle.dumps(meta)).requests[0] == req


class _Native:
    """Stands in for our connector class (``SupportsHMA``) holding vLLM's KV cache config, on a
    vLLM that takes failed loads per request (``failed_recving``) unless told otherwise."""

    _lmcache_native = True
    _lmcache_failed_recving = True

    def __init__(self, kv_cache_config: object) -> None:
        self._kv_cache_config = kv_cache_config


class _NativeOnOldVllm(_Native):
    _lmcache_failed_recving = False  # vLLM 0.26: block-level load errors only


class _Blocks:
    """vLLM's ``KVCacheBlocks``: every group's block ids."""

    def __init__(self, *per_group: list[int]) -> None:
        self.per_group = per_group

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(b) for b in self.per_group)


def _impl(hit: int, *specs: object, parent: type[_Native] = _Native):
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role="kv_both", engine_id="e", kv_connector_extra_config={"lmcache.chunk_size": 64}
        ),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0),
        instance_id="i0",
    )
    impl = adapter.LMCacheConnectorV1Impl(
        cfg, SimpleNamespace(name="SCHEDULER"), parent(_config(*specs))
    )
    impl.scheduler.lookups.client = FakeClient(hit)
    return impl


def test_scheduler_tracks_every_groups_blocks_and_aligns_hits_to_chunks():
    """The hit ends on a chunk boundary and loads asynchronously into every group's blocks
    (:mod:`lmcache_vllm.scheduler.async_loads`); the request's later steps track every group's
    blocks and save after the hit."""
    impl = _impl(300, SlidingWindowSpec(), FullAttentionSpec())
    req = request("a", list(range(300)))
    ext = impl.get_num_new_matched_tokens(req, 0)
    assert ext == 256  # min(300, 299) on a chunk boundary (a block boundary would give 288)
    assert impl.loads_async(ext) and not impl.loads_async(0)
    per_group = ([0] * 13 + [1, 2, 3, 4], list(range(10, 29)))
    impl.update_state_after_alloc(req, ext, _Blocks(*per_group))
    (r,) = impl.build_connector_meta(sched_out()).requests  # the load; nothing scheduled
    assert r.group_block_ids == [list(b) for b in per_group] and r.block_ids == per_group[0]
    assert (
        r.load == LoadSpec(0, 300, 256)
        and r.save is None
        and r.token_ids == req.prompt_token_ids[:300]
    )
    assert impl.build_connector_meta(sched_out()).requests == []  # sent once
    impl.update_connector_output({"a"}, set())  # loaded: vLLM schedules it from the hit on
    impl.update_state_after_alloc(req, 0, _Blocks(*per_group))
    new = SimpleNamespace(
        req_id="a", prompt_token_ids=req.prompt_token_ids, block_ids=per_group,
        num_computed_tokens=256,
    )  # fmt: skip
    out = sched_out([new])
    out.num_scheduled_tokens = {"a": 44}
    # nothing to do: the loaded chunks are stored already, the 44-token tail is partial
    assert impl.build_connector_meta(out).requests == []
    assert impl.scheduler._trackers["a"].num_saved == 256
    # the next step allocates a block in each group
    cached = SimpleNamespace(
        req_ids=["a"], new_block_ids=[([5], [29])], num_computed_tokens=[300],
        resumed_req_ids=set(),
    )  # fmt: skip
    out = sched_out(cached=cached)
    out.num_scheduled_tokens = {"a": 1}
    impl.build_connector_meta(out)
    tracker = impl.scheduler._trackers["a"]
    assert tracker.group_block_ids == [per_group[0] + [5], per_group[1] + [29]]
    assert tracker.num_saved == 256
    assert impl.request_finished_all_groups(req, per_group) == (False, None)
    assert "a" not in impl.scheduler._trackers


def test_without_failed_recving_several_groups_load_nothing(caplog):
    """vLLM 0.26 cannot be told per request that a load failed, and raises on block-level
    errors with several groups: no hit is reported (said once), every prompt is stored."""
    with caplog.at_level("WARNING"):
        impl = _impl(300, SlidingWindowSpec(), FullAttentionSpec(), parent=_NativeOnOldVllm)
    assert [r.message for r in caplog.records].count(
        caplog.records[0].message
    ) == 1 and "failed_recving" in caplog.records[0].message
    req = request("a", list(range(300)))
    assert impl.get_num_new_matched_tokens(req, 0) == 0 and not impl.loads_async(0)
    assert impl.scheduler.lookups.client.queries == []
    impl.update_state_after_alloc(req, 0)
    new = SimpleNamespace(
        req_id="a", prompt_token_ids=req.prompt_token_ids,
        block_ids=([1] * 19, list(range(10, 29))), num_computed_tokens=0,
    )  # fmt: skip
    out = sched_out([new])
    out.num_scheduled_tokens = {"a": 300}
    (r,) = impl.build_connector_meta(out).requests
    assert r.load is None and r.save == SaveSpec(0, 256)


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_a_state_group_turns_lmcache_off_for_the_engine(role):
    specs = (MambaSpec(), FullAttentionSpec())
    if role == "WORKER":
        cfg = SimpleNamespace(
            kv_transfer_config=SimpleNamespace(
                kv_role="kv_both", engine_id="e", kv_connector_extra_config={}
            ),
            cache_config=SimpleNamespace(block_size=BLOCK),
            parallel_config=SimpleNamespace(
                tensor_parallel_size=1, pipeline_parallel_size=1, rank=0
            ),
            instance_id="i0",
        )
        impl = adapter.LMCacheConnectorV1Impl(cfg, SimpleNamespace(name="WORKER"), _Native(
            _config(*specs)
        ))  # fmt: skip
        impl.register_kv_caches({})  # registers nothing, serves no lookups
        assert impl.worker.streams == [] and impl.lmcache_engine is None
        impl.shutdown()
        return
    impl = _impl(300, *specs)
    req = request("m", list(range(300)))
    assert impl.get_num_new_matched_tokens(req, 0) == 0
    assert impl.scheduler.lookups.client.queries == []  # no rank was asked
    impl.update_state_after_alloc(req, 0)
    new = SimpleNamespace(
        req_id="m", prompt_token_ids=req.prompt_token_ids, block_ids=([1], list(range(2, 21))),
        num_computed_tokens=0,
    )  # fmt: skip
    out = sched_out([new])
    out.num_scheduled_tokens = {"m": 300}
    assert impl.build_connector_meta(out).requests == []  # nothing saved either
    assert impl.reset_cache() is True


def test_in_tree_wrapper_with_several_groups_is_refused_naming_our_connector():
    class InTree:  # vLLM's in-tree wrapper: not ours, no SupportsHMA
        _kv_cache_config = _config(SlidingWindowSpec(), FullAttentionSpec())

    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_both", engine_id="e"),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, rank=0),
    )
    with pytest.raises(ValueError) as err:
        adapter.LMCacheConnectorV1Impl(cfg, SimpleNamespace(name="SCHEDULER"), InTree())
    msg = str(err.value)
    assert "2 groups" in msg and '"kv_connector":"LMCacheConnector"' in msg
    assert "--disable-hybrid-kv-cache-manager" in msg
