# SPDX-License-Identifier: Apache-2.0
"""What a failed load spoils: KV computed over it, which no save may store.

A synchronous load that fails (a chunk fails its checksum, a chunk is gone, a tier errs) leaves
the request's blocks unfilled from the first token lmcache did not load on.
vLLM hears of it only after the step (``get_block_ids_with_load_errors``).
Whatever ``kv_load_failure_policy`` says, that step has already computed the request's later
tokens over the unfilled blocks: their KV is wrong, and a chunk stored from it would hand the
same wrong KV to every later hit.
With asynchronous scheduling the next step was scheduled before vLLM heard, and it computes
more of the request over the same blocks.
Other requests can read those blocks too: vLLM's prefix cache shares blocks still loading.

:class:`FailedLoads` keeps, per request, the first token whose KV may be wrong (its *mark*).
Every save asks it what it may store (:meth:`FailedLoads.allowed`, :meth:`FailedLoads.spoils`):
only chunks that end by the mark.
Chunks before the mark were loaded and verified, or computed by earlier steps.

A request gets a mark when its own load fails, or when it reads a failed block.
It reads a block if the block lies before the tokens it computes this step and its own load
does not write it.
Failed blocks count in the step whose load failed and in the next one, the one step
asynchronous scheduling runs ahead of what vLLM knows.
vLLM rolls back every request that holds a failed block once it hears.
A mark goes when vLLM schedules the request from the mark or earlier: vLLM recomputes it from
there, so what it computes then is right and is saved as usual.
A mark also goes when the request ends.

With tensor parallelism every rank marks what any rank's failed load spoiled: the next layer's
input on every rank depends on every rank's heads (:mod:`lmcache_vllm.worker.rank_failures`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterable

from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, ReqMeta, SaveSpec

__all__ = ["FailedLoads"]

logger = logging.getLogger(__name__)


class FailedLoads:
    """Marks of one worker stream's requests whose KV a failed load spoiled (module docstring).

    Args:
        block_size: vLLM's block size of the stream's layers, in tokens.
        chunk_size: lmcache's chunk size in tokens.
    """

    def __init__(self, block_size: int, chunk_size: int) -> None:
        self.block_size = block_size
        self.chunk_size = chunk_size
        self._lock = threading.Lock()  # vLLM calls the hooks on one thread; if not, still whole
        self._step = 0
        self._marks: dict[str, int] = {}  # request -> first token whose KV may be wrong
        self._blocks: dict[int, int] = {}  # failed block -> the step its load failed in
        self._logged: set[tuple[str, int]] = set()  # (request, mark) already logged
        self._fresh: dict[str, int] = {}  # this rank's failures the other ranks have not heard of
        self.cut_saves = 0  # saves cut short or dropped since the start

    def __len__(self) -> int:
        """Requests marked."""
        return len(self._marks)

    def failed(
        self, req: ReqMeta, first_bad: int, blocks: Iterable[int], here: bool = True
    ) -> None:
        """``req``'s load did not deliver token ``first_bad`` on; ``blocks`` stayed unfilled.

        ``here``: on this rank; ``False``: on another tensor-parallel rank
        (:mod:`lmcache_vllm.worker.rank_failures`).
        """
        with self._lock:
            self._mark(req.req_id, first_bad)
            if here:
                fresh = self._fresh.get(req.req_id)
                self._fresh[req.req_id] = first_bad if fresh is None else min(fresh, first_bad)
            for block in blocks:
                self._blocks[int(block)] = self._step

    def take_fresh(self) -> dict[str, int]:
        """This rank's failures since the last call: request -> first token not loaded."""
        with self._lock:
            fresh, self._fresh = self._fresh, {}
        return fresh

    def begin_step(self, meta: LMCacheConnectorMetadata) -> None:
        """A new step: forget the failed blocks of the step before last, and the marks of the
        requests vLLM now recomputes from their mark or earlier."""
        with self._lock:
            self._step += 1
            self._fresh.clear()  # exchanged by now, or nobody to tell (one rank)
            if self._blocks:
                self._blocks = {b: s for b, s in self._blocks.items() if s >= self._step - 1}
            if not self._marks:
                return
            for req in meta.requests:
                mark = self._marks.get(req.req_id)
                if mark is not None and req.computed_start <= mark:
                    del self._marks[req.req_id]
                    logger.info(
                        "lmcache: request %s is computed again from token %d: its saves resume",
                        req.req_id,
                        req.computed_start,
                    )

    def end(self, req_ids: Iterable[str]) -> None:
        """These requests ended: their marks go."""
        if not self._marks:
            return
        with self._lock:
            for rid in req_ids:
                self._marks.pop(rid, None)

    def limit(self, req: ReqMeta) -> int | None:
        """The first token of ``req`` whose KV may be wrong in this step (``None``: all right)."""
        if not self._marks and not self._blocks:
            return None
        with self._lock:
            if self._blocks:
                self._mark_reads(req)
            return self._marks.get(req.req_id)

    def _mark_reads(self, req: ReqMeta) -> None:
        """Mark ``req`` if it reads a failed block: one before the tokens it computes, and not
        one its own load of this step writes (a failure of that load marked it already)."""
        bs = self.block_size
        load = req.load
        own = range(0) if load is None else range(load.vllm_cached // bs, -(-load.load_end // bs))
        for i, block in enumerate(req.block_ids[: -(-req.computed_start // bs)]):
            if block in self._blocks and i not in own:
                self._mark(req.req_id, i * bs)
                return

    def spoils(self, req: ReqMeta, end: int) -> bool:
        """Whether a save of ``req``'s chunks up to token ``end`` would store wrong KV."""
        mark = self.limit(req)
        if mark is None or end <= mark:
            return False
        self._log(req.req_id, mark)
        with self._lock:
            self.cut_saves += 1
        return True

    def allowed(self, req: ReqMeta) -> ReqMeta | None:
        """``req`` with its save cut to the chunks that end by its mark (``req`` itself when its
        save is untouched), or ``None`` when no chunk of its save is left."""
        save = req.save
        if save is None or not self.spoils(req, save.end):
            return req
        mark = self.limit(req)
        assert mark is not None  # spoils() found it
        end = mark // self.chunk_size * self.chunk_size
        if end <= save.skip:
            return None
        return dataclasses.replace(req, save=SaveSpec(save.skip, end))

    def _mark(self, rid: str, token: int) -> None:
        mark = self._marks.get(rid)
        self._marks[rid] = token if mark is None else min(mark, token)

    def _log(self, rid: str, mark: int) -> None:
        if (rid, mark) in self._logged:
            return
        if len(self._logged) > 4096:  # a bound: a long run logs each request once a while
            self._logged.clear()
        self._logged.add((rid, mark))
        logger.warning(
            "lmcache: request %s: not storing its chunks past token %d: their KV was computed "
            "over blocks whose load failed",
            rid,
            mark,
        )
