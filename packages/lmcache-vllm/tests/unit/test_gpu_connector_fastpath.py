# SPDX-License-Identifier: Apache-2.0
"""The fused all-layer path of ``VLLMPagedConnector`` against its per-layer path, bit for bit.

The fused path (one strided view over every layer, chunk-major staging, merged host copies) is
taken whenever the layers are views of one buffer with a uniform step; the per-layer path is the
reference. Runs on CPU tensors, and on CUDA tensors too when a GPU is present.
"""

from __future__ import annotations

import pytest
import torch

from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import ChunkTransfer, EngineInfo, TransferSpec
from lmcache.memory.pinned_pool import ALIGNMENT
from lmcache.metadata import LMCacheMetadata
from lmcache_vllm.gpu_connector import VLLMPagedConnector
from lmcache_vllm.testing.chunk_buffers import chunk_buffers as _buffers
from lmcache_vllm.transfer.fused.plan import add_run
from lmcache_vllm.transfer.token_transfer import TokenTransfer

BLOCK, NUM_BLOCKS, LAYERS, CHUNK = 4, 40, 3, 8
# CUDA cases carry the ``gpu`` mark, so ``pytest -m gpu`` (``nox -s gpu``) runs them
DEVICES = ["cpu"] + (
    [pytest.param("cuda", marks=pytest.mark.gpu)] if torch.cuda.is_available() else []
)


def _md(kind: str) -> LMCacheMetadata:
    common = dict(
        model_name="fast",
        world_size=1,
        worker_id=0,
        local_worker_id=0,
        local_world_size=1,
        num_layers=LAYERS,
        chunk_size=CHUNK,
    )
    if kind == "mla":
        return LMCacheMetadata(
            kv_dtype=torch.bfloat16, num_kv_heads=1, head_size_k=24, head_size_v=0,
            use_mla=True, **common,
        )  # fmt: skip
    hv = 4 if kind == "uneven" else 8
    return LMCacheMetadata(
        kv_dtype=torch.bfloat16, num_kv_heads=2, head_size_k=8, head_size_v=hv, **common
    )


