# SPDX-License-Identifier: Apache-2.0
"""A hit that is promised is loaded: the real scheduler and worker sides of the connector over a
real lookup socket and a real cache engine, with a tier so small that every store evicts.

Between a request's lookup (the scheduler promises N tokens to vLLM) and its load, other prompts
are looked up and stored; the promised chunks must survive (they are leased at lookup) and load
bit-exactly, with no load error. Without the lease they are the first to be evicted.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmcache.tiers import reset_process_cpu_tiers
from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec
from lmcache_vllm.lookup_sockets import engine_key
from lmcache_vllm.scheduler.side import SchedulerSide
from lmcache_vllm.testing import connector_vllm_config
from lmcache_vllm.vllm_v1_adapter import load_lmcache_config
from lmcache_vllm.worker.side import WorkerSide

CHUNK, BLOCK, HEADS, HEAD, LAYERS = 64, 16, 2, 32, 2
NUM_BLOCKS = 200
CHUNK_BYTES = LAYERS * CHUNK * HEADS * 2 * HEAD * 4  # float32
PROMPT = 4 * CHUNK


def _vllm_config(tmp_path, budget_chunks: int) -> SimpleNamespace:
    return connector_vllm_config(
        engine_id=f"lease-{tmp_path.name}",
        block_size=BLOCK,
        head_size=HEAD,
        extra_config={
            "lmcache.chunk_size": CHUNK,
            "lmcache.max_local_cpu_size": budget_chunks * CHUNK_BYTES / 1024**3,
        },
    )


def _request(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=tokens,
        num_tokens=len(tokens),
        cache_salt=None,
        lora_request=None,
        mm_features=[],
        prompt_embeds=None,
    )


class Rig:
    """Scheduler side + worker side of one engine over per-layer caches in vLLM's layout
    (``vllm.cpu``'s K-transposed block format on the CPU, ``vllm.cuda``'s K||V on a GPU)."""

    def __init__(
        self, tmp_path, budget_chunks: int, device: str = "cpu", **lmcache: object
    ) -> None:
        reset_process_cpu_tiers()
        vc = _vllm_config(tmp_path, budget_chunks)
        vc.kv_transfer_config.kv_connector_extra_config.update(
            {f"lmcache.{k}": v for k, v in lmcache.items()}
        )
        config = load_lmcache_config(vc)
        self.meta = LMCacheConnectorMetadata()
        self.worker = WorkerSide(vc, config, engine_key(vc), 1, 0, lambda: self.meta)
        self.caches = {
            f"model.layers.{i}.self_attn.attn": torch.randn(
                NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD, device=device
            )
            for i in range(LAYERS)
        }
        self.worker.register_kv_caches(self.caches)
        self.scheduler = SchedulerSide(vc, config, world_size=1, local_world_size=1)
        self.next_block = 1

    def blocks(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // BLOCK)
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def step(self, *reqs: ReqMeta) -> None:
        """One vLLM step: bind, load, the forward's per-layer hooks, save."""
        self.meta = LMCacheConnectorMetadata(requests=list(reqs))
        self.worker.bind(self.meta)
        self.worker.start_load_kv()
        for name in self.caches:
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name)
        self.worker.wait_for_save()

    def store(self, rid: str, tokens: list[int]) -> list[int]:
        blocks = self.blocks(len(tokens))
        self.step(ReqMeta(rid, tokens, blocks, save=SaveSpec(skip=0, end=len(tokens))))
        assert self.worker._saves.wait(timeout=30)
        return blocks

    def pages(self, blocks: list[int]) -> torch.Tensor:
        return torch.stack([c[blocks] for c in self.caches.values()]).cpu()

    def check_hit(self, rid: str, tokens: list[int], want: torch.Tensor) -> None:
        """Look ``tokens`` up (a full hit is promised), load them into poisoned new blocks and
        compare with ``want`` (their pages as saved) bit for bit; no load error."""
        dst = self.blocks(PROMPT)
        for c in self.caches.values():
            c[dst] = float("nan")
        promised = self.scheduler.get_num_new_matched_tokens(_request(rid, tokens), 0)
        assert promised == PROMPT - BLOCK
        self.step(ReqMeta(rid, tokens, dst, load=LoadSpec(0, PROMPT, promised)))
        if next(iter(self.caches.values())).is_cuda:
            torch.cuda.synchronize()
        assert self.worker.get_block_ids_with_load_errors() == set()
        full = promised // BLOCK
        got = self.pages(dst)[:, :full]
        assert torch.equal(got.view(torch.int32), want[:, :full].view(torch.int32))

    def close(self) -> None:
        self.scheduler.close()
        self.worker.shutdown()
        reset_process_cpu_tiers()


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=[False, True], ids=["batched", "layerwise"])
def layerwise(request):
    return request.param


