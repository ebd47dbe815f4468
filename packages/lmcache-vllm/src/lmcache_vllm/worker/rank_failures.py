# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism: every rank marks what any rank's failed load spoiled.

With tensor parallelism each rank loads its own shard of a request's hit.
A load can fail on one rank only (a damaged chunk, a tier error on that rank).
That rank's heads are then wrong from the first token it did not load on.
The next layer's input on every rank depends on every rank's heads.
So the KV that the other ranks compute over the failure is wrong too, though their own loads
succeeded.
Had they stored it, a later hit across all ranks would load it and give wrong output.
No rank sees another rank's failure by itself.

So in every step whose metadata carries a load, the ranks exchange their failures, before any
commit of that step (:class:`RankFailures`).
Each rank puts, per request loading in the step, the first token it did not load (or none).
One all-reduce (minimum) over vLLM's tensor-parallel group (its CPU group: gloo) gives every
rank every request's first failed token on any rank.
Each rank then marks those requests in its :class:`~lmcache_vllm.worker.failed_loads.FailedLoads`,
with the blocks from that token to the load's end as failed blocks.
From then on every rank holds the same marks and failed blocks, so every rank cuts the same saves.
On the CPU loads are synchronous: the exchange ends ``start_load_kv``, before the step's saves
are planned.
Layerwise and on CUDA a load's outcome is known only at ``wait_for_save``: the exchange comes
there, after the loads are waited for and before the step's commits are queued.

Why this, and not the scheduler side passing on vLLM's combined failed blocks
(``KVConnectorOutput.invalid_block_ids``) in a later step's metadata:

- Asynchronous scheduling (vLLM 0.32's default) schedules the next step before the last step's
  output is processed.
  A failure of step N would reach the workers only with step N+2's metadata, or later with
  pipeline parallelism (several batches in flight).
  Every rank would have to hold back, for that long, the commits of every request that loaded
  or read a block loaded in those steps.
  When the engine goes idle no later metadata comes, and those chunks would never be stored.
  The exchange decides within the step, so :class:`FailedLoads`' rules (failed blocks count in
  the step of the failure and the next one) hold on every rank as on one.
- Steps without loads cost nothing: no rank exchanges anything.
  A step with loads pays one all-reduce of 8 bytes per loading request (about 1.1 ms on a
  2-core CPU with 2 ranks, where a gloo all-reduce of one layer's hidden state for a 390-token
  prompt takes 1.6 ms).
- All ranks of the tensor-parallel group receive the same metadata, so they agree on whether a
  step exchanges, and on the order of its requests.
  A rank with no failure of its own still exchanges.
  The exchange runs in a ``finally``: a rank whose loads raise still takes part before the error
  goes on to vLLM.
  It is issued from vLLM's forward thread, in the same order on every rank, like vLLM's own
  collectives on that group.
  A rank that raises out of the step leaves the others waiting in this exchange, as they would
  wait in the forward's own all-reduces: vLLM's executor stops the engine.
  An exchange that raises marks every load of the step as failed on that rank.

Pipeline parallelism: a failed load on one stage spoils the KV of every later stage.
No exchange inside a step can span the stages without deadlock: a stage sends its activations
to the next only after its step ends.
So with ``pipeline_parallel_size > 1`` the scheduler side loads nothing
(:data:`PIPELINE_LOADS_OFF`), and no load can fail.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, ReqMeta
from lmcache_vllm.worker.failed_loads import FailedLoads

__all__ = ["PIPELINE_LOADS_OFF", "RankFailures", "tp_cpu_group"]

logger = logging.getLogger(__name__)

PIPELINE_LOADS_OFF = (
    "lmcache: pipeline_parallel_size is %d; lmcache loads nothing for this engine and only "
    "stores (a load that failed on one stage would spoil the KV that later stages compute, and "
    "they cannot learn of it in time; see lmcache_vllm.worker.rank_failures)"
)

_NONE = 1 << 62  # no failure (all-reduced with min)


def tp_cpu_group() -> tuple[int, Any]:
    """vLLM's tensor-parallel group: its size and its CPU (gloo) process group.

    ``(1, None)`` where vLLM's groups are not set up (a worker outside vLLM, unit tests).
    """
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
    except (ImportError, AssertionError):  # no vLLM, or its groups are not initialized
        return 1, None
    return int(group.world_size), group.cpu_group


class RankFailures:
    """The exchange of a worker's failed loads with the other tensor-parallel ranks.

    Args:
        failed: This rank's record of what failed loads spoiled.
        block_size: vLLM's block size, in tokens.
        exchanges: ``False`` for a stream of a grouped worker (several KV cache groups).
            Its loads are asynchronous: vLLM computes nothing of a request before every rank
            has reported its load, and recomputes the request when any rank's failed.
            A stream that raised would also skip the other streams' exchanges on that rank
            only.
    """

    def __init__(self, failed: FailedLoads, block_size: int, exchanges: bool = True) -> None:
        self._failed = failed
        self.block_size = block_size
        self._exchanges = exchanges
        self._group: tuple[int, Any] | None = None  # looked up at the first step with loads
        self._due: list[ReqMeta] = []  # the loads of the step not exchanged yet
        self.exchanges = 0  # exchanges since the start
        self.remote_marks = 0  # requests marked for another rank's failure

    def arm(self, meta: LMCacheConnectorMetadata | None) -> None:
        """A step starts loading: its loads are exchanged once (:meth:`exchange`)."""
        loads = [] if meta is None else [r for r in meta.requests if r.load is not None]
        if not loads or not self._exchanges:
            return
        if self._group is None:
            self._group = tp_cpu_group()
        if self._group[0] > 1:
            self._due = loads

    def exchange(self) -> None:
        """Exchange the due step's failures with the other ranks and mark theirs here."""
        loads, self._due = self._due, []
        if not loads:
            return
        assert self._group is not None  # arm() looked it up
        fresh = self._failed.take_fresh()
        firsts = torch.tensor([fresh.get(r.req_id, _NONE) for r in loads], dtype=torch.int64)
        try:
            torch.distributed.all_reduce(
                firsts, op=torch.distributed.ReduceOp.MIN, group=self._group[1]
            )
        except Exception:
            logger.exception(
                "lmcache: the exchange of failed loads with the other ranks failed; no chunk "
                "computed over this step's loads is stored"
            )
            firsts = torch.tensor([r.load.vllm_cached for r in loads if r.load is not None])
        self.exchanges += 1
        for req, first in zip(loads, firsts.tolist(), strict=True):
            if first < fresh.get(req.req_id, _NONE):
                self._elsewhere(req, int(first))

    def _elsewhere(self, req: ReqMeta, first: int) -> None:
        """Another rank's load of ``req`` failed from token ``first`` on."""
        load = req.load
        assert load is not None
        bs = self.block_size
        blocks = req.block_ids[first // bs : -(-load.load_end // bs)]
        self._failed.failed(req, first, blocks, here=False)
        self.remote_marks += 1
        logger.warning(
            "lmcache: request %s: another rank's load failed from token %d; this rank stores "
            "none of the request's KV computed over it",
            req.req_id,
            first,
        )
