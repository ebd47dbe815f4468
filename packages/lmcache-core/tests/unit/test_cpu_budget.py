# SPDX-License-Identifier: Apache-2.0
"""A host budget below one chunk is refused at start, naming the key and the chunk's size.

Before, such a budget was accepted and every store was silently dropped: the engine served
correctly and stored nothing.
"""

from __future__ import annotations

import pytest
import torch

from lmcache.cache_engine import LMCacheEngine
from lmcache.config import ConfigError, LMCacheConfig
from lmcache.memory import aligned_bytes
from lmcache.metadata import LMCacheMetadata

CS = 256
LAYERS, HEADS, HEAD = 4, 2, 64
CHUNK_BYTES = LAYERS * CS * HEADS * HEAD * 2 * 2  # K and V, bfloat16


def _metadata() -> LMCacheMetadata:
    return LMCacheMetadata(
        "test/model", 1, 0, 0, 1, torch.bfloat16, LAYERS, HEADS, HEAD, HEAD, chunk_size=CS
    )


def _config(budget_bytes: int, **extra: object) -> LMCacheConfig:
    return LMCacheConfig(chunk_size=CS, max_local_cpu_size=budget_bytes / 1024**3, **extra)  # type: ignore[arg-type]


def test_budget_below_one_chunk_is_refused_with_the_key_and_the_chunk_size() -> None:
    config = _config(CHUNK_BYTES // 2)
    with pytest.raises(ConfigError) as err:
        LMCacheEngine(config, _metadata(), lower_tiers=())
    msg = str(err.value)
    assert "max_local_cpu_size" in msg
    assert f"{CHUNK_BYTES} bytes" in msg and f"{CS} tokens" in msg
    # The smallest budget the message names is accepted.
    least = float(msg.split("at least ")[1].split(" GB")[0])
    assert int(least * 1024**3) >= aligned_bytes(CHUNK_BYTES) - 1024**3 * 1e-6
    LMCacheEngine(_config(aligned_bytes(CHUNK_BYTES)), _metadata(), lower_tiers=()).close()


def test_unused_budget_is_not_checked() -> None:
    # local_cpu off and no lower tier: nothing is stored or staged, so the budget does not matter.
    config = _config(CHUNK_BYTES // 2, local_cpu=False)
    LMCacheEngine(config, _metadata(), lower_tiers=()).close()
