# SPDX-License-Identifier: Apache-2.0
"""No save stores KV that a failed load spoiled (:mod:`lmcache_vllm.worker.failed_loads`).

The rule on its own: a request's mark (its own load failed, or it reads a failed block), what
a save may keep, and when a mark goes (vLLM recomputes the request from it, or it ends).

Then a worker side with a real cache engine, driven as vLLM drives it, for batched and layerwise
saves, on the CPU (synchronous loads) and on the recording stand-in of a CUDA device
(:mod:`lmcache.testing.recording_backend`: loads enqueued, their outcome known at the step's
end). Prompt ``a`` (4 chunks) is stored. Request ``b`` (``a`` and 3 more chunks) then loads
``a``'s hit, which loses its lease while chunk ``BAD`` is damaged in the tier, so the load fails
there. In the same step ``b`` computes chunks 4 and 5, and request ``c`` computes a chunk over
``b``'s blocks (vLLM's prefix cache shares them). Neither stores anything from ``BAD`` on. The
next step, scheduled before vLLM heard of the failure, stores nothing of ``b`` either. Once
``b`` is computed again from ``BAD``, its chunks are stored.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmcache.devices import register_backend
from lmcache.devices import registry as device_registry
from lmcache.keys import chunk_keys
from lmcache.testing.recording_backend import RecordingBackend
from lmcache.tiers import reset_process_cpu_tiers
from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec
from lmcache_vllm.lookup_sockets import engine_key
from lmcache_vllm.lookup_wire import LookupQuery
from lmcache_vllm.testing import connector_vllm_config
from lmcache_vllm.vllm_v1_adapter import load_lmcache_config
from lmcache_vllm.worker import kv_registration
from lmcache_vllm.worker.failed_loads import FailedLoads
from lmcache_vllm.worker.side import WorkerSide

CHUNK, BLOCK, HEADS, HEAD, LAYERS = 64, 16, 2, 32, 2
NUM_BLOCKS = 200
BAD = 2  # the chunk whose load fails: tokens [128, 192)


# ---------------------------------------------------------------------------- the rule


def _req(
    rid: str,
    blocks: list[int],
    computed_start: int,
    save: tuple[int, int] | None = None,
    load: tuple[int, int] | None = None,
) -> ReqMeta:
    end = max(save[1] if save else 0, load[1] if load else 0)
    return ReqMeta(
        rid,
        list(range(end)),
        blocks,
        load=LoadSpec(load[0], load[1], load[1]) if load else None,
        save=SaveSpec(*save) if save else None,
        computed_start=computed_start,
    )


def _step(failed: FailedLoads, *reqs: ReqMeta) -> None:
    failed.begin_step(LMCacheConnectorMetadata(requests=list(reqs)))


def test_own_failed_load_cuts_the_save_at_its_chunk() -> None:
    failed = FailedLoads(BLOCK, CHUNK)
    blocks = list(range(1, 25))  # 384 tokens
    b = _req("b", blocks, 256, save=(256, 384), load=(0, 256))
    _step(failed, b)
    assert failed.limit(b) is None and failed.allowed(b) is b  # nothing failed: untouched
    failed.failed(b, 150, blocks[150 // BLOCK : 16])
    assert failed.limit(b) == 150
    assert failed.allowed(b) is None  # every chunk it saves ends after 150
    early = _req("b", blocks, 256, save=(0, 384), load=(0, 256))
    kept = failed.allowed(early)
    assert kept is not None and kept.save == SaveSpec(0, 128)  # chunks 0-1 end by 150
    assert failed.spoils(b, 384) and not failed.spoils(b, 128)
    short = _req("b", blocks, 256, save=(0, 128))
    assert failed.allowed(short) is short  # ends before the failure: untouched
    assert failed.cut_saves == 3


def test_a_request_reading_a_failed_block_is_marked() -> None:
    failed = FailedLoads(BLOCK, CHUNK)
    blocks = list(range(1, 17))
    b = _req("b", blocks, 256, save=(256, 256), load=(0, 256))
    _step(failed, b)
    failed.failed(b, 128, blocks[8:16])
    # c shares b's blocks up to 192 (vLLM's prefix cache) and computes [192, 256)
    c = _req("c", [*blocks[:12], 50, 51, 52, 53], 192, save=(0, 256))
    kept = failed.allowed(c)
    assert kept is not None and kept.save == SaveSpec(0, 128)
    # d writes b's failed blocks itself (its own load, or its computed tokens): not marked
    d = _req("d", [60, 61, 62, 63, 64, 65, 66, 67, *blocks[8:16]], 128, save=(128, 256))
    e = _req("e", blocks[8:16] + [70] * 8, 256, save=(0, 256), load=(0, 256))
    assert failed.allowed(d) is d and failed.allowed(e) is e
    assert len(failed) == 2  # b and c


def test_marks_last_until_vllm_recomputes_or_the_request_ends() -> None:
    failed = FailedLoads(BLOCK, CHUNK)
    blocks = list(range(1, 29))  # 448 tokens
    b = _req("b", blocks, 256, save=(256, 384), load=(0, 256))
    _step(failed, b)  # step N: b's load fails at 128
    failed.failed(b, 128, blocks[8:16])
    # step N + 1, scheduled before vLLM heard: b goes on from 384, f is new and reads block 8
    b1 = _req("b", blocks, 384, save=(384, 448))
    f = _req("f", [*blocks[:12], 90, 91, 92, 93], 192, save=(0, 256))
    _step(failed, b1, f)
    assert failed.allowed(b1) is None
    kept = failed.allowed(f)
    assert kept is not None and kept.save == SaveSpec(0, 128)
    # step N + 2: vLLM rolled b back to 128 (recompute): its chunks are right again
    b2 = _req("b", blocks, 128, save=(128, 448))
    g = _req("g", [*blocks[:12], 95, 96, 97, 98], 192, save=(0, 256))
    _step(failed, b2, g)
    assert failed.allowed(b2) is b2
    assert failed.allowed(g) is g  # the failed blocks count no more: vLLM knows of them
    assert failed.limit(_req("f", f.block_ids, 256)) == 128  # still marked: not recomputed
    failed.end(["f"])
    assert len(failed) == 0
    # a step that computes b from after its mark keeps it ("fail" ends b: end() drops it)
    failed.failed(b2, 200, [])
    _step(failed, _req("b", blocks, 256, save=(256, 448)))
    assert failed.limit(b2) == 200
    failed.end(iter(["b"]))
    assert failed.limit(b2) is None


# ---------------------------------------------------------------------------- a worker side


@contextlib.contextmanager
def _device(kind: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``cpu``: the CPU backend (synchronous loads); ``recording``: the recording stand-in of a
    CUDA device (streams: loads enqueued, saves copied on a store stream)."""
    if kind == "recording":
        monkeypatch.setattr(device_registry, "_BACKENDS", dict(device_registry._BACKENDS))
        register_backend(RecordingBackend("cpu"), clobber=True)
        monkeypatch.setattr(kv_registration, "probe_cpu_kv_format", lambda *a: "kv_concat")
    yield