def _caches(kind: str, md: LMCacheMetadata, device: str, seed: int) -> list[torch.Tensor]:
    """Per-layer views as vLLM hands them (``kind`` picks physical order / format)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "mla":
        phys = torch.randn(LAYERS, NUM_BLOCKS, BLOCK, md.head_size_k, generator=g)
        phys = phys.to(md.kv_dtype).to(device)
        return [phys[i] for i in range(LAYERS)]
    c = md.head_size_k + md.head_size_v
    if kind == "lbhnc":
        phys = torch.randn(LAYERS, NUM_BLOCKS, md.num_kv_heads, BLOCK, c, generator=g)
        phys = phys.to(md.kv_dtype).to(device)
        return [phys[i] for i in range(LAYERS)]
    phys = torch.randn(LAYERS, NUM_BLOCKS, BLOCK, md.num_kv_heads, c, generator=g)
    phys = phys.to(md.kv_dtype).to(device)  # lbnhc / uneven: FlashAttention order
    views = [phys[i].permute(0, 2, 1, 3) for i in range(LAYERS)]
    if kind == "separate":  # one allocation per layer: the per-layer path
        views = [v.clone() for v in views]
    return views


def _conn(kind: str, md: LMCacheMetadata, caches: list[torch.Tensor], fused: bool):
    fmt = "mla" if kind == "mla" else "kv_concat"
    dev = caches[0].device.type
    conn = VLLMPagedConnector(
        LMCacheConfig(chunk_size=CHUNK),
        md,
        EngineInfo("vllm", dev, caches, {"block_size": BLOCK}),
        {"kv_format": fmt},
    )
    if not fused:
        # force the per-layer, token-level reference path
        conn.transfer = TokenTransfer(conn.cache, conn.backend, conn.device)
    return conn


RANGE_SETS = {
    "contiguous": [(0, 8), (8, 16), (16, 24), (24, 29)],
    "gapped": [(0, 8), (16, 24), (24, 29), (32, 40)],
    "single": [(8, 13)],
}


def _slots(n: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm((NUM_BLOCKS - 1) * BLOCK, generator=g)[:n] + BLOCK
    return slots.to(device)


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["adjacent", "scattered", "strided"])
@pytest.mark.parametrize("ranges", list(RANGE_SETS), ids=list(RANGE_SETS))
@pytest.mark.parametrize("kind", ["lbnhc", "lbhnc", "uneven", "mla", "separate"])
@pytest.mark.parametrize("slots_on", ["host", "device"])
@pytest.mark.parametrize("pieces", ["one", "per-layer"])
def test_fused_matches_per_layer(kind, ranges, layout, device, slots_on, pieces):
    md = _md(kind)
    rng = RANGE_SETS[ranges]
    n = max(e for _, e in rng)
    src = _caches(kind, md, device, 1)
    fast = _conn(kind, md, src, fused=True)
    if pieces == "per-layer":  # pipelined: a side-stream host copy per chunk layer (CUDA)
        fast.transfer.views.pipeline_bytes = 1
    ref = _conn(kind, md, src, fused=False)
    assert (fast.transfer.views.fused is None) == (
        kind == "separate"
    )  # separate: one view per layer
    assert (fast.transfer.views.fused_layers is not None) == (kind == "separate")
    slots = _slots(n, 2, device if slots_on == "device" else "cpu")
    with _buffers(fast, rng, layout) as a, _buffers(fast, rng, layout) as b:
        fast.from_gpu([ChunkTransfer(s, e, t) for (s, e), t in zip(rng, a, strict=True)],
                      TransferSpec(slots))  # fmt: skip
        ref.from_gpu([ChunkTransfer(s, e, t) for (s, e), t in zip(rng, b, strict=True)],
                     TransferSpec(slots))  # fmt: skip
        for x, y in zip(a, b, strict=True):
            assert _eq(x, y)
        if layout == "adjacent" and ranges == "contiguous":
            plan = fast.transfer.views.staging_plan(range(LAYERS), [ChunkTransfer(s, e, t) for (s, e), t in zip(
                rng, a, strict=True)], 0, 0)  # fmt: skip
            assert len(plan.ops) == 2  # three full chunks in one op, then the tail
            if fast.chunk_nbytes(CHUNK) % ALIGNMENT == 0:  # no padding: back to back
                assert len(plan.runs) == 1
        # load into two identical engines, skipping into the second chunk
        for skip in (0, rng[0][0] + 3, rng[1][0] + 1 if len(rng) > 1 else rng[0][1]):
            dst_fast = _caches(kind, md, device, 3)
            dst_ref = _caches(kind, md, device, 3)
            cf, cr = _conn(kind, md, dst_fast, True), _conn(kind, md, dst_ref, False)
            cf.transfer.views.pipeline_bytes = fast.transfer.views.pipeline_bytes
            lslots = _slots(n, 4, device if slots_on == "device" else "cpu")
            lslots[:skip] = -1  # held by the engine: never read
            chunks = [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, a, strict=True)]
            cf.to_gpu(chunks, TransferSpec(lslots, skip_tokens=skip))
            cr.to_gpu(chunks, TransferSpec(lslots, skip_tokens=skip))
            cf.synchronize()
            cr.synchronize()
            for x, y in zip(dst_fast, dst_ref, strict=True):
                assert _eq(x, y)
            untouched = _caches(kind, md, device, 3)
            if skip >= n:
                for x, y in zip(dst_fast, untouched, strict=True):
                    assert _eq(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["lbnhc", "uneven", "mla", "separate"])
def test_layerwise_fused_matches_batched(kind, device):
    md = _md(kind)
    rng = RANGE_SETS["contiguous"]
    src = _caches(kind, md, device, 5)
    conn = _conn(kind, md, src, fused=True)
    slots = _slots(29, 6, device)
    with _buffers(conn, rng, "adjacent") as a, _buffers(conn, rng, "adjacent") as b:
        ca = [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, a, strict=True)]
        cb = [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, b, strict=True)]
        conn.from_gpu(ca, TransferSpec(slots))
        for layer in range(LAYERS):
            conn.from_gpu_layer(layer, cb, TransferSpec(slots))
        for x, y in zip(a, b, strict=True):
            assert _eq(x, y)
        d1, d2 = _caches(kind, md, device, 7), _caches(kind, md, device, 7)
        c1, c2 = _conn(kind, md, d1, True), _conn(kind, md, d2, True)
        lslots = _slots(29, 8, device)
        c1.to_gpu(ca, TransferSpec(lslots, skip_tokens=5))
        for layer in range(LAYERS):
            c2.to_gpu_layer(layer, cb, TransferSpec(lslots, skip_tokens=5))
        c1.synchronize()
        c2.synchronize()
        for x, y in zip(d1, d2, strict=True):
            assert _eq(x, y)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["lbnhc", "separate"])
def test_load_without_room_for_its_staging_goes_layer_by_layer(kind, device, caplog):
    """A load whose all-layer staging buffer does not fit on the device (it lies outside the
    engine's profiled memory) loads one layer at a time instead: same bytes, no failed load."""
    md = _md(kind)
    rng = RANGE_SETS["contiguous"]
    conn = _conn(kind, md, _caches(kind, md, device, 5), fused=True)
    slots = _slots(29, 6, device)
    with _buffers(conn, rng, "adjacent") as bufs:
        chunks = [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, bufs, strict=True)]
        conn.from_gpu(chunks, TransferSpec(slots))
        want_caches, got_caches = _caches(kind, md, device, 7), _caches(kind, md, device, 7)
        want, got = _conn(kind, md, want_caches, True), _conn(kind, md, got_caches, True)
        one_layer = 29 * md.kv_width * 2  # bytes of one layer of every token (bf16)
        sizes = []

        def tight(nbytes):  # the device has room for one layer's staging only
            sizes.append(nbytes)
            if nbytes > one_layer:
                raise torch.OutOfMemoryError("injected: no room")
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

        got.transfer.views.new_staging = tight
        lslots = _slots(29, 8, device)
        want.to_gpu(chunks, TransferSpec(lslots, skip_tokens=5))
        with caplog.at_level("WARNING"):
            got.to_gpu(chunks, TransferSpec(lslots, skip_tokens=5))
        want.synchronize()
        got.synchronize()
        assert sizes[0] > one_layer and len(sizes) == 1 + LAYERS  # refused, then per layer
        assert "one layer at a time" in caplog.text
        for x, y in zip(want_caches, got_caches, strict=True):
            assert _eq(x, y)
        fresh = _caches(kind, md, device, 7)
        assert not all(_eq(x, y) for x, y in zip(fresh, got_caches, strict=True))


