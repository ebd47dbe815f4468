# SPDX-License-Identifier: Apache-2.0
# Triton reads kernel parameters' annotations as its own type hints: the kernels stay unannotated.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
"""The ``torch.ops.lmcache`` kernels ported to Triton: the fallback where the binary is absent.

Triton ships with CUDA builds of torch and compiles on the user's machine without nvcc (it needs
a C compiler for its launcher). Each op takes the same arguments, in the same order, as its
schema, and gives the same bytes and checksums as the CUDA kernels and
:mod:`lmcache.gpu_ops._ref` (the tests hold it to both). One call is one launch (plus one for the
checksums where a row is not whole 64-bit words, as in the CUDA op), whatever the number of
chunks, and nothing reads a device value on the host.

**Copy kernel.** Program ``(i, layer)`` moves tokens ``[i * BLOCK_T, (i + 1) * BLOCK_T)`` of one
layer. A token finds its chunk by binary search over ``chunk_offsets``; a row of a malformed
chunk is not moved, and a slot ``< 0`` or ``>= capacity`` is skipped. Bytes move as integers of
the widest unit (1 to 8 bytes) that every address, stride and head size allows. With checksums
and 8-byte units each program sums the 64-bit words of its rows in the same pass (the final
staging bytes: on gather the rows of skipped tokens are read back) and adds them with one
atomic for the tile's first chunk and one per token of any later chunk; ``int64`` atomics wrap
like the CUDA kernel's ``uint64`` ones.

**Region kernel** (``checksum_chunks``, and the copies' checksums with narrower units): program
``(i, c)`` sums every ``G``-th block of chunk ``c``'s words.

Layers are addressed from layer 0's pointer plus a per-layer offset in units (a small device
tensor, cached per layout so a call does not upload it again).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from lmcache.gpu_ops._checks import check_checksum_args, check_copy, check_host_offsets

__all__ = ["checksum_chunks", "gather_kv", "scatter_kv"]

_TILE = 4096  # elements of one program's tile: 32 KiB of 8-byte units
_CACHE_MAX = 512


@triton.jit
def _mix64(x):
    """splitmix64's finalizer of uint64 ``x`` (wrap-around multiply, logical shifts)."""
    x = x ^ (x >> 30)
    x = x * 0xBF58476D1CE4E5B9
    x = x ^ (x >> 27)
    x = x * 0x94D049BB133111EB
    return x ^ (x >> 31)


@triton.jit
def _unit_ptr(ptr, UNIT: tl.constexpr):
    if UNIT == 8:
        return ptr.to(tl.pointer_type(tl.int64))
    elif UNIT == 4:
        return ptr.to(tl.pointer_type(tl.int32))
    elif UNIT == 2:
        return ptr.to(tl.pointer_type(tl.int16))
    else:
        return ptr.to(tl.pointer_type(tl.uint8))


