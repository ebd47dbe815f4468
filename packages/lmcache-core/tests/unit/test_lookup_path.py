# SPDX-License-Identifier: Apache-2.0
"""``LMCacheEngine.lookup`` over every token-id input type, against a key-by-key reference.

The lookup asks the CPU tier in doubling runs of keys (one lock each); the reference computes
every key with :func:`lmcache.keys.chunk_keys` and asks the tier one key at a time.
"""

from __future__ import annotations

import random

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


def test_lookup_matches_the_key_by_key_reference(engine: LMCacheEngine) -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(50_000) for _ in range(MAX_TOKENS)]
    for stored in (0, 1, 2, 3, 5, 8, 13, 21, 34):
        engine.clear()
        if stored:
            n = stored * CS
            engine.store(prompt[:n], None, TransferSpec(torch.arange(n)))
        for length in (1, CS, 3 * CS + 2, 20 * CS, MAX_TOKENS - 3):
            tokens = prompt[:length]
            want = _reference(engine, tokens)
            for source in (tokens, tuple(tokens), np.array(tokens), torch.tensor(tokens)):
                assert engine.lookup(source) == want, (stored, length, type(source))  # type: ignore[arg-type]


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
