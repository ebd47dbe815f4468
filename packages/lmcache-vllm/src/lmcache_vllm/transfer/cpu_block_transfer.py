# SPDX-License-Identifier: Apache-2.0
"""The transfer strategy of :class:`~lmcache_vllm.transfer.paged_connector.VLLMPagedConnector` for
vLLM's CPU attention block format ``cpu_kt_v`` (:class:`CpuBlockTransfer`): block by block,
straight between the cache and the chunk buffers.

On a CPU engine the chunk buffers are already in host memory, so nothing is staged: each op
reads or writes the chunk buffers directly. Tokens move a whole block at a time wherever a run of
``block_size`` tokens fills one block in order (the slot mapping says which block; with chunks of
a multiple of ``block_size`` tokens that is every token but a partial last block). For a group of
such blocks, every layer moves in two ops: K, transposed per block (chunk rows ``[bs, H, head]``
<-> cache ``[H, head, bs]``) in one permuted indexed copy, and V (``[bs, H, head]`` <->
``[H, bs, head]``, rows widened to 16-byte elements) in another. All layers share one op when
they are views of one buffer with a uniform step (vLLM's allocation): block ``b`` of layer ``l``
is then row ``l * k + b`` of one strided ``[rows, H, ...]`` view. A group is one chunk's run of
blocks, or several whole chunks whose buffers lie back to back in one pool slab.

Tokens that do not fill a block (a range that starts or ends mid-block, ``skip_tokens``
mid-block, slots out of order) go through the token-level reference of
:mod:`lmcache_vllm.transfer.kv_formats`, layer by layer.

The connector creates a :class:`CpuBlockTransfer` from the
:class:`~lmcache_vllm.transfer.paged_cache.PagedKVCache` it checked, for ``cpu_kt_v`` caches on a
CPU engine. This module never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmcache.gpu_connector.interface import ChunkTransfer, TransferSpec
from lmcache_vllm.transfer.kv_formats import gather_layer, scatter_layer
from lmcache_vllm.transfer.paged_cache import PagedKVCache, fuse_layers

__all__ = ["CpuBlockTransfer"]


@dataclass
class _Source:
    """K^T ``[rows, H, head, bs]`` and V ``[rows, H, bs, head]`` views holding ``layers``;
    block ``b`` of layer ``layers[i]`` is row ``row_of[i] + b``. ``vw`` is V widened to
    16-byte elements (``None`` when the strides do not allow it)."""

    k: torch.Tensor
    v: torch.Tensor
    vw: torch.Tensor | None
    layers: list[int]
    row_of: list[int]


@dataclass
class _Group:
    """``count`` chunks (buffers back to back from ``buffer``, each ``chunk_elems`` elements
    apart) whose tokens ``[t0, t0 + blocks.shape[1] * bs)`` fill ``blocks`` ``[count, G]``."""

    buffer: torch.Tensor
    t0: int
    blocks: torch.Tensor
    count: int = 1
    end_ptr: int = 0


@dataclass
class _Edges:
    """Tokens moved one by one: per chunk ``(buffer, positions in the chunk)``, and the
    ``blocks``/``offs`` of all of them, in that order."""

    parts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)


def _widen16(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` viewed with 16-byte elements on its last axis, or ``None``."""
    if t.element_size() >= 16 or (t.shape[-1] * t.element_size()) % 16:
        return None
    try:
        return t.view(torch.complex128)
    except RuntimeError:
        return None


