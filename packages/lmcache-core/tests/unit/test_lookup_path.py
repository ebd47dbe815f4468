# SPDX-License-Identifier: Apache-2.0
"""``LMCacheEngine.lookup`` over every token-id input type, against a key-by-key reference.

The lookup asks the CPU tier in doubling runs of keys (one lock each); the reference computes
every key with :func:`lmcache.keys.chunk_keys` and asks the tier one key at a time.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector.interface import EngineInfo, TransferSpec
from lmcache.keys import chunk_keys
from lmcache.metadata import LMCacheMetadata
from lmcache.testing import PagedCPUConnector

CS = 8
MAX_TOKENS = 40 * CS


@pytest.fixture
def engine() -> LMCacheEngine:
    metadata = LMCacheMetadata(
        "test/lookup-path", 1, 0, 0, 1, torch.float32, 1, 1, 2, 2, chunk_size=CS
    )
    config = LMCacheConfig(chunk_size=CS, max_local_cpu_size=0.01)
    caches = [torch.randn(MAX_TOKENS, 1, metadata.kv_width)]
    connector = PagedCPUConnector(
        config, metadata, EngineInfo("mock", "cpu", caches, extra={"page_size": 1})
    )
    eng = LMCacheEngine(config, metadata, connector, lower_tiers=())
    yield eng
    eng.close()


def _reference(engine: LMCacheEngine, tokens: list[int]) -> int:
    keys = chunk_keys(tokens, engine._fingerprint, CS, salt=engine.config.cache_salt + "\0")
    found = 0
    while found < len(keys) and engine.tier.contains(keys[found]):
        found += 1
    return min(found * CS, len(tokens))


def _cases(
    engine: LMCacheEngine, seed: int, stored_chunks: tuple[int, ...]
) -> Iterator[tuple[int, int, list[int], int]]:
    """``(stored, length, tokens, reference hit)``: ``stored`` chunks of a random prompt in the
    engine (emptied first), then prefixes of it of several lengths."""
    rng = random.Random(seed)
    prompt = [rng.randrange(50_000) for _ in range(MAX_TOKENS)]
    for stored in stored_chunks:
        engine.clear()
        if stored:
            n = stored * CS
            engine.store(prompt[:n], None, TransferSpec(torch.arange(n)))
        for length in (1, CS, 3 * CS + 2, 20 * CS, MAX_TOKENS - 3):
            tokens = prompt[:length]
            yield stored, length, tokens, _reference(engine, tokens)


def _sources(tokens: list[int]) -> tuple[Any, ...]:
    """``tokens`` as every input type a lookup takes."""
    return (tokens, tuple(tokens), np.array(tokens), torch.tensor(tokens))


def test_lookup_matches_the_key_by_key_reference(engine: LMCacheEngine) -> None:
    for stored, length, tokens, want in _cases(engine, 4, (0, 1, 2, 3, 5, 8, 13, 21, 34)):
        for source in _sources(tokens):
            assert engine.lookup(source) == want, (stored, length, type(source))


def test_a_bad_token_past_the_hit_is_not_read_from_a_list(engine: LMCacheEngine) -> None:
    """A list's tokens are read only as far as the lookup needs them, although the tier is asked
    in runs of keys: a bad id in a chunk after the first missing one is no error. An array is
    checked whole at once."""
    tokens = list(range(100, 100 + 8 * CS))
    engine.store(tokens[: 3 * CS], None, TransferSpec(torch.arange(3 * CS)))
    bad = [*tokens[: 5 * CS], -1, *tokens[5 * CS + 1 :]]  # in chunk 5; chunk 3 is missing
    assert engine.lookup(bad) == 3 * CS  # runs [0, 1), [1, 3), [3, 7) would read chunk 5
    with pytest.raises(ValueError, match=rf"token_ids\[{5 * CS}\] = -1"):
        engine.lookup(np.array(bad))
    with pytest.raises(ValueError, match=rf"token_ids\[{3 * CS}\] = -1"):
        engine.lookup([*tokens[: 3 * CS], -1])  # in the chunk the answer needs


def test_lookup_and_lease_matches_the_key_by_key_reference(engine: LMCacheEngine) -> None:
    """The lease reads the CPU tier in doubling runs of keys too: it holds exactly the chunks
    of the reference's hit, each with the shape of its tokens, for every input type."""
    for stored, length, tokens, want in _cases(engine, 5, (0, 1, 2, 3, 5, 8, 13, 34)):
        keys = chunk_keys(tokens, engine._fingerprint, CS, salt=engine.config.cache_salt + "\0")
        for source in _sources(tokens):
            with engine.lookup_and_lease(source) as hit:
                assert hit.num_tokens == want, (stored, length, type(source))
                assert hit.keys == keys[: -(-want // CS)]
                sizes = [t.shape[1] for t in hit.tensors()]
                assert sizes == [min(CS, want - i * CS) for i in range(len(hit))]
    held = [e.lease.ref_count for e in engine.tier._entries.values()]
    assert held and all(refs == 1 for refs in held)  # every lease went with its hit


def test_a_bad_token_past_the_hit_is_not_read_by_lookup_and_lease(
    engine: LMCacheEngine,
) -> None:
    tokens = list(range(100, 100 + 8 * CS))
    engine.store(tokens[: 3 * CS], None, TransferSpec(torch.arange(3 * CS)))
    bad = [*tokens[: 5 * CS], -1, *tokens[5 * CS + 1 :]]  # in chunk 5; chunk 3 is missing
    with engine.lookup_and_lease(bad) as hit:  # runs [0, 1), [1, 3), [3, 7) would read chunk 5
        assert hit.num_tokens == 3 * CS
    with pytest.raises(ValueError, match=rf"token_ids\[{3 * CS}\] = -1"):
        engine.lookup_and_lease([*tokens[: 3 * CS], -1])  # in the chunk the answer needs
    held = [e.lease.ref_count for e in engine.tier._entries.values()]
    assert held == [1, 1, 1]  # the leases taken before the error were released


def test_a_chunk_of_another_shape_ends_the_lease(
    engine: LMCacheEngine, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = list(range(7, 7 + 4 * CS))
    engine.store(tokens, None, TransferSpec(torch.arange(4 * CS)))
    keys = chunk_keys(tokens, engine._fingerprint, CS, salt=engine.config.cache_salt + "\0")
    lease = engine.tier.allocate((1, CS // 2, engine.metadata.kv_width), torch.float32)
    assert lease is not None
    with lease:  # chunk 2 replaced by bytes of half its tokens: a miss from there on
        engine.tier.put(keys[2], lease, None, owner=engine._fingerprint, parent=keys[1])
    with engine.lookup_and_lease(tokens) as hit:
        assert hit.num_tokens == 2 * CS
    assert f"Chunk {keys[2].hex()} has shape" in caplog.text
