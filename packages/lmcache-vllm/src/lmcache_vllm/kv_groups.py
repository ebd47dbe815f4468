# SPDX-License-Identifier: Apache-2.0
"""vLLM's KV cache groups (its hybrid KV cache manager), and what each group stores and loads.

With the hybrid manager on, vLLM splits a model's layers into KV cache groups, each with its own
block table: full attention, sliding window, Mamba state. lmcache keeps one *stream* per
attention group: its own layers, its own cache engine, its own chunk keys (the group is part of
the model fingerprint, :func:`group_tag`), its own block table. One group (every dense model)
is the path lmcache always had; nothing here runs for it.

What a hit ending at token ``N`` needs of each group:

- full attention: the KV of every token before ``N``, as for a dense model;
- sliding window ``W``: the KV of tokens ``[N - W + 1, N)`` only. vLLM allocates blocks for
  exactly those (earlier ones are its null block, id 0), and :func:`group_load` writes only
  the blocks vLLM allocated.

A sliding group's chunk is stored only when the KV a hit needs of it is still in vLLM's pages
(:func:`group_save`): vLLM frees a sliding group's blocks below the window as the request
advances, and a block freed before the save holds another request's KV by then. Hits of a
model with a sliding group end on a chunk boundary (:func:`hit_alignment`), so a chunk ``[a,
e)`` is only ever needed from ``e - W + 1`` on.

- Mamba state (``kind == "mamba"``): the recurrent state after token ``N``, one page per
  group. vLLM exposes it only in its Mamba prefix-caching mode, at block boundaries; lmcache
  stores the states vLLM offers and loads the one at the hit's end
  (:mod:`lmcache_vllm.worker.mamba_states`). A boundary without a stored state is no hit.

Mamba groups need that mode and a vLLM that takes failed loads per request
(:func:`mamba_states_off` says why not). Without them, and for groups of any other kind
(chunked local attention, ...), the connector stores and loads nothing for the model
(:func:`unsupported_kinds`), and vLLM computes every token, as without lmcache.

This module imports nothing of vLLM: specs are told apart by class name.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec

__all__ = [
    "NULL_BLOCK",
    "UNSUPPORTED_GROUPS",
    "KVGroup",
    "group_load",
    "group_save",
    "group_tag",
    "hit_alignment",
    "kv_groups",
    "mamba_states_off",
    "split_metadata",
    "state_alignment",
    "unsupported_kinds",
]

UNSUPPORTED_GROUPS = (
    "lmcache: this model's KV cache has %s groups, which lmcache cannot store here%s; lmcache "
    "stores and loads nothing for this engine, and vLLM computes every prompt as it does "
    "without lmcache."
)
"""Logged once per engine whose KV cache has a group lmcache cannot store (``%s``: kinds, then
why, e.g. :func:`mamba_states_off`)."""

NULL_BLOCK = 0
"""vLLM's null block id: a block-table entry for tokens a group holds no KV for."""

_FULL = ("FullAttentionSpec", "MLAAttentionSpec")
_SLIDING = ("SlidingWindowSpec", "SlidingWindowMLASpec")
_MAMBA = ("MambaSpec",)


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups, as lmcache reads it.

    Attributes:
        index: Position in ``kv_cache_config.kv_cache_groups`` (and in per-group block ids).
        kind: ``"full"``, ``"sliding"``, ``"mamba"`` or, for anything lmcache cannot store,
            the spec's class name.
        layer_names: vLLM's names of the group's layers.
        block_size: Tokens per block of this group.
        window: Sliding window in tokens (``0`` unless ``kind == "sliding"``).
    """

    index: int
    kind: str
    layer_names: tuple[str, ...]
    block_size: int
    window: int = 0

    @property
    def paged(self) -> bool:
        """Whether the group holds per-token KV (one stream of chunks)."""
        return self.kind in ("full", "sliding")


def _kind(spec: object) -> str:
    name = type(spec).__name__
    if name in _FULL:
        return "full"
    if name in _SLIDING and int(getattr(spec, "sliding_window", 0) or 0) > 0:
        return "sliding"
    if name in _MAMBA:
        return "mamba"
    return name


def kv_groups(kv_cache_config: object, default_block_size: int) -> list[KVGroup]:
    """The groups of vLLM's ``KVCacheConfig`` (``[]`` for ``None``, e.g. a test stand-in)."""
    out = []
    for i, g in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = getattr(g, "kv_cache_spec", None)
        kind = _kind(spec)
        window = int(getattr(spec, "sliding_window", 0) or 0) if kind == "sliding" else 0
        block = int(getattr(spec, "block_size", 0) or default_block_size)
        names = tuple(str(n) for n in getattr(g, "layer_names", ()) or ())
        out.append(KVGroup(i, kind, names, block, window))
    return out


def unsupported_kinds(groups: Sequence[KVGroup], mamba_states: bool = False) -> list[str]:
    """Kinds of the groups lmcache cannot store (``[]`` when it can store all of them);
    ``mamba_states``: Mamba groups can be stored (:func:`mamba_states_off` is empty)."""
    return sorted({g.kind for g in groups if not (g.paged or (mamba_states and g.kind == "mamba"))})


