# SPDX-License-Identifier: Apache-2.0
"""The worker side for a KV cache of several groups (vLLM's hybrid KV cache manager).

Each attention group is one *stream*: a :class:`~lmcache_vllm.worker.side.WorkerSide` of its
own over the group's layers and block table, with its own cache engine and chunk keys (the group
is in the fingerprint). :class:`GroupedWorkerSide` fans every vLLM hook out to them:

- the step's metadata is split per group (:func:`lmcache_vllm.kv_groups.split_metadata`): each
  stream sees the request's blocks of its group, what of the load its group writes, and what of
  the save its group stores;
- per-layer hooks go to the stream that owns the layer;
- one lookup server answers for the rank: every stream looks the prompt up and leases what it
  holds, and the answer is the shortest of their hits (the scheduler rounds it down to where
  hits may end, :func:`lmcache_vllm.kv_groups.hit_alignment`).

Mamba groups have no stream: their states at hit boundaries are stored, looked up and loaded
by :class:`~lmcache_vllm.worker.mamba_states.MambaStates`, and a lookup's hit is cut down to a
boundary with a state for every Mamba group.

With one KV cache group none of this runs: the adapter builds a plain ``WorkerSide``.

A model with a group lmcache cannot store here (see
:func:`lmcache_vllm.kv_groups.unsupported_kinds`) gets no stream at all: the scheduler side asks
nothing and saves nothing for it (:data:`lmcache_vllm.kv_groups.UNSUPPORTED_GROUPS`).

vLLM cannot take block-level load errors from a connector with several groups (it raises). On
a vLLM with ``failed_recving`` (``async_loads``) every load is asynchronous and its outcome is
reported per request (:mod:`lmcache_vllm.worker.async_loads`): a request whose load failed or
was short in any group is recomputed by vLLM. On an older vLLM the scheduler side loads nothing
for several groups (:data:`lmcache_vllm.scheduler.async_loads.NO_FAILED_RECVING`), so no load
can fail.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from functools import partial

import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata
from lmcache_vllm.kv_groups import (
    KVGroup,
    group_tag,
    hit_alignment,
    mamba_states_off,
    split_metadata,
    unsupported_kinds,
)
from lmcache_vllm.lookup_wire import LookupQuery
from lmcache_vllm.vllm_types import VllmConfig
from lmcache_vllm.worker.async_loads import AsyncLoads
from lmcache_vllm.worker.lookup_server import LookupServer
from lmcache_vllm.worker.mamba_states import MambaStates
from lmcache_vllm.worker.side import WorkerSide

__all__ = ["GroupedWorkerSide"]

logger = logging.getLogger(__name__)

_ONCE_PER_REQUEST = frozenset(
    {"loaded_tokens", "expected_load_tokens", "stored_tokens", "num_loads", "num_saves"}
)
"""Counters every stream counts for the same request: reported from the first full-attention
stream only (the others' bytes and seconds add up)."""

_ASYNC_COUNTED = frozenset(
    {"loaded_tokens", "expected_load_tokens", "failed_load_tokens", "num_loads"}
)
"""With asynchronous loads, counted per request over every group (:class:`AsyncLoads`): a load
is loaded only when every group's part arrived, and failed, whole, otherwise."""


class GroupedWorkerSide:
    """One :class:`WorkerSide` per attention group of vLLM's KV cache (module docstring).

    Args:
        vllm_config, config, engine_key, world_size, rank, get_metadata, on_engine: As for
            :class:`WorkerSide`.
        groups: vLLM's KV cache groups (:func:`lmcache_vllm.kv_groups.kv_groups`).
        async_loads: Every load is asynchronous, its outcome reported per request
            (:meth:`take_transfer_results`); vLLM has ``failed_recving``.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: LMCacheConfig,
        engine_key: str,
        world_size: int,
        rank: int,
        get_metadata: Callable[[], object],
        on_engine: Callable[[LMCacheEngine], None] | None,
        groups: Sequence[KVGroup],
        async_loads: bool = False,
    ) -> None:
        self.chunk_size = config.chunk_size
        self.engine_key, self.rank = engine_key, rank
        self.unsupported = unsupported_kinds(groups, not mamba_states_off(vllm_config, async_loads))
        usable = [] if self.unsupported else list(groups)
        self.groups = [g for g in usable if g.paged]  # one stream each
        mamba = [g for g in usable if g.kind == "mamba"]
        align = hit_alignment(groups, config.chunk_size, int(vllm_config.cache_config.block_size))
        self.mamba = MambaStates(mamba, config.chunk_size, align) if mamba else None
        self._get_metadata = get_metadata
        self._split_lock = threading.Lock()
        self._split_of: object = None
        self._views: list[object] = []
        self.streams = [
            WorkerSide(
                vllm_config,
                config,
                engine_key,
                world_size,
                rank,
                partial(self._view, i),
                on_engine,
                block_size=g.block_size,
                group_tag=group_tag(g, len(groups)),
                serve_lookups=False,
            )
            for i, g in enumerate(self.groups)
        ]
        self._by_layer = {
            name: stream
            for g, stream in zip(self.groups, self.streams, strict=True)
            for name in g.layer_names
        }
        full = [i for i, g in enumerate(self.groups) if g.kind == "full"]
        self._primary = full[0] if full else 0
        self._lookup_server: LookupServer | None = None
        self._lost_errors = 0  # load errors vLLM could not be told of (logged)
        self.async_loads = AsyncLoads(self.groups) if async_loads and self.streams else None

    # ------------------------------------------------------------------ registration

    @property
    def lmcache_engine(self) -> LMCacheEngine | None:
        """The first full-attention stream's cache engine (``None`` before registration)."""
        return self.streams[self._primary].lmcache_engine if self.streams else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register each group's layers with its stream, then serve lookups for all of them."""
        if not self.streams:
            logger.info(
                "lmcache: not registering this engine's KV caches (%s groups): lmcache stores "
                "and loads nothing for this model",
                ", ".join(self.unsupported),
            )
            return
        for g, stream in zip(self.groups, self.streams, strict=True):
            stream.register_kv_caches({n: kv_caches[n] for n in g.layer_names if n in kv_caches})
        if self.mamba is not None:
            self.mamba.register(kv_caches, self.lmcache_engine)
        if self._lookup_server is None:
            self._lookup_server = LookupServer(
                self.engine_key, self.rank, self._lookup, self._clear
            )

    def _lookup(self, query: LookupQuery) -> int:
        """Every stream looks up and leases; the hit is the shortest of theirs, cut down to a
        boundary with a state for every Mamba group."""
        hit = min((s._lookup(query) for s in self.streams), default=0)
        return self.mamba.hit(query, hit) if self.mamba is not None and hit else hit

    def _clear(self) -> None:
        for stream in self.streams:
            stream._clear()
        if self.mamba is not None:
            self.mamba.clear()

    # ------------------------------------------------------------------ per step

    def _split(self, meta: object) -> list[object]:
        """Each stream's view of ``meta`` (computed once per metadata object)."""
        with self._split_lock:
            if meta is not self._split_of or not self._views:
                if isinstance(meta, LMCacheConnectorMetadata):
                    views: list[object] = list(split_metadata(meta, self.groups, self.chunk_size))
                else:
                    views = [meta] * len(self.streams)
                self._split_of, self._views = meta, views
            return self._views

    def _view(self, index: int) -> object:
        views = self._split(self._get_metadata())
        return views[index] if views else None

    def bind(self, meta: object) -> None:
        for stream, view in zip(self.streams, self._split(meta), strict=False):
            stream.bind(view)

    def handle_preemptions(self, meta: object) -> None:
        for stream, view in zip(self.streams, self._split(meta), strict=False):
            stream.handle_preemptions(view)

    def start_load_kv(self) -> None:
        """Each stream loads its group's part of the step's loads; with asynchronous loads, a
        load whose metadata fails the check is taken out first, and a stream that raises fails
        every load of the step (reported to vLLM, not raised)."""
        tracker = self.async_loads
        if tracker is None:
            for stream in self.streams:
                stream.start_load_kv()
            return
        meta = self._get_metadata()
        if isinstance(meta, LMCacheConnectorMetadata):
            ready = all(stream.lmcache_engine is not None for stream in self.streams)
            tracker.start(meta, self._split(meta), ready)
        try:
            for stream in self.streams:
                stream.start_load_kv()
            if self.mamba is not None and isinstance(meta, LMCacheConnectorMetadata):
                self._load_states(meta, self.mamba, tracker)
        except Exception as exc:
            logger.exception("lmcache: a stream's loads failed")
            tracker.fail_started(f"a stream raised {exc!r}")

    @staticmethod
    def _load_states(
        meta: LMCacheConnectorMetadata, mamba: MambaStates, tracker: AsyncLoads
    ) -> None:
        """Write the Mamba states at the end of each load that has not failed so far."""
        for req in meta.requests:
            if req.load is None or tracker.failed(req.req_id):
                continue
            why = mamba.load(req)
            if why:
                tracker.fail(req.req_id, why)

    def wait_for_layer_load(self, layer_name: str) -> None:
        stream = self._by_layer.get(layer_name)
        if stream is not None:
            stream.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        stream = self._by_layer.get(layer_name)
        if stream is not None:
            stream.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        """Each stream finishes its loads and queues its saves; with asynchronous loads, the
        outcome of every load started so far is then known (:meth:`AsyncLoads.settle`)."""
        tracker = self.async_loads
        meta = self._get_metadata()
        if self.mamba is not None and isinstance(meta, LMCacheConnectorMetadata):
            try:  # the forward wrote the offered states: copy them before any later step
                self.mamba.save(meta.state_saves)
            except Exception:
                logger.exception("lmcache: storing Mamba states failed; they are no hits")
        try:
            for stream in self.streams:
                stream.wait_for_save()
        except Exception:
            if tracker is not None:  # some loads may not have finished: none is reported loaded
                tracker.fail_started("a stream's wait_for_save raised")
            raise
        finally:
            if tracker is not None and tracker.pending:
                tracker.settle([stream.get_block_ids_with_load_errors() for stream in self.streams])

    def take_transfer_results(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous load is complete (vLLM's ``finished_recving``) and
        those of them whose load failed or was short in any group (``failed_recving``)."""
        if self.async_loads is None:
            return set(), set()
        return self.async_loads.take()

    def get_finished(self, finished_req_ids: Iterable[str]) -> None:
        ids = list(finished_req_ids)
        for stream in self.streams:
            stream.get_finished(ids)
        if self.mamba is not None:
            self.mamba.release(ids)

    @property
    def held_leases(self) -> int:
        return sum(stream.held_leases for stream in self.streams)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Always empty: vLLM raises on block-level load errors with several KV cache groups
        (block ids are per group). Failed asynchronous loads go to vLLM per request
        (:meth:`take_transfer_results`); without them the scheduler sends no loads, so a
        stream's error here is logged as what it is, a bug."""
        lost = set().union(*(stream.get_block_ids_with_load_errors() for stream in self.streams))
        if lost:
            self._lost_errors += len(lost)
            logger.error(
                "lmcache: loads failed for %d blocks outside any asynchronous load; vLLM cannot "
                "take block-level errors with several KV cache groups",
                len(lost),
            )
        return set()

    def take_stats(self) -> dict[str, float] | None:
        """The streams' counters since the last call, each request counted once."""
        out: dict[str, float] = {}
        tracker = self.async_loads
        for i, stream in enumerate(self.streams):
            for name, value in (stream.take_stats() or {}).items():
                if name in _ONCE_PER_REQUEST and i != self._primary:
                    continue
                if tracker is not None and name in _ASYNC_COUNTED:
                    continue
                out[name] = out.get(name, 0.0) + value
        if tracker is not None:
            for name, value in tracker.take_stats().items():
                out[name] = out.get(name, 0.0) + value
        return out if any(out.values()) else None

    def shutdown(self) -> None:
        """Stop the lookup server, then each stream (finishing its queued saves)."""
        if self._lookup_server is not None:
            self._lookup_server.close()
            self._lookup_server = None
        for stream in self.streams:
            stream.shutdown()
        if self.mamba is not None:
            self.mamba.close()