@triton.jit
def _copy_kernel(
    k_ptr,
    v_ptr,
    k_layers,
    v_layers,
    slots_ptr,
    offs_ptr,
    stg_ptr,
    sums_ptr,
    num_tokens,
    num_chunks,
    search_steps,
    capacity,
    page_size,
    k_ps,
    k_os,
    k_hs,
    v_ps,
    v_os,
    v_hs,
    k_seg,
    v_seg,
    heads,
    row_units,
    stage_layers,
    stage_layer0,
    chunk_layer0,
    total_layers,
    UNIT: tl.constexpr,
    GATHER: tl.constexpr,
    CSUM: tl.constexpr,
    HAS_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_U: tl.constexpr,
):
    li = tl.program_id(1)
    kp = _unit_ptr(k_ptr, UNIT)
    vp = _unit_ptr(v_ptr, UNIT)
    sp = _unit_ptr(stg_ptr, UNIT)
    p = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    pm = p < num_tokens
    lo = tl.zeros([BLOCK_T], dtype=tl.int64)
    hi = lo + (num_chunks - 1)
    for _ in range(search_steps):  # last chunk c with offsets[c] <= p
        mid = (lo + hi + 1) // 2
        go = tl.load(offs_ptr + mid, mask=pm, other=0) <= p
        active = lo < hi
        lo = tl.where(active & go, mid, lo)
        hi = tl.where(active & ~go, mid - 1, hi)
    a = tl.load(offs_ptr + lo, mask=pm, other=0)
    b = tl.load(offs_ptr + lo + 1, mask=pm, other=0)
    ok = pm & (a >= 0) & (b > a) & (b <= num_tokens) & (p >= a) & (p < b)
    n = b - a
    t = p - a
    slot = tl.load(slots_ptr + p, mask=pm, other=-1)
    valid = ok & (slot >= 0) & (slot < capacity)
    s = tl.where(valid, slot, 0)
    page = s // page_size
    off = s - page * page_size
    srow = (a * stage_layers + (stage_layer0 + li) * n + t) * row_units
    kbase = page * k_ps + off * k_os + tl.load(k_layers + li)
    vbase = kbase
    if HAS_V:
        vbase = page * v_ps + off * v_os + tl.load(v_layers + li)
    k_units = heads * k_seg
    word0 = ((chunk_layer0 + li) * n + t) * row_units + 1  # 1-based word of the row (UNIT 8)
    acc = tl.zeros([BLOCK_T], dtype=tl.uint64)
    for u0 in range(0, row_units, BLOCK_U):
        u = u0 + tl.arange(0, BLOCK_U).to(tl.int64)
        um = u < row_units
        is_k = u < k_units
        hk = u // k_seg
        kaddr = kbase[:, None] + (hk * k_hs + u - hk * k_seg)[None, :]
        m2 = ok[:, None] & um[None, :]
        mv = valid[:, None] & um[None, :]
        mk = mv & is_k[None, :]
        saddr = srow[:, None] + u[None, :]
        vaddr = kaddr
        if HAS_V:
            uv = tl.where(is_k, 0, u - k_units)
            hv = uv // v_seg
            vaddr = vbase[:, None] + (hv * v_hs + uv - hv * v_seg)[None, :]
        if GATHER:
            val = tl.load(kp + kaddr, mask=mk, other=0)
            if HAS_V:
                val = tl.where(is_k[None, :], val, tl.load(vp + vaddr, mask=mv & ~mk, other=0))
            tl.store(sp + saddr, val, mask=mv)
            if CSUM:
                old = tl.load(sp + saddr, mask=m2 & ~mv, other=0)
                val = tl.where(mv, val, old)
        else:
            val = tl.load(sp + saddr, mask=m2, other=0)
            tl.store(kp + kaddr, val, mask=mk)
            if HAS_V:
                tl.store(vp + vaddr, val, mask=mv & ~mk)
        if CSUM:
            idx = (word0[:, None] + u[None, :]).to(tl.uint64)
            term = _mix64(val.to(tl.uint64, bitcast=True) ^ (idx * 0x9E3779B97F4A7C15))
            acc += tl.sum(tl.where(m2, term, 0), axis=1)
    if CSUM:
        first = ok & (t == 0) & (chunk_layer0 + li == 0)
        length = (total_layers * n * row_units * UNIT).to(tl.uint64)
        acc += tl.where(first, _mix64(length), 0)
        # one atomic for the tile's first chunk, one per token of a later chunk
        c0 = tl.min(tl.where(ok, lo, num_chunks))
        in0 = ok & (lo == c0)
        s0 = tl.sum(tl.where(in0, acc, 0))
        lane0 = tl.arange(0, BLOCK_T) == 0
        target = tl.where(lane0, c0, lo)
        value = tl.where(lane0, s0, acc).to(tl.int64, bitcast=True)
        has0 = (lo * 0 + c0) < num_chunks  # a vector: the interpreter mis-types scalar & vector
        todo = (lane0 & has0) | (~lane0 & ok & ~in0)
        tl.atomic_add(sums_ptr + target, value, mask=todo)


