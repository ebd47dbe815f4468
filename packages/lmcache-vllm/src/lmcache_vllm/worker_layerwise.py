# SPDX-License-Identifier: Apache-2.0
"""Layerwise mode of the worker: one step's per-layer loads and saves.

With ``use_layerwise``, a hit is loaded layer by layer as vLLM's forward reaches each layer
(``wait_for_layer_load``) and a save copies each layer once the forward has written it
(``save_kv_layer``); both finish when the step ends (the next ``bind_connector_metadata`` or
``wait_for_save``). Chunks of a layerwise save become visible to lookups only at that end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from lmcache_vllm.connector_metadata import ReqMeta

if TYPE_CHECKING:
    from lmcache.cache_engine import HeldHit, LayerwiseRetrieve, LayerwiseStore

__all__ = ["LayerwiseStep"]

logger = logging.getLogger(__name__)


class LayerwiseStep:
    """The layerwise loads and saves of the current step.

    Args:
        xfer_lock: Serialises transfers with the worker's other users of the connector.
        on_load_failed: Called with a request whose load failed part-way (its blocks become
            load errors).
        on_saved: Called with (tokens stored, seconds) for each completed save.
    """

    def __init__(
        self,
        xfer_lock: threading.Lock,
        on_load_failed: Callable[[ReqMeta], None],
        on_saved: Callable[[int, float], None],
    ) -> None:
        self._lock = xfer_lock
        self._on_load_failed = on_load_failed
        self._on_saved = on_saved
        self._retrievers: list[tuple[ReqMeta, LayerwiseRetrieve, HeldHit | None]] = []
        self._storers: list[tuple[ReqMeta, LayerwiseStore, float]] = []
        self.saves_started = False

    def add_load(self, req: ReqMeta, retriever: LayerwiseRetrieve, held: HeldHit | None) -> None:
        """Drive ``retriever`` per layer this step; ``held`` is released at the end."""
        self._retrievers.append((req, retriever, held))

    def add_saves(self, storers: Iterable[tuple[ReqMeta, LayerwiseStore]]) -> None:
        """Drive these stores per layer this step."""
        self.saves_started = True
        started = time.perf_counter()
        self._storers += [(req, storer, started) for req, storer in storers]

    def load_layer(self, layer: int) -> None:
        """Copy ``layer`` of every pending load into vLLM's pages."""
        for item in list(self._retrievers):
            req, retriever, held = item
            try:
                with self._lock:
                    retriever.load_layer(layer)
            except Exception:
                logger.exception("lmcache: layerwise load of %s failed", req.req_id)
                self._retrievers.remove(item)
                if held is not None:
                    held.release()
                self._on_load_failed(req)

    def save_layer(self, layer: int) -> None:
        """Copy ``layer`` of every pending save out of vLLM's pages."""
        for item in list(self._storers):
            try:
                with self._lock:
                    item[1].store_layer(layer)
            except Exception:
                logger.exception("lmcache: layerwise save of %s failed", item[0].req_id)
                self._storers.remove(item)

    def finish(self) -> None:
        """End of step: wait for the loads, publish the saves, release every lease."""
        for req, retriever, held in self._retrievers:
            try:
                with self._lock:
                    retriever.finish()
            except Exception as exc:  # layers missing: the forward did not call us per layer
                logger.warning("lmcache: layerwise load of %s incomplete (%s)", req.req_id, exc)
                self._on_load_failed(req)
            finally:
                if held is not None:
                    held.release()
        for req, storer, started in self._storers:
            try:
                stored = storer.finish()
            except Exception as exc:
                logger.warning("lmcache: layerwise save of %s incomplete (%s)", req.req_id, exc)
                continue
            self._on_saved(stored, time.perf_counter() - started)
        self._retrievers, self._storers = [], []
        self.saves_started = False

    def abort(self) -> None:
        """Drop every pending load and save (shutdown)."""
        for _, retriever, held in self._retrievers:
            retriever.abort()
            if held is not None:
                held.release()
        for _, storer, _ in self._storers:
            storer.abort()
        self._retrievers, self._storers = [], []