def _gather_rows(src: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    """``out[c, l, g] = src[idx[c, l, g]]``, written through ``out``'s strides: one
    ``index_select`` when ``out``'s first three axes merge (whole chunks; ~20 % faster than
    advanced indexing), else one advanced-indexing op."""
    try:
        flat = out.view(-1, *out.shape[3:])
    except RuntimeError:
        torch.ops.aten.index.Tensor_out(src, [idx], out=out)
        return
    torch.index_select(src, 0, idx.reshape(-1), out=flat)


class CpuBlockTransfer:
    """The ``cpu_kt_v`` block path (see the module docstring).

    Args:
        cache: A ``cpu_kt_v`` cache on the host: per-layer ``[B, H, bs, 2 * head]`` views, each
            ``[b, h]`` run contiguous.
    """

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self._caches = list(cache.caches)
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks
        self._setup_kt_v_blocks()

    @property
    def num_layers(self) -> int:
        return len(self._caches)

    def _setup_kt_v_blocks(self) -> None:
        """Build the sources: one for every layer when they fuse, else one per layer."""
        first = self._caches[0]
        fused = fuse_layers(self._caches)
        self._kt_v_sources: list[_Source] = []
        if fused is not None:
            step, bstride = fused.stride(0), first.stride(0)
            if step > 0 and bstride > 0 and step % bstride == 0:
                k = step // bstride
                rows = (self.num_layers - 1) * k + self.num_blocks
                src = self._kt_v_source(
                    first,
                    rows,
                    list(range(self.num_layers)),
                    [i * k for i in range(self.num_layers)],
                )
                if src is not None:
                    self._kt_v_sources.append(src)
                    return
        for i, t in enumerate(self._caches):
            src = self._kt_v_source(t, self.num_blocks, [i], [0])
            assert src is not None  # a layer's own blocks always lie inside its storage
            self._kt_v_sources.append(src)

    def _kt_v_source(
        self, t: torch.Tensor, rows: int, layers: list[int], row_of: list[int]
    ) -> _Source | None:
        hs, bs = self.cache.head_size_k, self.block_size
        heads = t.shape[1]
        sb, sh = t.stride(0), t.stride(1)
        off = t.storage_offset()
        try:
            k = t.as_strided((rows, heads, hs, bs), (sb, sh, bs, 1), off)
            v = t.as_strided((rows, heads, bs, hs), (sb, sh, hs, 1), off + bs * hs)
        except RuntimeError:  # reaches outside the storage: not one buffer after all
            return None
        return _Source(k, v, _widen16(v), layers, row_of)

    # -- planning ----------------------------------------------------------------------------

    def _kt_v_plan(
        self, chunks: Sequence[ChunkTransfer], transfer: TransferSpec, skip: int
    ) -> tuple[list[_Group], _Edges]:
        """Split the moved tokens into block groups and single tokens; check every moved slot
        (raises ``ValueError`` before anything is written)."""
        bs = self.block_size
        sm = transfer.slot_mapping.to("cpu", torch.int64)
        groups: list[_Group] = []
        edges = _Edges()
        for c in chunks:
            n = c.num_tokens
            t0 = min(max(skip - c.start, 0), n)
            if t0 == n:
                continue  # the engine holds all of this chunk already
            s = sm[c.start + t0 : c.end]
            self.cache.check_slots(s, lambda c=c, t0=t0: torch.arange(c.start + t0, c.end))
            starts = self._block_starts(s)
            if starts.numel() * bs == s.numel():
                single = None
            else:
                covered = torch.zeros(s.numel(), dtype=torch.bool)
                covered.view(-1)[(starts.view(-1, 1) + torch.arange(bs)).flatten()] = True
                single = torch.nonzero(~covered).flatten()
            if single is not None and single.numel():
                edges.parts.append((c.buffer, single + t0))
                edges.slots.append(s[single])
            blocks = s[starts] // bs
            for i0, g in self._runs(starts):  # g blocks from chunk token t0 + starts[i0]
                j0 = int(starts[i0])
                self._add_group(groups, c, t0 + j0, blocks[i0 : i0 + g])
        return groups, edges

    def _block_starts(self, s: torch.Tensor) -> torch.Tensor:
        """Sorted positions ``j`` where ``s[j : j + bs]`` fills one block in order."""
        bs, m = self.block_size, s.numel()
        g = m // bs
        if g == 0:
            return torch.empty(0, dtype=torch.int64)
        head = s[: g * bs].view(g, bs)  # the common case: every full block aligned and in order
        if bool((head[:, 0] % bs == 0).all()) and bool(
            (head - head[:, :1] == torch.arange(bs)).all()
        ):
            return torch.arange(0, g * bs, bs)
        brk = torch.ones(m, dtype=torch.int64)
        brk[1:] = (s[1:] != s[:-1] + 1).long()  # 1 where a run of consecutive slots breaks
        runs = brk.cumsum(0)
        last = m - bs + 1
        ok = (s[:last] % bs == 0) & (runs[bs - 1 :] == runs[:last])
        return torch.nonzero(ok).flatten()

    def _runs(self, starts: torch.Tensor) -> list[tuple[int, int]]:
        """``(index into starts, block count)`` of runs of blocks that follow each other in the
        chunk (``starts`` sorted)."""
        bs = self.block_size
        out: list[tuple[int, int]] = []
        prev = -1
        for i, j in enumerate(starts.tolist()):
            if out and prev + bs == j:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((i, 1))
            prev = j
        return out

    def _add_group(
        self, groups: list[_Group], c: ChunkTransfer, t0: int, blocks: torch.Tensor
    ) -> None:
        """Add a run of blocks; a run that fills its whole chunk joins the previous group when
        that one does too and the two chunk buffers lie back to back in one storage."""
        buf = c.buffer
        nbytes = buf.numel() * buf.element_size()
        whole = t0 == 0 and blocks.numel() * self.block_size == c.num_tokens
        last = groups[-1] if groups else None
        if (
            whole
            and last is not None
            and last.end_ptr == buf.data_ptr()
            and last.buffer.shape == buf.shape
            and buf.is_contiguous()
            and last.buffer.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        ):
            last.blocks = torch.cat((last.blocks, blocks.view(1, -1)))
            last.count += 1
            last.end_ptr += nbytes
            return
        end = buf.data_ptr() + nbytes if whole and buf.is_contiguous() else -1
        groups.append(_Group(buf, t0, blocks.view(1, -1), 1, end))

    # -- views -----------------------------------------------------------------------------

    def _group_views(
        self, grp: _Group, layers: range
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Chunk-side K ``[count, layers, G, H, head, bs]`` and V ``[count, layers, G, H, bs,
        head]`` views of a group (and V widened, or ``None``)."""
        md, bs = self.cache, self.block_size
        g = grp.blocks.shape[1]
        buf = grp.buffer
        tok = buf[layers.start : layers.stop, grp.t0 : grp.t0 + g * bs]  # [nl, g*bs, kw]
        if grp.count > 1:
            tok = tok.as_strided(
                (grp.count, *tok.shape), (buf.numel(), *tok.stride()), tok.storage_offset()
            )
        else:
            tok = tok.unsqueeze(0)
        rows = tok.unflatten(2, (g, bs)).unflatten(-1, (2, md.num_kv_heads, md.head_size_k))  # type: ignore[no-untyped-call]
        k = rows[..., 0, :, :].permute(0, 1, 2, 4, 5, 3)  # [c, nl, G, H, hs, bs]
        v = rows[..., 1, :, :].permute(0, 1, 2, 4, 3, 5)  # [c, nl, G, H, bs, hs]
        return k, v, _widen16(v)

    def _group_ops(
        self, grp: _Group, layers: range
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per source covering ``layers``: ``(index [c, nl', G], cache K, chunk K, cache V,
        chunk V)``; V widened on both sides when both allow it."""
        ck, cv, cvw = self._group_views(grp, layers)
        out = []
        for src in self._kt_v_sources:
            sel = [i for i, layer in enumerate(src.layers) if layer in layers]
            if not sel:
                continue
            if len(sel) == len(layers) and len(src.layers) == len(sel):
                lk, lv, lvw = ck, cv, cvw
            else:
                a = src.layers[sel[0]] - layers.start
                lk, lv = ck[:, a : a + len(sel)], cv[:, a : a + len(sel)]
                lvw = None if cvw is None else cvw[:, a : a + len(sel)]
            rows = torch.tensor([src.row_of[i] for i in sel], dtype=torch.int64)
            idx = rows.view(1, -1, 1) + grp.blocks.view(grp.count, 1, -1)
            if src.vw is not None and lvw is not None:
                out.append((idx, src.k, lk, src.vw, lvw))
            else:
                out.append((idx, src.k, lk, src.v, lv))
        return out

    # -- transfers ---------------------------------------------------------------------------

    def from_cache(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> None:
        groups, edges = self._kt_v_plan(chunks, transfer, 0)
        for grp in groups:
            for idx, kc, kb, vc, vb in self._group_ops(grp, layers):
                _gather_rows(kc, idx, kb)
                _gather_rows(vc, idx, vb)
        if not edges.parts:
            return
        slots = torch.cat(edges.slots)
        blocks, offs = slots // self.block_size, slots % self.block_size
        md = self.cache
        for layer in layers:
            rows = gather_layer("cpu_kt_v", self._caches[layer], md.head_size_k, blocks, offs)
            at = 0
            for buf, pos in edges.parts:
                buf[layer].index_copy_(0, pos, rows[at : at + pos.numel()])
                at += pos.numel()

    def to_cache(
        self, layers: range, chunks: Sequence[ChunkTransfer], transfer: TransferSpec
    ) -> bool:
        """Synchronous on the host: returns ``False`` (nothing left queued on a stream)."""
        groups, edges = self._kt_v_plan(chunks, transfer, transfer.skip_tokens)
        for grp in groups:
            for idx, kc, kb, vc, vb in self._group_ops(grp, layers):
                kc.index_put_((idx,), kb)
                vc.index_put_((idx,), vb)
        if not edges.parts:
            return False
        slots = torch.cat(edges.slots)
        blocks, offs = slots // self.block_size, slots % self.block_size
        md = self.cache
        for layer in layers:
            src = torch.cat([buf[layer].index_select(0, pos) for buf, pos in edges.parts])
            scatter_layer(
                "cpu_kt_v",
                self._caches[layer],
                md.num_kv_heads,
                md.head_size_k,
                md.head_size_v,
                blocks,
                offs,
                src,
            )
        return False

    def close(self) -> None:
        """Drop the views."""
        self._caches = []
        self._kt_v_sources = []