def test_aliased_layers_use_the_per_layer_path():
    md = _md("lbnhc")
    caches = _caches("lbnhc", md, "cpu", 9)
    caches[2] = caches[1]  # two layers on the same memory (a shared-KV model)
    conn = _conn("lbnhc", md, caches, True)
    assert (
        conn.transfer.views.fused is None and conn.transfer.views.fused_layers is not None
    )  # one view per layer
    rng = RANGE_SETS["contiguous"]
    slots = _slots(29, 12, "cpu")
    with _buffers(conn, rng, "adjacent") as a:
        conn.from_gpu([ChunkTransfer(s, e, t) for (s, e), t in zip(rng, a, strict=True)],
                      TransferSpec(slots))  # fmt: skip
        for t in a:  # layers 1 and 2 gathered the same bytes
            assert _eq(t[1], t[2])
            assert not _eq(t[0], t[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots_on", ["host", "device"])
@pytest.mark.parametrize("bad", [-1, NUM_BLOCKS * BLOCK])
def test_bad_slot_rejected_and_engine_untouched(device, slots_on, bad):
    md = _md("lbnhc")
    caches = _caches("lbnhc", md, device, 10)
    conn = _conn("lbnhc", md, caches, True)
    before = [c.clone() for c in caches]
    rng = RANGE_SETS["contiguous"]
    slots = _slots(29, 11, "cpu")
    slots[20] = bad
    slots = slots.to(device if slots_on == "device" else "cpu")
    # the connector's own check names the bad entry (not some later indexing error)
    why = r"-1 for tokens \[20\]" if bad < 0 else rf"slot {bad} is beyond the cache"
    with _buffers(conn, rng, "adjacent") as a:
        chunks = [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, a, strict=True)]
        with pytest.raises(ValueError, match=why):
            conn.from_gpu(chunks, TransferSpec(slots))
        with pytest.raises(ValueError, match=why):
            conn.to_gpu(chunks, TransferSpec(slots, skip_tokens=3))
        conn.synchronize()
        for x, y in zip(caches, before, strict=True):
            assert _eq(x, y)
        # skipping past the bad slot: loads tokens 21.. like the per-layer reference path.
        # Fresh bytes first: a rejected from_gpu with device slots may have filled the buffers
        # (its check answers after the copy), and loading those back would change nothing.
        for t in a:
            t.copy_(torch.randn(t.shape).to(t.dtype))
        conn.to_gpu(chunks, TransferSpec(slots, skip_tokens=21))
        conn.synchronize()
        ref_caches = _caches("lbnhc", md, device, 10)
        _conn("lbnhc", md, ref_caches, False).to_gpu(chunks, TransferSpec(slots, skip_tokens=21))
        assert not all(_eq(x, y) for x, y in zip(caches, before, strict=True))
        for x, y in zip(caches, ref_caches, strict=True):
            assert _eq(x, y)


def test_plan_pieces_split_ops_and_runs():
    md = _md("lbnhc")
    conn = _conn("lbnhc", md, _caches("lbnhc", md, "cpu", 12), True)
    rng = RANGE_SETS["contiguous"]
    cb = conn.chunk_nbytes(CHUNK)
    with _buffers(conn, rng, "adjacent") as bufs:
        chunks = [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, bufs, strict=True)]
        one = conn.transfer.views.staging_plan(range(LAYERS), chunks, 0, 0)
        assert one.pieces == 1 and len(one.runs) == 1 and len(one.ops) == 2
        per = conn.transfer.views.staging_plan(range(LAYERS), chunks, 0, cb)
        assert per.pieces == 4 and len(per.runs) == 4 and len(per.ops) == 4
        assert [r.piece for r in per.runs] == [0, 1, 2, 3] == [o.piece for o in per.ops]
        two = conn.transfer.views.staging_plan(range(LAYERS), chunks, 0, 2 * cb)
        assert two.pieces == 2 and [o.piece for o in two.ops] == [0, 1, 1]
        assert [(o.g, o.n) for o in two.ops] == [(2, 8), (1, 8), (1, 5)]
        # a chunk bigger than a piece is cut by layers: one op and one host copy per layer
        cut = conn.transfer.views.staging_plan(range(LAYERS), chunks[:1], 0, cb // LAYERS)
        assert cut.pieces == LAYERS
        assert [(o.l0, o.l1) for o in cut.ops] == [(i, i + 1) for i in range(LAYERS)]
        assert [r.nbytes for r in cut.runs] == [cb // LAYERS] * LAYERS


@pytest.mark.parametrize("kind", ["lbnhc", "lbhnc", "uneven", "mla"])
@pytest.mark.parametrize("piece", ["whole", "per-layer", "two-chunks"])
def test_pieces_match_per_layer_path(kind, piece):
    """Every way of cutting a call into pieces moves the bytes the per-layer path moves (CPU
    runs the pieces in order). The reference is the per-layer path, not ``from_gpu`` of the
    same connector: on CPU that is the one-piece plan itself."""
    md = _md(kind)
    rng = RANGE_SETS["gapped"]
    src = _caches(kind, md, "cpu", 13)
    conn = _conn(kind, md, src, True)
    cb = conn.chunk_nbytes(CHUNK)
    pb = {"whole": 0, "per-layer": cb // LAYERS, "two-chunks": 2 * cb}[piece]
    slots = _slots(40, 14, "cpu")
    with _buffers(conn, rng, "adjacent") as a, _buffers(conn, rng, "adjacent") as b:
        ca = [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, a, strict=True)]
        cb_ = [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, b, strict=True)]
        _conn(kind, md, src, False).from_gpu(ca, TransferSpec(slots))
        plan = conn.transfer.views.staging_plan(range(LAYERS), cb_, 0, pb)
        staging = torch.empty(plan.total * plan.row_bytes, dtype=torch.uint8)
        idx, _ = conn.transfer.views.slot_indices(plan, TransferSpec(slots))
        for p in range(plan.pieces):
            conn.transfer.views.gather(plan, staging, range(LAYERS), idx, p)
            conn.transfer.views.copy_runs(plan, staging, to_host=True, piece=p)
        for x, y in zip(a, b, strict=True):
            assert _eq(x, y)
        dst1, dst2 = _caches(kind, md, "cpu", 15), _caches(kind, md, "cpu", 15)
        c1, c2 = _conn(kind, md, dst1, False), _conn(kind, md, dst2, True)
        lslots = _slots(40, 16, "cpu")
        spec = TransferSpec(lslots, skip_tokens=3)
        c1.to_gpu(ca, spec)
        plan = c2.transfer.views.staging_plan(range(LAYERS), ca, 3, pb)
        staging = torch.empty(plan.total * plan.row_bytes, dtype=torch.uint8)
        idx, _ = c2.transfer.views.slot_indices(plan, spec)
        for p in range(plan.pieces):
            c2.transfer.views.copy_runs(plan, staging, to_host=False, piece=p)
            c2.transfer.views.scatter(plan, staging, range(LAYERS), idx, p)
        for x, y in zip(dst1, dst2, strict=True):
            assert _eq(x, y)


def test_chunks_at_a_constant_step_merge_into_one_strided_run():
    """Equal chunks with equal gaps between them move in one strided (2D) copy; a chunk of
    another size or step starts a new run. Moving the runs row by row (the fallback without
    the CUDA runtime) puts every byte where one copy per chunk puts it."""
    md = _md("lbnhc")
    conn = _conn("lbnhc", md, _caches("lbnhc", md, "cpu", 14), True)
    rng = [(0, 8), (8, 16), (16, 24), (24, 29)]
    cb = conn.chunk_nbytes(CHUNK)
    with _buffers(conn, rng, "scattered") as bufs:
        for i, t in enumerate(bufs):
            t.copy_(torch.randn(t.shape).to(t.dtype) + i)
        chunks = [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, bufs, strict=True)]
        plan = conn.transfer.views.staging_plan(range(LAYERS), chunks, 0, 0)
        steps = {bufs[i + 1].data_ptr() - bufs[i].data_ptr() for i in range(2)}
        assert len(steps) == 1 and steps.pop() > cb  # the pool left equal gaps
        assert [(r.rows, r.nbytes) for r in plan.runs] == [(3, cb), (1, conn.chunk_nbytes(5))]
        assert plan.runs[0].dev_pitch == cb
        staging = torch.zeros(plan.total * plan.row_bytes, dtype=torch.uint8)
        conn.transfer.views.copy_runs(plan, staging, to_host=False)
        pos = 0
        for (s, e), t in zip(rng, bufs, strict=True):
            nbytes = (e - s) * plan.row_bytes
            assert torch.equal(staging[pos : pos + nbytes], t.reshape(-1).view(torch.uint8))
            pos += nbytes
        # the layer groups of equal adjacent chunks: one strided run per group
        grouped = type(plan)(plan.row_bytes, plan.layer_bytes, [])
        for piece, (a, b) in enumerate([(0, 1), (1, LAYERS)]):
            for i, c in enumerate(chunks[:3]):
                lo = i * CHUNK * plan.row_bytes + a * CHUNK * plan.layer_bytes
                add_run(grouped, lo, (b - a) * CHUNK * plan.layer_bytes, c.buffer[a:b], piece)
        assert [(r.rows, r.piece) for r in grouped.runs] == [(3, 0), (3, 1)]