@triton.jit
def _region_kernel(
    data_ptr,
    offs_ptr,
    out_ptr,
    num_units,
    row_bytes,
    stage_layers,
    stage_layer0,
    layers,
    chunk_layer0,
    total_layers,
    num_chunks,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for c in range(tl.program_id(1), num_chunks, tl.num_programs(1)):
        a = tl.load(offs_ptr + c)
        b = tl.load(offs_ptr + c + 1)
        good = (a >= 0) & (b > a) & (b <= num_units)
        n = tl.where(good, b - a, 0)
        base = data_ptr + (a * stage_layers + stage_layer0 * n) * row_bytes
        length = layers * n * row_bytes
        word1 = chunk_layer0 * n * row_bytes // 8 + 1
        words = (length + 7) // 8
        acc = tl.zeros([BLOCK], dtype=tl.uint64)
        for i0 in range(pid * BLOCK, words, step):
            i = i0 + tl.arange(0, BLOCK).to(tl.int64)
            m = i < words
            if ALIGNED:
                w = tl.load(base.to(tl.pointer_type(tl.int64)) + i, mask=m, other=0)
                w = w.to(tl.uint64, bitcast=True)
            else:  # byte by byte: the chunk's words do not start on 8-byte addresses
                k = tl.arange(0, 8).to(tl.int64)
                pos = 8 * i[:, None] + k[None, :]
                byte = tl.load(base + pos, mask=m[:, None] & (pos < length), other=0)
                w = tl.sum(byte.to(tl.uint64) << (8 * k).to(tl.uint64)[None, :], axis=1)
            idx = (word1 + i).to(tl.uint64)
            acc += tl.where(m, _mix64(w ^ (idx * 0x9E3779B97F4A7C15)), 0)
        total = tl.sum(acc)
        if chunk_layer0 == 0:
            lead = good & (pid == 0)
            total += tl.where(lead, _mix64((total_layers * n * row_bytes).to(tl.uint64)), 0)
        tl.atomic_add(out_ptr + c, total.to(tl.int64, bitcast=True))


_LAYER_OFFSETS: OrderedDict[tuple[object, ...], torch.Tensor] = OrderedDict()


def _layer_offsets(layers: Sequence[torch.Tensor], unit: int) -> torch.Tensor:
    """``[layers]`` int64 on the device: each layer's base, in units, from layer 0's.

    Cached by value (a call with the same layout uploads nothing); a miss uploads through
    pinned memory without waiting.
    """
    base = layers[0].data_ptr()
    rel = tuple((t.data_ptr() - base) // unit for t in layers)
    device = layers[0].device
    key = (device, rel)
    found = _LAYER_OFFSETS.get(key)
    if found is not None:
        _LAYER_OFFSETS.move_to_end(key)
        return found
    host = torch.tensor(rel, dtype=torch.int64)
    if device.type != "cpu":
        host = host.pin_memory()
    dev = host.to(device, non_blocking=True)
    _LAYER_OFFSETS[key] = dev
    if len(_LAYER_OFFSETS) > _CACHE_MAX:
        _LAYER_OFFSETS.popitem(last=False)
    return dev


def _unit(
    k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor], staging: torch.Tensor
) -> int:
    """Widest integer (1 to 8 bytes) every address, stride and head size is a multiple of."""
    elt = k_caches[0].element_size()
    g = 8
    for layers in (k_caches, v_caches):
        if not layers:
            continue
        t0 = layers[0]
        g = math.gcd(g, int(t0.shape[3]) * elt)
        for d in range(3):
            if t0.shape[d] > 1:
                g = math.gcd(g, t0.stride(d) * elt)
        for t in layers:
            g = math.gcd(g, t.data_ptr() % 8)
    return math.gcd(g, staging.data_ptr() % 8)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _copy(
    gather: bool,
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    chunk_offsets: torch.Tensor,
    staging: torch.Tensor,
    checksums: torch.Tensor | None,
    first_layer: int,
    total_layers: int,
    staging_full: bool,
) -> None:
    op = "gather_kv" if gather else "scatter_kv"
    args = (k_caches, v_caches, slots, chunk_offsets, staging, checksums)
    plan = check_copy(op, *args, first_layer, total_layers, staging_full)
    check_host_offsets(op, chunk_offsets, plan.num_tokens)
    if plan.num_tokens == 0 or plan.num_chunks == 0:
        return
    unit = _unit(k_caches, v_caches, staging)
    elt = k_caches[0].element_size()
    k0 = k_caches[0]
    v0 = v_caches[0] if v_caches else k0
    in_pass = checksums is not None and unit == 8
    row_units = plan.row_bytes // unit
    block_u = min(_pow2(row_units), _TILE)
    block_t = min(max(_TILE // block_u, 1), _pow2(plan.num_tokens))
    nl = len(k_caches)
    grid = (triton.cdiv(plan.num_tokens, block_t), nl)
    k_layers = _layer_offsets(k_caches, unit)
    v_layers = _layer_offsets(v_caches, unit) if v_caches else k_layers
    _copy_kernel[grid](
        k0,
        v0,
        k_layers,
        v_layers,
        slots,
        chunk_offsets,
        staging,
        checksums if in_pass else slots,
        plan.num_tokens,
        plan.num_chunks,
        max(plan.num_chunks - 1, 0).bit_length() + 1,
        int(k0.shape[0]) * int(k0.shape[1]),
        int(k0.shape[1]),
        k0.stride(0) * elt // unit,
        k0.stride(1) * elt // unit,
        k0.stride(2) * elt // unit,
        v0.stride(0) * elt // unit,
        v0.stride(1) * elt // unit,
        v0.stride(2) * elt // unit,
        int(k0.shape[3]) * elt // unit,
        int(v0.shape[3]) * elt // unit,
        int(k0.shape[2]),
        row_units,
        plan.stage_layers,
        plan.stage_layer0,
        first_layer,
        total_layers,
        UNIT=unit,
        GATHER=gather,
        CSUM=in_pass,
        HAS_V=bool(v_caches),
        BLOCK_T=block_t,
        BLOCK_U=block_u,
        num_warps=4,
    )
    if checksums is not None and not in_pass:
        rb = plan.row_bytes
        geometry = (rb, plan.stage_layers, plan.stage_layer0, nl, first_layer, total_layers)
        _region(
            staging, chunk_offsets, checksums, plan.num_tokens, geometry, nl * rb * plan.num_tokens
        )


def _region(
    data: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor,
    num_units: int,
    geometry: tuple[int, int, int, int, int, int],
    total_bytes: int,
) -> None:
    """Launch the region kernel: add each chunk's checksum terms into ``out``. ``geometry`` is
    ``(row_bytes, stage_layers, stage_layer0, layers, chunk_layer0, total_layers)``."""
    num_chunks = offsets.numel() - 1
    block = 1024
    chunks_y = min(num_chunks, 65535)
    per_chunk = max(1, min(triton.cdiv(total_bytes // 8 + 1, block * chunks_y), 1024))
    aligned = geometry[0] % 8 == 0 and data.data_ptr() % 8 == 0
    raw = data.reshape(-1).view(torch.uint8)
    _region_kernel[(per_chunk, chunks_y)](
        raw, offsets, out, num_units, *geometry, num_chunks, ALIGNED=aligned, BLOCK=block
    )


def gather_kv(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    chunk_offsets: torch.Tensor,
    staging: torch.Tensor,
    checksums: torch.Tensor | None,
    first_layer: int,
    total_layers: int,
    staging_full: bool,
    max_sms: int,
) -> None:
    """Paged KV -> chunk-major staging; :func:`lmcache.gpu_ops._ref.gather_kv`'s contract.

    ``max_sms`` is ignored (Triton has no persistent grid here).

    Raises:
        ValueError: an argument's metadata does not match (offsets' values are not read).
    """
    args = (k_caches, v_caches, slots, chunk_offsets, staging, checksums)
    _copy(True, *args, first_layer, total_layers, staging_full)


def scatter_kv(
    k_caches: Sequence[torch.Tensor],
    v_caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    chunk_offsets: torch.Tensor,
    staging: torch.Tensor,
    checksums: torch.Tensor | None,
    first_layer: int,
    total_layers: int,
    staging_full: bool,
    max_sms: int,
) -> None:
    """Chunk-major staging -> paged KV; :func:`lmcache.gpu_ops._ref.scatter_kv`'s contract.

    Raises:
        ValueError: an argument's metadata does not match (offsets' values are not read).
    """
    args = (k_caches, v_caches, slots, chunk_offsets, staging, checksums)
    _copy(False, *args, first_layer, total_layers, staging_full)


def checksum_chunks(
    data: torch.Tensor, offsets: torch.Tensor, unit_bytes: int, out: torch.Tensor
) -> None:
    """``out[c]`` = checksum of bytes ``[offsets[c] * unit_bytes, offsets[c + 1] * unit_bytes)``
    of contiguous ``data``; the CUDA op's contract (a chunk outside the data gets 0).

    Raises:
        ValueError: an argument's metadata does not match (offsets' values are not read).
    """
    count = check_checksum_args("checksum_chunks", data, offsets, unit_bytes, out)
    out.zero_()
    nbytes = data.numel() * data.element_size()
    if count == 0 or nbytes == 0:
        return
    _region(data, offsets, out, nbytes // unit_bytes, (unit_bytes, 1, 0, 1, 0, 1), nbytes)
