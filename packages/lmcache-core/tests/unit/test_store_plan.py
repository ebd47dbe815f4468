# SPDX-License-Identifier: Apache-2.0
"""A staged store reaches the engine only through the ``StoreCommitter`` it is given.

A recording committer stands in for the engine. The tests check what a
:class:`~lmcache.engine.store_plan.StagedStore` hands it (its chunks, chain, start time, and its slice
of a batch's device checksums) and that the buffers go back in every case.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from lmcache.engine.chunk_moves import Pending
from lmcache.engine.store_plan import StagedStore
from lmcache.gpu_connector.checksums import StoreChecksums
from lmcache.gpu_connector.interface import ChunkTransfer
from lmcache.memory import HostMemoryPool

CHUNK = 4


class RecordingCommitter:
    """Records each ``commit_store`` call and returns the tokens of the chunks it was given."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[list[bytes], float, list[bytes], list[int] | None]] = []
        self.fail = fail

    def commit_store(
        self,
        pending: Sequence[Pending],
        started: float,
        chain: Sequence[bytes] = (),
        sums: Sequence[int] | None = None,
    ) -> int:
        self.calls.append(
            ([p.key for p in pending], started, list(chain), None if sums is None else list(sums))
        )
        if self.fail:
            raise RuntimeError("injected commit failure")
        return sum(p.chunk.num_tokens for p in pending)


def _pending(pool: HostMemoryPool, count: int) -> list[Pending]:
    out = []
    for i in range(count):
        lease = pool.allocate((1, CHUNK, 2), torch.float32)
        assert lease is not None
        chunk = ChunkTransfer(i * CHUNK, (i + 1) * CHUNK, lease.tensor)
        out.append(Pending(bytes([i]) * 16, chunk, lease, bytes([i - 1]) * 16 if i else None))
    return out


def test_commit_hands_the_committer_its_slice_of_the_batch_sums() -> None:
    pool = HostMemoryPool(1 << 20, pin=False)
    pending = _pending(pool, 2)
    chain = [p.key for p in pending]
    batch_sums = StoreChecksums(torch.tensor([11, 22, 33, -1], dtype=torch.int64))
    committer = RecordingCommitter()
    staged = StagedStore(committer, pending, chain, 5.0, sums=batch_sums, sums_at=1)
    assert staged.num_tokens == 2 * CHUNK
    assert staged.commit() == 2 * CHUNK
    # Positions 1 and 2 of the batch are this store's; the sums are read as unsigned 64-bit.
    assert committer.calls == [(chain, 5.0, chain, [22, 33])]
    assert all(p.lease.released for p in pending)
    with pytest.raises(RuntimeError, match="committed or aborted already"):
        staged.commit()
    assert len(committer.calls) == 1


def test_commit_without_device_sums_passes_none_and_last_sum_is_unsigned() -> None:
    pool = HostMemoryPool(1 << 20, pin=False)
    pending = _pending(pool, 1)
    committer = RecordingCommitter()
    StagedStore(committer, pending, (), 1.0).commit()
    assert committer.calls[0][3] is None
    pending = _pending(pool, 1)
    sums = StoreChecksums(torch.tensor([-1], dtype=torch.int64))
    StagedStore(committer, pending, (), 1.0, sums=sums).commit()
    assert committer.calls[1][3] == [(1 << 64) - 1]


def test_a_failing_commit_still_releases_the_buffers() -> None:
    pool = HostMemoryPool(1 << 20, pin=False)
    pending = _pending(pool, 2)
    staged = StagedStore(RecordingCommitter(fail=True), pending, (), 0.0)
    with pytest.raises(RuntimeError, match="injected"):
        staged.commit()
    assert all(p.lease.released for p in pending)


def test_abort_releases_without_committing_and_an_empty_store_commits_nothing() -> None:
    pool = HostMemoryPool(1 << 20, pin=False)
    pending = _pending(pool, 1)
    committer = RecordingCommitter()
    staged = StagedStore(committer, pending, (), 0.0)
    staged.abort()
    assert pending[0].lease.released and committer.calls == []
    assert StagedStore(committer, [], (), 0.0).commit() == 0
    assert committer.calls == []