def _recorded_backend(conn):
    """Swap ``conn``'s device backend for a recording stand-in of a CUDA device (its copies
    run at once on the CPU tensors; the real backend moves these bytes in the CUDA tests)."""
    from lmcache.testing.recording_backend import RecordingBackend

    rec = RecordingBackend("cuda")
    conn.backend = conn.transfer.views.backend = rec
    return rec


def test_a_strided_run_is_one_2d_copy_with_both_pitches():
    """A strided run goes to the device backend as one 2D copy: destination and source with
    their own pitches, the row width and count, on the current stream, both directions; the
    bytes land where one copy per chunk puts them."""
    md = _md("lbnhc")
    conn = _conn("lbnhc", md, _caches("lbnhc", md, "cpu", 15), True)
    rng = [(0, 8), (8, 16), (16, 24)]
    with _buffers(conn, rng, "scattered") as bufs:
        for i, t in enumerate(bufs):
            t.copy_(torch.randn(t.shape).to(t.dtype) + i)
        chunks = [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, bufs, strict=True)]
        plan = conn.transfer.views.staging_plan(range(LAYERS), chunks, 0, 0)
        (run,) = plan.runs
        staging = torch.zeros(plan.total * plan.row_bytes, dtype=torch.uint8)
        rec = _recorded_backend(conn)
        conn.transfer.views.copy_runs(plan, staging, to_host=False)
        expect = [t.clone() for t in bufs]
        for t in bufs:
            t.zero_()
        conn.transfer.views.copy_runs(plan, staging, to_host=True)
        assert all(torch.equal(t, e) for t, e in zip(bufs, expect, strict=True))
        width, pitch_h, pitch_d = run.nbytes, run.host_pitch, run.dev_pitch
        stream = rec.current_stream(conn.device)
        assert [(c.name, c.detail) for c in rec.calls if c.name.startswith("copy")] == [
            ("copy_2d", ((pitch_d, pitch_h, width, 3), stream)),  # host to device
            ("copy_2d", ((pitch_h, pitch_d, width, 3), stream)),  # device to host
        ]