def mamba_states_off(vllm_config: object, async_loads: bool) -> str:
    """Why this engine's Mamba states cannot be stored and loaded (``""`` when they can).

    vLLM keeps a state at block boundaries only in its Mamba prefix-caching mode. A state load
    that fails must be reported per request (``failed_recving``, vLLM 0.32 and later).
    """
    cache = getattr(vllm_config, "cache_config", None)
    if getattr(cache, "mamba_cache_mode", "none") != "align" or not getattr(
        cache, "enable_prefix_caching", False
    ):
        return (
            " (vLLM keeps no recurrent state at block boundaries: start it with "
            "--enable-prefix-caching --mamba-cache-mode align "
            "--prefix-cache-retention-interval <a multiple of the block size>)"
        )
    if not async_loads:
        return (
            " (this vLLM cannot be told per request that a load failed: it has no "
            "KVConnectorTransferResults.failed_recving; vLLM 0.32 and later has it)"
        )
    return ""


def group_tag(group: KVGroup, num_groups: int) -> str:
    """What tells this group's chunks from the other groups' in the model fingerprint."""
    window = f" window={group.window}" if group.window else ""
    return (
        f"kv-group {group.index}/{num_groups} {group.kind}{window} "
        f"layers={','.join(group.layer_names)}"
    )


def hit_alignment(groups: Sequence[KVGroup], chunk_size: int, block_size: int) -> int:
    """Where hits may end: on a block boundary of every group, and with a sliding group also
    on a chunk boundary (a chunk is then only needed from ``end - window + 1`` on, see
    :func:`group_save`). A Mamba group's blocks end where vLLM keeps its states."""
    if any(g.kind == "sliding" for g in groups):
        return math.lcm(chunk_size, block_size, *(g.block_size for g in groups))
    return math.lcm(block_size, *(g.block_size for g in groups))


def state_alignment(hit_align: int, chunk_size: int) -> int:
    """Where a hit of a Mamba model may end: where any hit may (``hit_align``), and on a chunk
    boundary. An asynchronous load gets vLLM's blocks up to the hit's end only, so it loads
    whole chunks: a hit inside a chunk would need the rest of its chunk."""
    return math.lcm(hit_align, chunk_size)


def _live(blocks: Sequence[int], lo: int, hi: int, block_size: int) -> bool:
    """Whether every block holding a token of ``[lo, hi)`` is allocated (not the null block)."""
    last = -(-hi // block_size)
    if last > len(blocks):
        return False
    return all(blocks[b] != NULL_BLOCK for b in range(lo // block_size, last))


def group_save(
    group: KVGroup, save: SaveSpec, blocks: Sequence[int], computed_start: int, chunk_size: int
) -> SaveSpec | None:
    """The part of ``save`` this group stores, or ``None``.

    A full-attention group stores all of it. A sliding group stores a chunk ``[a, e)`` only if
    the tokens any hit needs of it, ``[max(a, e - W + 1), e)``, are in blocks vLLM still holds:
    not the null block, and not below where vLLM frees (tokens before ``computed_start - W + 1``,
    ``computed_start`` being what the request had computed when this step was scheduled). A
    partial last chunk is never needed (hits end on chunk boundaries) and is not stored.
    """
    if group.kind != "sliding":
        return save
    w, bs = group.window, group.block_size
    freed = max(0, computed_start - w + 1) // bs * bs
    end = save.end // chunk_size * chunk_size  # a partial last chunk is never needed
    skip = save.skip
    for a in range(save.skip // chunk_size * chunk_size, end, chunk_size):
        e = a + chunk_size
        need = max(a, e - w + 1)
        if need < freed or not _live(blocks, need, e, bs):
            skip = e
    if skip >= end:
        return None
    return SaveSpec(skip=skip, end=end)


def group_load(group: KVGroup, load: LoadSpec, blocks: Sequence[int]) -> LoadSpec | None:
    """The part of ``load`` this group writes, or ``None``.

    A sliding group writes from the end of the last null block before ``load_end`` on: vLLM
    allocated blocks for the tokens the window needs, the null block for the others.
    """
    if group.kind != "sliding" or load.load_end <= load.vllm_cached:
        return load
    bs = group.block_size
    lo = load.vllm_cached
    last = min(-(-load.load_end // bs), len(blocks))
    for b in range(lo // bs, last):
        if blocks[b] == NULL_BLOCK:
            lo = max(lo, (b + 1) * bs)
    if lo >= load.load_end:
        return None
    return LoadSpec(vllm_cached=lo, lmcache_hit=load.lmcache_hit, load_end=load.load_end)


def _request_for(group: KVGroup, req: ReqMeta, chunk_size: int) -> ReqMeta:
    per_group = req.group_block_ids
    if per_group is None:
        blocks = req.block_ids
    elif group.index < len(per_group):
        blocks = list(per_group[group.index])
    else:  # never from vLLM: no blocks, so a load of them fails its check
        blocks = []
    load = group_load(group, req.load, blocks) if req.load is not None else None
    save = (
        group_save(group, req.save, blocks, req.computed_start, chunk_size)
        if req.save is not None
        else None
    )
    return dataclasses.replace(req, block_ids=blocks, load=load, save=save, group_block_ids=None)


def split_metadata(
    meta: LMCacheConnectorMetadata, groups: Sequence[KVGroup], chunk_size: int
) -> list[LMCacheConnectorMetadata]:
    """One metadata per group: every request with that group's blocks, load and save (a
    request stays in each group's metadata with ``load=None`` and ``save=None`` rather than
    being left out, so the group's lease of its lookup is released at the load)."""
    return [
        LMCacheConnectorMetadata(
            requests=[_request_for(g, r, chunk_size) for r in meta.requests],
            preempted=list(meta.preempted),
            finished=[_request_for(g, r, chunk_size) for r in meta.finished],
        )
        for g in groups
    ]