@pytest.fixture(params=DEVICES)
def rig(tmp_path, request, layerwise):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # two 4-chunk prompts fit; a third evicts
    r = Rig(tmp_path, budget_chunks=8, device=request.param, use_layerwise=layerwise)
    yield r
    r.close()


def _prompt(seed: int) -> list[int]:
    return torch.randint(
        0, 30_000, (PROMPT,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_promised_hit_survives_eviction_pressure_and_loads_exactly(rig):
    target = _prompt(1)
    src_blocks = rig.store("writer", target)
    original = rig.pages(src_blocks).clone()

    req = _request("reader", target)
    promised = rig.scheduler.get_num_new_matched_tokens(req, 0)
    assert promised == PROMPT - BLOCK  # a full hit: vLLM computes the last block

    # between lookup and load: other prompts are looked up and stored; each store must evict
    for i in range(2, 6):
        other = _prompt(i)
        assert rig.scheduler.get_num_new_matched_tokens(_request(f"o{i}", other), 0) == 0
        rig.store(f"o{i}", other)
    tier = rig.worker.lmcache_engine.tier
    assert rig.worker.lmcache_engine.metrics.value("evicted_chunks") >= 8
    assert len(tier) == 8

    dst_blocks = rig.blocks(PROMPT)
    for c in rig.caches.values():
        c[dst_blocks] = float("nan")
    load = LoadSpec(vllm_cached=0, lmcache_hit=PROMPT, load_end=promised)
    rig.step(ReqMeta("reader", target, dst_blocks, load=load))
    assert rig.worker.get_block_ids_with_load_errors() == set()
    loaded = rig.pages(dst_blocks)
    assert torch.equal(loaded.view(torch.int32), original.view(torch.int32))
    stats = rig.worker.take_stats()
    assert stats["loaded_tokens"] == promised and stats["failed_load_tokens"] == 0


def test_leases_are_released_after_the_load_and_on_finish(rig):
    a, b = _prompt(10), _prompt(11)
    rig.store("wa", a)
    rig.store("wb", b)
    rig.scheduler.get_num_new_matched_tokens(_request("ra", a), 0)
    rig.scheduler.get_num_new_matched_tokens(_request("rb", b), 0)
    assert len(rig.worker._leases) == 2
    rig.step(ReqMeta("ra", a, rig.blocks(PROMPT), load=LoadSpec(0, PROMPT, PROMPT - BLOCK)))
    assert len(rig.worker._leases) == 1  # ra's lease went with its load
    rig.worker.get_finished({"rb"})  # rb finished (aborted) before it was ever scheduled
    assert len(rig.worker._leases) == 0
    pool = rig.worker.lmcache_engine.pool
    held_by_tier_only = all(
        e.lease.ref_count == 1 for e in rig.worker.lmcache_engine.tier._entries.values()
    )
    assert held_by_tier_only and pool.used_bytes == 8 * CHUNK_BYTES


def test_a_vanished_request_lease_times_out(rig):
    a = _prompt(20)
    rig.store("w", a)
    rig.scheduler.get_num_new_matched_tokens(_request("ghost", a), 0)
    assert len(rig.worker._leases) == 1
    rig.worker._leases.timeout_s = 0.0
    rig.worker._leases.reuse("ghost", PROMPT, "")  # refresh with a zero timeout
    rig.step()  # every step expires stale leases
    assert len(rig.worker._leases) == 0
    assert rig.worker.take_stats()["expired_leases"] == 1


def test_lookup_right_after_a_save_waits_for_it(rig):
    """A prompt sent again right after its first run finds the KV that is still being
    checksummed (the lookup waits for a queued save of the same tokens)."""
    a = _prompt(30)
    blocks = rig.blocks(PROMPT)
    rig.step(ReqMeta("w", a, blocks, save=SaveSpec(skip=0, end=PROMPT)))  # queued, not waited
    assert rig.scheduler.get_num_new_matched_tokens(_request("again", a), 0) == PROMPT - BLOCK


def test_a_save_stores_the_kv_the_step_wrote_after_it_was_planned(rig):
    """Batched saves are planned (keys, buffers, the connector's plan) on the save thread once
    vLLM's thread has enqueued the forward (at the last layer's ``save_kv_layer``), while the
    step computes; what is stored is what the forward wrote into the pages, never what they
    held when the plan ran."""
    layerwise = rig.worker.config.use_layerwise
    a = _prompt(50)
    blocks = rig.blocks(PROMPT)
    for c in rig.caches.values():
        c[blocks] = 7.0  # the pages before the forward
    rig.meta = LMCacheConnectorMetadata(
        requests=[ReqMeta("w", a, blocks, save=SaveSpec(skip=0, end=PROMPT))]
    )
    rig.worker.bind(rig.meta)
    rig.worker.start_load_kv()
    assert rig.worker._saves.wait(timeout=30)
    pool = rig.worker.lmcache_engine.pool
    assert pool.used_bytes == 0  # nothing planned while vLLM's thread enqueues the forward
    for name, c in rig.caches.items():
        rig.worker.wait_for_layer_load(name)
        if layerwise:  # each layer is copied at its save_kv_layer: written before it
            c[blocks] = torch.randn_like(c[blocks])
        rig.worker.save_kv_layer(name)
    if not layerwise:
        assert rig.worker._saves.wait(timeout=30)  # the plan ran, long before the KV exists
        assert pool.used_bytes == 4 * CHUNK_BYTES
        for c in rig.caches.values():  # the device runs the forward's writes after that
            c[blocks] = torch.randn_like(c[blocks])
    written = rig.pages(blocks).clone()
    rig.worker.wait_for_save()
    assert rig.worker._saves.wait(timeout=30)

    rig.check_hit("r", a, written)


def test_a_step_without_layer_hooks_still_saves(rig):
    """A forward whose layers never call ``save_kv_layer`` (e.g. replayed from a CUDA graph)
    still saves: the planning is queued at ``wait_for_save`` instead."""
    a = _prompt(51)
    blocks = rig.blocks(PROMPT)
    rig.meta = LMCacheConnectorMetadata(
        requests=[ReqMeta("g", a, blocks, save=SaveSpec(skip=0, end=PROMPT))]
    )
    rig.worker.bind(rig.meta)
    rig.worker.start_load_kv()
    for c in rig.caches.values():
        c[blocks] = torch.randn_like(c[blocks])
    written = rig.pages(blocks).clone()
    rig.worker.wait_for_save()
    assert rig.worker._saves.wait(timeout=30)
    if rig.worker.config.use_layerwise:  # layerwise saves are per layer hook: nothing saved
        assert len(rig.worker.lmcache_engine.tier) == 0
        return
    rig.check_hit("g", a, written)


def test_a_steps_saves_are_copied_in_one_connector_call(rig, monkeypatch):
    """Batched mode copies every request saved in a step with one ``from_gpu`` call (one
    gather, one set of DMAs); each request still loads back bit for bit. A request whose plan
    fails is dropped alone: the others of its step are stored."""
    if rig.worker.config.use_layerwise:
        pytest.skip("layerwise saves go per layer")
    engine = rig.worker.lmcache_engine
    connector = engine.gpu_connector
    calls = []
    real_from = type(connector).from_gpu
    monkeypatch.setattr(
        connector, "from_gpu", lambda chunks, t: (calls.append(len(chunks)), real_from(connector, chunks, t))[1]
    )  # fmt: skip
    bad = _prompt(72)
    real_plan = type(engine).plan_store

    def plan_store(self, tokens, *a, **k):
        if list(tokens) == bad:
            raise RuntimeError("injected plan failure")
        return real_plan(self, tokens, *a, **k)

    monkeypatch.setattr(type(engine), "plan_store", plan_store)
    prompts = [_prompt(70), bad, _prompt(71)]
    reqs, pages = [], []
    for i, p in enumerate(prompts):
        blocks = rig.blocks(PROMPT)
        reqs.append(ReqMeta(f"s{i}", p, blocks, save=SaveSpec(skip=0, end=PROMPT)))
        pages.append(blocks)
    rig.step(*reqs)
    assert rig.worker._saves.wait(timeout=30)
    assert calls == [8]  # two requests of 4 chunks, one call
    assert engine.lookup(bad) == 0
    for i in (0, 2):
        rig.check_hit(f"r{i}", prompts[i], rig.pages(pages[i]).clone())


def test_a_step_that_never_ends_leaves_no_planned_save_behind(rig):
    """A step bound but never finished (no ``wait_for_save``): the next bind drops its planned
    saves (buffers back to the pool, nothing visible) and a lookup of that prompt does not wait
    for a save that will never come; shutdown drops them too."""
    a = _prompt(60)
    pool = rig.worker.lmcache_engine.pool
    rig.meta = LMCacheConnectorMetadata(
        requests=[ReqMeta("w", a, rig.blocks(PROMPT), save=SaveSpec(skip=0, end=PROMPT))]
    )
    rig.worker.bind(rig.meta)
    rig.meta = LMCacheConnectorMetadata()
    rig.worker.bind(rig.meta)  # the next step; the last one never called wait_for_save
    assert rig.worker._saves.wait(timeout=30)
    assert pool.used_bytes == 0 and rig.worker.lmcache_engine.lookup(a) == 0
    # no unpublished save of it is left for a lookup to wait for (timeout 0: no waiting here)
    assert not rig.worker._unpublished.wait_for("", a, 0, timeout=0)
    assert rig.scheduler.get_num_new_matched_tokens(_request("r", a), 0) == 0

    rig.meta = LMCacheConnectorMetadata(
        requests=[ReqMeta("w2", _prompt(61), rig.blocks(PROMPT), save=SaveSpec(0, PROMPT))]
    )
    rig.worker.bind(rig.meta)
    rig.worker.shutdown()
    assert pool.used_bytes == 0


def test_handle_preemptions_waits_for_queued_copies_only_when_something_was_preempted(rig):
    """vLLM calls ``handle_preemptions`` at the start of every step: with nothing preempted it
    must not wait for the copy thread (the step's bind fences the forward's writes); with a
    preempted request it waits until every queued copy has read its pages.

    No clock: a queued copy reads until it is released, and a wait on its fence releases it.
    The order of what happened tells whether the call waited, and nothing hangs if it is wrong.
    """
    import threading

    from lmcache_vllm.worker.save_queue import ReadFence

    def queue_slow_copy() -> tuple[list[str], threading.Event]:
        order: list[str] = []
        release = threading.Event()

        class WaitedFence(ReadFence):
            def wait(self, timeout: float | None) -> bool:
                if not super().wait(0):  # someone waits for the copy: let it finish
                    order.append("fence waited")
                    release.set()
                return super().wait(timeout)

        def copy() -> None:
            # the bound only keeps a broken fence from hanging the test
            order.append("copy read" if release.wait(60) else "copy gave up")

        rig.worker._saves.submit("slow", copy, WaitedFence())
        return order, release

    order, release = queue_slow_copy()
    rig.worker.handle_preemptions(LMCacheConnectorMetadata())
    order.append("returned")
    release.set()
    assert rig.worker._saves.wait(timeout=60)
    assert order == ["returned", "copy read"]  # it did not wait for the copy

    order, release = queue_slow_copy()
    rig.worker.handle_preemptions(LMCacheConnectorMetadata(preempted=["p"]))
    order.append("returned")
    release.set()
    assert rig.worker._saves.wait(timeout=60)
    assert order == ["fence waited", "copy read", "returned"]  # it returned after the read


@pytest.mark.gpu
def test_next_step_rewrites_saved_pages_only_after_the_save_read_them(tmp_path):
    """CUDA: the step after a save waits for the save's gather on the device, not on the host.

    The GPU is kept busy (``torch.cuda._sleep``) so the save's copy is still queued when the next
    step binds: ``bind`` returns while the GPU is busy, and that step's writes of the same pages
    (NaN) land only after the save gathered them: the chunks load back as they were."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import time

    rig = Rig(tmp_path, budget_chunks=8, device="cuda")
    try:
        a = _prompt(40)
        blocks = rig.blocks(PROMPT)
        original = rig.pages(blocks).clone()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(300_000_000)  # the forward that "wrote" these pages is still running
        rig.step(ReqMeta("w", a, blocks, save=SaveSpec(skip=0, end=PROMPT)))
        rig.meta = LMCacheConnectorMetadata()
        t = time.perf_counter()
        rig.worker.bind(rig.meta)  # the next step
        bind_s = time.perf_counter() - t
        busy = not torch.cuda.current_stream().query()  # the sleep is still running
        for c in rig.caches.values():
            c[blocks] = float("nan")  # that step rewrites the freed blocks
        assert rig.worker._saves.wait(timeout=30)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        gpu_busy_s = start.elapsed_time(end) / 1e3
        assert busy and bind_s < gpu_busy_s / 2, (bind_s, gpu_busy_s)  # no host wait for it

        rig.check_hit("r", a, original)
    finally:
        rig.close()


@pytest.mark.gpu
@pytest.mark.parametrize("via", ["in-process", "socket"])
def test_a_hit_is_copied_to_the_device_at_lookup_and_loads_exactly(tmp_path, via, layerwise):
    """CUDA: the lookup starts the hit's host-to-device copy (on the scheduler's thread when the
    worker is in its process, on the lookup server's thread over the socket; layerwise, in the
    load's layer groups, one event each); the load scatters it (bit-exact); the device copy goes
    with the lease, budget included; past the budget a hit loads from the host as before."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import gc

    from lmcache_vllm.scheduler.lookup_client import LookupClient
    from lmcache_vllm.worker.layerwise_step import layer_groups

    rig = Rig(tmp_path, budget_chunks=8, device="cuda", use_layerwise=layerwise)
    if via == "socket":  # as with tensor parallelism: the worker in another process
        rig.scheduler.lookups.client = LookupClient(rig.scheduler.engine_key, 1, in_process=False)
    try:
        a, b = _prompt(50), _prompt(51)
        src_a, src_b = rig.store("wa", a), rig.store("wb", b)
        want_a, want_b = rig.pages(src_a).clone(), rig.pages(src_b).clone()
        promised = rig.scheduler.get_num_new_matched_tokens(_request("ra", a), 0)
        assert promised == PROMPT - BLOCK
        held = rig.worker._leases._held["ra"].hit
        assert held.prefetched is not None and rig.worker.prefetcher.in_flight_bytes > 0
        groups = [g.stop for g in layer_groups(LAYERS)] if layerwise else []
        assert [stop for stop, _ in held.prefetched.layer_events] == groups
        rig.worker.prefetcher.budget_bytes = rig.worker.prefetcher.in_flight_bytes  # b won't fit
        assert rig.scheduler.get_num_new_matched_tokens(_request("rb", b), 0) == promised
        assert rig.worker._leases._held["rb"].hit.prefetched is None
        dst_a, dst_b = rig.blocks(PROMPT), rig.blocks(PROMPT)
        for c in rig.caches.values():
            c[dst_a + dst_b] = float("nan")
        rig.step(
            ReqMeta("ra", a, dst_a, load=LoadSpec(0, PROMPT, promised)),
            ReqMeta("rb", b, dst_b, load=LoadSpec(0, PROMPT, promised)),
        )
        torch.cuda.synchronize()
        assert rig.worker.get_block_ids_with_load_errors() == set()
        full = promised // BLOCK
        for dst, want in ((dst_a, want_a), (dst_b, want_b)):
            got = rig.pages(dst)[:, :full]
            assert torch.equal(got.view(torch.int32), want[:, :full].view(torch.int32))
        del held
        gc.collect()
        assert rig.worker.prefetcher.in_flight_bytes == 0  # the copy was freed with the lease
    finally:
        rig.close()