def test_plain_runs_are_one_batched_copy():
    """Contiguous one-row runs of a piece go to the device backend as one batched copy (chunks
    back to back in the pool merge into one run; a chunk elsewhere is a second entry)."""
    md = _md("lbnhc")
    conn = _conn("lbnhc", md, _caches("lbnhc", md, "cpu", 16), True)
    rng = [(0, 8), (8, 16), (16, 20)]
    with _buffers(conn, rng, "adjacent") as bufs:
        chunks = [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, bufs, strict=True)]
        plan = conn.transfer.views.staging_plan(range(LAYERS), chunks, 0, 0)
        (run,) = plan.runs  # back to back: one run of all three chunks
        assert run.rows == 1 and run.count == 3 and run.contiguous
        assert run.nbytes == sum(t.numel() * t.element_size() for t in bufs)
    rng = [(0, 8), (8, 12), (12, 20)]  # unequal sizes, scattered: three one-row runs
    with _buffers(conn, rng, "scattered") as bufs:
        for i, t in enumerate(bufs):
            t.copy_(torch.randn(t.shape).to(t.dtype) + i)
        chunks = [ChunkTransfer(s, e, t) for (s, e), t in zip(rng, bufs, strict=True)]
        plan = conn.transfer.views.staging_plan(range(LAYERS), chunks, 0, 0)
        staging = torch.zeros(plan.total * plan.row_bytes, dtype=torch.uint8)
        rec = _recorded_backend(conn)
        conn.transfer.views.copy_runs(plan, staging, to_host=False)
        copies = [c for c in rec.calls if c.name.startswith("copy")]
        assert [(r.rows, r.count) for r in plan.runs] == [(1, 1)] * 3
        sizes = tuple(conn.chunk_nbytes(e - s) for s, e in rng)
        stream = rec.current_stream(conn.device)
        assert [(c.name, c.detail) for c in copies] == [("copy_batch", (sizes, stream))]
        pos = 0
        for (s, e), t in zip(rng, bufs, strict=True):
            nbytes = (e - s) * plan.row_bytes
            assert torch.equal(staging[pos : pos + nbytes], t.reshape(-1).view(torch.uint8))
            pos += nbytes
