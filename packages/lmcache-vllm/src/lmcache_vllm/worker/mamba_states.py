# SPDX-License-Identifier: Apache-2.0
"""Mamba states of vLLM's hybrid KV cache, stored beside the chunks they end.

A Mamba layer keeps no per-token KV: what a later token needs is the recurrent state after the
tokens before it. In its Mamba prefix-caching mode (``--mamba-cache-mode align``) vLLM keeps
the state after every ``block_size`` tokens of a Mamba group in a block of its own. It offers
each retained one to the connector in the step whose forward writes it
(``scheduler_output.kv_connector_block_state.boundary_state_offloads``). Which boundaries it
retains is vLLM's ``--prefix-cache-retention-interval``.

A hit that ends at token ``N`` needs the attention groups' chunks for the tokens before ``N``
(their streams) and the state after ``N`` tokens of every Mamba group (this module):

1. Save (``wait_for_save``, after the forward wrote the offered states): each state's page
   bytes, every layer of its group, are copied into one host buffer of the CPU tier, with a
   checksum.
2. Lookup: the hit of the attention streams is cut down to the longest ``N`` that has a
   stored state for every Mamba group. The states found are leased, so they stay until the
   load.
3. Load (``start_load_kv``, asynchronous: the request waits outside the forward): each state is
   read again from the tier, which verifies its checksum, and written into the block vLLM
   allocated for it (column ``(N - 1) // block_size`` of the group's block table). vLLM copies
   it from there into the request's running state. A state that is missing, fails its
   checksum or has no block fails the request's load: vLLM recomputes it.

Hits of a Mamba model end on chunk boundaries (:func:`lmcache_vllm.kv_groups.state_alignment`).
A state's key is the key of the chunk it ends, seeded with the model fingerprint, the Mamba
groups and their state geometry in place of the fingerprint alone (the tokens before ``N``, the
cache salt and per-chunk extra keys are chained as for a chunk), then the group.

States live in the CPU tier only: a chunk found on disk or Redis hits a Mamba model only while
its states are still in host memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
import xxhash

from lmcache.cache_engine import LMCacheEngine
from lmcache.keys import chunk_keys
from lmcache.memory import MemoryLease
from lmcache.tiers import tensor_checksum
from lmcache_vllm.connector_metadata import ReqMeta, StateSaves
from lmcache_vllm.kv_groups import NULL_BLOCK, KVGroup, state_alignment
from lmcache_vllm.lookup_wire import LookupQuery

__all__ = ["MambaStates"]

logger = logging.getLogger(__name__)

LEASE_TTL_S = 120.0
"""A lookup's leased states are released after this long without a load (a request vLLM never
loaded, e.g. one it served from its own prefix cache instead)."""


def _page(cache: torch.Tensor, block: int) -> torch.Tensor:
    """The bytes of one block of one state tensor ``[num_blocks, ...]``."""
    page = cache[block]
    if not page.is_contiguous():
        raise ValueError(
            f"lmcache: a Mamba state block of shape {tuple(page.shape)} and strides "
            f"{page.stride()} is not contiguous; expected each block's state in one run of "
            "bytes, as vLLM lays it out. Mamba hits are off for this engine."
        )
    return page.reshape(-1).view(torch.uint8)


class _Held:
    """States a lookup leased for a request (kept from eviction until its load or end)."""

    def __init__(self, leases: list[MemoryLease]) -> None:
        self.leases, self.since = leases, time.monotonic()

    def release(self) -> None:
        for lease in self.leases:
            lease.release()


class MambaStates:
    """The Mamba groups' states at hit boundaries (see the module docstring).

    Args:
        groups: vLLM's Mamba KV cache groups.
        chunk_size: lmcache's chunk size (keys chain over full chunks).
        align: Where hits may end (:func:`lmcache_vllm.kv_groups.hit_alignment`).
    """

    def __init__(self, groups: Sequence[KVGroup], chunk_size: int, align: int) -> None:
        self.groups = list(groups)
        self.chunk_size, self.align = chunk_size, state_alignment(align, chunk_size)
        self._pages: dict[int, list[torch.Tensor]] = {}
        self._nbytes: dict[int, int] = {}
        self._engine: LMCacheEngine | None = None
        self._seed = b""
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ registration

    def register(self, kv_caches: Mapping[str, object], engine: LMCacheEngine | None) -> None:
        """Take each group's state tensors; hits stay off (logged) when they cannot be read as
        one run of bytes per block, or there is no engine (no tier) to keep them in."""
        try:
            for g in self.groups:
                tensors: list[torch.Tensor] = []
                for name in g.layer_names:
                    cache = kv_caches[name]
                    parts = cache if isinstance(cache, list | tuple) else [cache]
                    tensors.extend(t for t in parts if isinstance(t, torch.Tensor))
                if not tensors:
                    raise ValueError(f"lmcache: no state tensors for Mamba group {g.index}")
                self._pages[g.index] = tensors
                self._nbytes[g.index] = sum(_page(t, 0).numel() for t in tensors)
        except (KeyError, ValueError, RuntimeError) as exc:
            logger.error("lmcache: Mamba states cannot be stored (%s); no hits", exc)
            return
        if engine is None:
            return
        geometry = [(g.index, g.layer_names, self._nbytes[g.index]) for g in self.groups]
        seed = xxhash.xxh3_128(engine.metadata.fingerprint())
        seed.update(repr(("lmcache-mamba-states-v1", self.chunk_size, geometry)).encode())
        self._seed = seed.digest()
        self._engine = engine

    # ------------------------------------------------------------------ keys

    def _keys(
        self, tokens: Sequence[int] | np.ndarray, salt: str, extra: Mapping[int, bytes], top: int
    ) -> list[bytes]:
        """The request's chunk chain up to ``top`` tokens, seeded with the state seed in place
        of the model fingerprint (so no chunk has these keys); hashed once per request."""
        engine = self._engine
        assert engine is not None
        full = top // self.chunk_size
        return chunk_keys(
            tokens[: full * self.chunk_size],
            self._seed,
            self.chunk_size,
            salt=engine.config.cache_salt + "\0" + salt,
            extra_keys={i: v for i, v in extra.items() if i < full},
        )

    def _group_keys(self, chain: Sequence[bytes], boundary: int) -> list[bytes]:
        """Each group's key of the state after ``boundary`` tokens (a chunk boundary)."""
        i = boundary // self.chunk_size - 1
        if boundary % self.chunk_size or not 0 <= i < len(chain):
            raise ValueError(f"lmcache: no state key at {boundary} tokens")
        return [
            xxhash.xxh3_128(chain[i] + g.index.to_bytes(4, "little")).digest() for g in self.groups
        ]

    def _pairs(
        self, group: int, block: int, buffer: torch.Tensor
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's page of ``block`` in ``group``, with its part of the host ``buffer``."""
        offset = 0
        for cache in self._pages[group]:
            page = _page(cache, block)
            yield page, buffer[offset : offset + page.numel()]
            offset += page.numel()

    # ------------------------------------------------------------------ save

    def save(self, saves: Iterable[StateSaves]) -> None:
        """Store the states this step's forward wrote (call after it). A state that finds no
        room is not stored (its boundary is no hit)."""
        engine = self._engine
        if engine is None:
            return
        tier = engine.tier
        for save in saves:
            wanted = [s for s in save.states if s[2] > 0 and s[2] % self.align == 0]
            if not wanted or max(b for _, _, b in wanted) > len(save.token_ids):
                continue
            chain = self._keys(
                save.token_ids, save.salt, save.extra_keys, max(b for *_, b in wanted)
            )
            position = {g.index: i for i, g in enumerate(self.groups)}
            for group_index, block, boundary in wanted:
                if group_index not in position or block == NULL_BLOCK:
                    continue
                key = self._group_keys(chain, boundary)[position[group_index]]
                if tier.touch(key):
                    continue  # stored already (vLLM offers a loaded state back)
                lease = tier.allocate(
                    [self._nbytes[group_index]], torch.uint8, metrics=engine.metrics
                )
                if lease is None:
                    continue
                try:
                    for page, part in self._pairs(group_index, block, lease.tensor):
                        part.copy_(page)
                    tier.put(key, lease, tensor_checksum(lease.tensor), owner=self._seed)
                finally:
                    lease.release()

    # ------------------------------------------------------------------ lookup

    def hit(self, query: LookupQuery, limit: int) -> int:
        """The longest hit up to ``limit`` (the attention streams' hit, below the last prompt
        token) with a stored state for every group; its states are leased for the load."""
        req_id, tokens = query.req_id, query.tokens
        self.release([req_id])
        self._expire()
        engine = self._engine
        top = min(limit, len(tokens) - 1) // self.align * self.align
        if engine is None or top <= 0:
            return 0
        chain = self._keys(tokens, query.salt, query.extra_keys, top)
        for boundary in range(top, 0, -self.align):
            group_keys = self._group_keys(chain, boundary)
            if engine.tier.missing(group_keys):
                continue  # no state verified in vain (a state can be tens of MB)
            leases = self._get(group_keys)
            if leases is not None:
                with self._lock:
                    self._held[req_id] = _Held(leases)
                return boundary
        return 0

    def _get(self, keys: Sequence[bytes]) -> list[MemoryLease] | None:
        """Verified leases on every key's state (``None``, nothing held, when one is missing or
        fails its checksum)."""
        engine = self._engine
        assert engine is not None
        leases: list[MemoryLease] = []
        for key in keys:
            lease = engine.tier.get(key, metrics=engine.metrics)
            if lease is None:
                for held in leases:
                    held.release()
                return None
            leases.append(lease)
        return leases

    # ------------------------------------------------------------------ load

    def load(self, req: ReqMeta) -> str:
        """Write the states at the end of ``req``'s load into vLLM's blocks; why it failed
        (``""`` when every group's state was written)."""
        held = self._take(req.req_id)
        try:
            return self._load(req)
        finally:
            if held is not None:
                held.release()

    def _load(self, req: ReqMeta) -> str:
        load = req.load
        if load is None or self._engine is None:
            return "Mamba states: no load or no tier"
        n = load.load_end
        if n % self.align or n > len(req.token_ids) or req.group_block_ids is None:
            return f"Mamba states: a hit at {n} tokens cannot be loaded"
        keys = self._group_keys(self._keys(req.token_ids, req.salt, req.extra_keys, n), n)
        leases = self._get(keys)  # the tier verifies each state's checksum here, before the copy
        if leases is None:
            return f"Mamba states: a state at {n} tokens is missing or damaged"
        try:
            for g, lease in zip(self.groups, leases, strict=True):
                blocks = req.group_block_ids[g.index] if g.index < len(req.group_block_ids) else []
                col = (n - 1) // g.block_size
                if col >= len(blocks) or blocks[col] == NULL_BLOCK:
                    return f"Mamba group {g.index}: no block for the state at {n} tokens"
                if lease.tensor.numel() != self._nbytes[g.index]:
                    return f"Mamba group {g.index}: a state of {lease.tensor.numel()} bytes"
                for page, part in self._pairs(g.index, blocks[col], lease.tensor):
                    page.copy_(part)
            return ""
        finally:
            for lease in leases:
                lease.release()

    # ------------------------------------------------------------------ leases

    def _take(self, req_id: str) -> _Held | None:
        with self._lock:
            return self._held.pop(req_id, None)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [r for r, h in self._held.items() if now - h.since > LEASE_TTL_S]
            stale = [self._held.pop(r) for r in old]
        for held in stale:
            held.release()

    def release(self, req_ids: Iterable[str]) -> None:
        """Release the states leased for these requests (finished, aborted, looked up again)."""
        for rid in req_ids:
            held = self._take(rid)
            if held is not None:
                held.release()

    def clear(self) -> None:
        """Drop this engine's states (a prefix-cache reset)."""
        if self._engine is not None:
            self._engine.tier.clear(owner=self._seed)

    def close(self) -> None:
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for h in held:
            h.release()