class Rig:
    """A worker side over per-layer caches, steps driven as vLLM drives them."""

    def __init__(self, tmp_path: Any, layerwise: bool, kind: str) -> None:
        reset_process_cpu_tiers()
        vc = connector_vllm_config(
            engine_id=f"failed-{kind}-{layerwise}-{tmp_path.name}",
            block_size=BLOCK,
            head_size=HEAD,
            extra_config={
                "lmcache.chunk_size": CHUNK,
                "lmcache.max_local_cpu_size": 0.05,
                "lmcache.checksum": True,
                "lmcache.use_layerwise": layerwise,
            },
        )
        if kind == "recording":
            vc.device_config = SimpleNamespace(device_type="cuda")
        self.meta: object = LMCacheConnectorMetadata()
        self.worker = WorkerSide(vc, load_lmcache_config(vc), engine_key(vc), 1, 0, self._meta)
        if kind == "recording":  # vLLM's LBNHC pages, as the stress test lays them out
            raw = torch.randn(LAYERS, NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD)
            views = [raw[i].permute(0, 2, 1, 3) for i in range(LAYERS)]
        else:
            views = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD) for _ in range(LAYERS)]
        self.caches = {f"model.layers.{i}.self_attn.attn": v for i, v in enumerate(views)}
        self.worker.register_kv_caches(self.caches)
        engine = self.worker.lmcache_engine
        assert engine is not None
        self.engine = engine
        self.asynchronous = self.worker._loads.asynchronous
        self.next_block = 1

    def _meta(self) -> object:
        return self.meta

    def blocks(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // BLOCK)
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def step(self, *reqs: ReqMeta, finished: tuple[str, ...] = ()) -> set[int]:
        """One vLLM step: its hooks in vLLM's order; returns the blocks reported as load
        errors, once every save it queued is committed or dropped."""
        w = self.worker
        self.meta = LMCacheConnectorMetadata(requests=list(reqs))
        w.handle_preemptions(self.meta)
        w.bind(self.meta)
        w.start_load_kv()
        for name, cache in self.caches.items():
            w.wait_for_layer_load(name)
            for req in reqs:  # the forward writes the tokens it computes
                start = req.computed_start
                end = req.save.end if req.save is not None else start
                for pos in range(start, end):
                    cache[req.block_ids[pos // BLOCK], :, pos % BLOCK] = float(pos % 97)
            w.save_kv_layer(name)
        w.wait_for_save()
        w.get_finished(set(finished))
        errors = w.get_block_ids_with_load_errors()
        assert w._saves.wait(timeout=30)
        return errors

    def stored(self, tokens: list[int]) -> list[bool]:
        keys = chunk_keys(tokens, self.engine.metadata.fingerprint(), CHUNK, salt="\0")
        return [self.engine.tier.contains(k) for k in keys[: len(tokens) // CHUNK]]

    def fail_next_load(self, tokens: list[int]) -> list[str]:
        """The next load loses its lease while chunk ``BAD`` of ``tokens`` is damaged in the
        tier, so it reads the tier and that chunk fails its checksum."""
        key = chunk_keys(tokens, self.engine.metadata.fingerprint(), CHUNK, salt="\0")[BAD]
        tier = self.engine.tier
        leases = self.worker._leases
        take = leases.take
        fired: list[str] = []

        def faulty(req_id: str) -> tuple[Any, Any]:
            held, looked = take(req_id)
            if fired or held is None:
                return held, looked
            fired.append(req_id)
            held.release()
            tier._entries[key].lease.tensor.view(-1).view(torch.uint8)[4321] ^= 0x20
            return None, None

        leases.take = faulty  # type: ignore[method-assign]
        return fired


@pytest.mark.parametrize("layerwise", [False, True], ids=["batched", "layerwise"])
@pytest.mark.parametrize("kind", ["cpu", "recording"])
def test_failed_load_stores_nothing_computed_over_it(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, kind: str, layerwise: bool
) -> None:
    rng = random.Random(7)
    a = [rng.randrange(1, 30_000) for _ in range(4 * CHUNK)]
    b = a + [rng.randrange(1, 30_000) for _ in range(3 * CHUNK)]
    c = a[: 3 * CHUNK] + [rng.randrange(1, 30_000) for _ in range(CHUNK)]
    with _device(kind, monkeypatch):
        rig = Rig(tmp_path, layerwise, kind)
        try:
            assert rig.asynchronous == (kind == "recording")
            rig.step(ReqMeta("a", a, rig.blocks(len(a)), save=SaveSpec(0, len(a))))
            assert rig.stored(a) == [True] * 4
            assert rig.worker._lookup(LookupQuery("b", b, "")) == len(a)
            fired = rig.fail_next_load(a)
            blocks_b = rig.blocks(len(b))
            cut = rig.worker._loads.failed.cut_saves

            # step N: b's load fails at chunk BAD; b computes chunks 4-5, c (sharing b's
            # blocks up to 192) computes its chunk 3
            load = ReqMeta(
                "b",
                b[:384],
                blocks_b,
                load=LoadSpec(0, 256, 256),
                save=SaveSpec(256, 384),
                computed_start=256,
            )
            share = ReqMeta(
                "c", c, blocks_b[:12] + rig.blocks(CHUNK), save=SaveSpec(0, 256), computed_start=192
            )
            errors = rig.step(load, share)
            assert fired == ["b"]
            assert errors and set(blocks_b[BAD * CHUNK // BLOCK : 16]) <= errors, errors
            # a's chunk 3 stays; the damaged chunk left the tier; nothing of b past it came
            assert rig.stored(b) == [True, True, False, True, False, False, False]
            assert rig.stored(c) == [True] * BAD + [False] * (4 - BAD)
            assert rig.worker._loads.failed.cut_saves >= cut + 2

            # step N + 1, scheduled before vLLM heard of the failure: b goes on from 384
            rig.step(ReqMeta("b", b, blocks_b, save=SaveSpec(384, 448), computed_start=384))
            assert rig.stored(b) == [True, True, False, True, False, False, False]

            # step N + 2: vLLM recomputes b from BAD (policy "recompute"): stored as usual
            again = ReqMeta("b", b, blocks_b, save=SaveSpec(128, 448), computed_start=128)
            assert rig.step(again, finished=("c",)) == set()
            assert rig.stored(b) == [True] * 7
            rig.step(finished=("b",))
            assert len(rig.worker._loads.failed) == 0
            assert rig.worker.held_leases == 0
        finally:
            rig.worker.shutdown()
            reset_process_cpu_tiers()
