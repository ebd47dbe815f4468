# SPDX-License-Identifier: Apache-2.0
"""Every tensor-parallel rank marks what any rank's failed load spoiled
(:mod:`lmcache_vllm.worker.rank_failures`).

The rule with a stand-in for the all-reduce: which steps exchange, what another rank's failure
marks here, and what an exchange that raises does. Then the real exchange, over a gloo group of
two processes: each rank learns the other's failures, and a step where neither failed marks
nothing. The worker side exchanges even when its loads raise.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from typing import Any

import pytest
import torch

from lmcache_vllm.connector_metadata import LMCacheConnectorMetadata, LoadSpec, ReqMeta, SaveSpec
from lmcache_vllm.worker import rank_failures
from lmcache_vllm.worker.failed_loads import FailedLoads
from lmcache_vllm.worker.rank_failures import RankFailures

CHUNK, BLOCK = 64, 16


def _req(rid: str, load: tuple[int, int] | None, save: tuple[int, int] | None = None) -> ReqMeta:
    end = max(load[1] if load else 0, save[1] if save else 0, 384)
    return ReqMeta(
        rid,
        list(range(end)),
        list(range(base := 100 * (ord(rid[0]) - 96), base + end // BLOCK)),  # a's, b's, ...
        load=LoadSpec(load[0], load[1], load[1]) if load else None,
        save=SaveSpec(*save) if save else None,
        computed_start=load[1] if load else 0,
    )


class FakeReduce:
    """Stands in for ``torch.distributed.all_reduce``: the other rank's values, or an error."""

    def __init__(self, other: list[int] | None = None, error: bool = False) -> None:
        self.other, self.error, self.calls = other, error, 0

    def __call__(self, tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
        self.calls += 1
        if self.error:
            raise RuntimeError("connection reset by peer")
        assert self.other is not None
        tensor.copy_(torch.minimum(tensor, torch.tensor(self.other, dtype=torch.int64)))


def _ranks(monkeypatch: pytest.MonkeyPatch, reduce: FakeReduce, size: int = 2) -> RankFailures:
    monkeypatch.setattr(rank_failures, "tp_cpu_group", lambda: (size, object()))
    monkeypatch.setattr(torch.distributed, "all_reduce", reduce)
    return RankFailures(FailedLoads(BLOCK, CHUNK), BLOCK)


NONE = 1 << 62


def test_another_ranks_failure_marks_the_request_and_its_blocks(monkeypatch) -> None:
    reduce = FakeReduce(other=[NONE, 128])  # rank 0: b's load failed from token 128
    ranks = _ranks(monkeypatch, reduce)
    failed = ranks._failed
    a, b = _req("a", (0, 256), save=(256, 320)), _req("b", (0, 256), save=(256, 384))
    reader = _req("c", None, save=(0, 64))
    meta = LMCacheConnectorMetadata(requests=[a, reader, b])
    failed.begin_step(meta)
    ranks.arm(meta)
    ranks.exchange()
    assert reduce.calls == 1 and ranks.remote_marks == 1
    assert failed.allowed(a) is a  # a loaded everywhere
    assert failed.allowed(b) is None  # chunks 4-5 were computed over rank 0's failure
    assert failed.limit(b) == 128
    # the next step: a request that reads b's blocks 8-15 (vLLM's prefix cache) is marked
    c = ReqMeta("c", list(range(384)), b.block_ids, save=SaveSpec(256, 320), computed_start=256)
    failed.begin_step(LMCacheConnectorMetadata(requests=[c]))
    assert failed.limit(c) == 128 and failed.allowed(c) is None
    ranks.exchange()  # once per step
    assert reduce.calls == 1


def test_own_failure_is_sent_and_not_marked_twice(monkeypatch) -> None:
    seen: list[list[int]] = []
    reduce = FakeReduce(other=[NONE])
    inner = reduce.__call__

    def spy(tensor: torch.Tensor, op: Any = None, group: Any = None) -> None:
        seen.append(tensor.tolist())
        inner(tensor, op, group)

    ranks = _ranks(monkeypatch, reduce)
    monkeypatch.setattr(torch.distributed, "all_reduce", spy)
    req = _req("b", (0, 256), save=(256, 384))
    meta = LMCacheConnectorMetadata(requests=[req])
    ranks.arm(meta)
    ranks._failed.failed(req, 192, req.block_ids[12:16])  # this rank's own load failed
    ranks.exchange()
    assert seen == [[192]] and ranks.remote_marks == 0
    assert ranks._failed.limit(req) == 192
    assert ranks._failed.take_fresh() == {}  # sent: the next step does not send it again


def test_steps_without_loads_and_single_ranks_exchange_nothing(monkeypatch) -> None:
    reduce = FakeReduce(other=[0])
    ranks = _ranks(monkeypatch, reduce)
    ranks.arm(LMCacheConnectorMetadata(requests=[_req("a", None, save=(0, 64))]))
    ranks.arm(None)
    ranks.exchange()
    assert reduce.calls == 0
    single = _ranks(monkeypatch, reduce, size=1)
    single.arm(LMCacheConnectorMetadata(requests=[_req("a", (0, 128))]))
    single.exchange()
    grouped = RankFailures(FailedLoads(BLOCK, CHUNK), BLOCK, exchanges=False)
    grouped.arm(LMCacheConnectorMetadata(requests=[_req("a", (0, 128))]))
    grouped.exchange()
    assert reduce.calls == 0 and single.exchanges == grouped.exchanges == 0


def test_an_exchange_that_raises_marks_every_load_of_the_step(monkeypatch, caplog) -> None:
    ranks = _ranks(monkeypatch, FakeReduce(error=True))
    a, b = _req("a", (64, 256), save=(256, 320)), _req("b", (0, 128), save=(128, 192))
    ranks.arm(LMCacheConnectorMetadata(requests=[a, b]))
    ranks.exchange()
    assert (ranks._failed.limit(a), ranks._failed.limit(b)) == (64, 0)
    assert "no chunk computed over this step's loads is stored" in caplog.text


def test_the_worker_exchanges_even_when_its_loads_raise(monkeypatch) -> None:
    from lmcache_vllm.testing import connector_vllm_config
    from lmcache_vllm.vllm_v1_adapter import load_lmcache_config
    from lmcache_vllm.worker.side import WorkerSide

    reduce = FakeReduce(other=[NONE])
    monkeypatch.setattr(rank_failures, "tp_cpu_group", lambda: (2, object()))
    monkeypatch.setattr(torch.distributed, "all_reduce", reduce)
    vcfg = connector_vllm_config(
        engine_id="rank-failures",
        block_size=BLOCK,
        head_size=32,
        extra_config={"lmcache.chunk_size": CHUNK},
    )
    meta = LMCacheConnectorMetadata(requests=[_req("a", (0, 128))])
    worker = WorkerSide(vcfg, load_lmcache_config(vcfg), "e", 2, 1, lambda: meta)

    def boom(*args: Any) -> Any:
        raise RuntimeError("a bug in a load")

    monkeypatch.setattr(worker._loads, "load_all", boom)
    with pytest.raises(RuntimeError, match="a bug in a load"):
        worker.start_load_kv()
    assert reduce.calls == 1


# ---------------------------------------------------------------------------- real gloo


def _rank_main(rank: int, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        group = torch.distributed.new_group([0, 1], backend="gloo")
        ranks = RankFailures(FailedLoads(BLOCK, CHUNK), BLOCK)
        ranks._group = (2, group)
        a, b = _req("a", (0, 256), save=(256, 320)), _req("b", (64, 256), save=(256, 384))
        meta = LMCacheConnectorMetadata(requests=[a, b])
        ranks._failed.begin_step(meta)
        ranks.arm(meta)
        if rank == 0:  # only rank 0's load of b fails
            ranks._failed.failed(b, 192, b.block_ids[12:16])
        ranks.exchange()
        quiet = LMCacheConnectorMetadata(requests=[_req("d", (0, 64))])
        ranks._failed.begin_step(quiet)
        ranks.arm(quiet)  # a step where no rank failed
        ranks.exchange()
        queue.put(
            (
                rank,
                ranks._failed.limit(a),
                ranks._failed.limit(b),
                ranks.remote_marks,
                len(ranks._failed),
            )
        )
    finally:
        torch.distributed.destroy_process_group()


def test_real_gloo_exchange_between_two_ranks() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")  # the children need this module, which spawn cannot import
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    got = sorted(queue.get(timeout=5) for _ in procs)
    # both ranks mark b from token 192 (rank 1 for rank 0's failure); a and d stay unmarked
    assert got == [(0, None, 192, 0, 1), (1, None, 192, 1, 1)]


@pytest.mark.parametrize("pp", [1, 2])
def test_pipeline_parallel_engines_load_nothing(pp, caplog) -> None:
    from types import SimpleNamespace

    from lmcache_vllm import vllm_v1_adapter as adapter

    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role="kv_both",
            engine_id="e",
            kv_connector_extra_config={"lmcache.chunk_size": CHUNK},
            kv_load_failure_policy="fail",
        ),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=pp, rank=0),
        instance_id="i0",
    )
    impl = adapter.LMCacheConnectorV1Impl(cfg, SimpleNamespace(name="SCHEDULER"), None)
    assert impl.scheduler is not None and impl.scheduler.loads_enabled == (pp == 1)
    assert ("pipeline_parallel_size is 2; lmcache loads nothing" in caplog.text) == (pp == 2)
