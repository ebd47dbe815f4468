# SPDX-License-Identifier: Apache-2.0
"""Mamba states without vLLM (:mod:`lmcache_vllm.worker.mamba_states`): saved from vLLM's
offers into a real CPU tier, looked up at the longest boundary with every group's state, loaded
into the block vLLM allocated, and refused when damaged or without a block (real vLLM:
tests/integration/test_hybrid_models.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmcache.memory import HostMemoryPool
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import CPUTier
from lmcache_vllm.connector_metadata import LoadSpec, ReqMeta, StateSaves
from lmcache_vllm.kv_groups import KVGroup
from lmcache_vllm.lookup_wire import LookupQuery
from lmcache_vllm.worker.mamba_states import MambaStates

CHUNK, BLOCK, NUM_BLOCKS = 16, 8, 12
GROUPS = [
    KVGroup(0, "mamba", ("m0",), BLOCK),
    KVGroup(2, "mamba", ("m2a", "m2b"), BLOCK),
]
PROMPT = list(range(100, 160))


def _caches() -> dict[str, object]:
    """Raw int8 pages like vLLM's (padded block stride), and a (conv, ssm) pair of typed ones."""
    raw = torch.zeros(NUM_BLOCKS, 48, dtype=torch.int8).as_strided(
        (NUM_BLOCKS, 1, 1, 40), (48, 40, 40, 1)
    )
    return {
        "m0": raw,
        "m2a": (torch.zeros(NUM_BLOCKS, 3, 4), torch.zeros(NUM_BLOCKS, 2, 2, 2)),
        "m2b": torch.zeros(NUM_BLOCKS, 5, dtype=torch.float16),
    }


def _states(caches: dict[str, object], tier: CPUTier | None = None) -> MambaStates:
    tier = tier or CPUTier(HostMemoryPool(1 << 20, pin=False), LMCacheMetrics())
    engine = SimpleNamespace(
        tier=tier,
        metrics=LMCacheMetrics(),
        config=SimpleNamespace(cache_salt=""),
        metadata=SimpleNamespace(fingerprint=lambda: b"model"),
    )
    states = MambaStates(GROUPS, CHUNK, BLOCK)
    states.register(caches, engine)  # type: ignore[arg-type]
    return states


def _fill(caches: dict[str, object], block: int, value: int) -> None:
    for cache in caches.values():
        for t in cache if isinstance(cache, tuple) else (cache,):
            t[block].fill_(value)


def _block(caches: dict[str, object], block: int) -> list[torch.Tensor]:
    return [
        t[block].clone()
        for cache in caches.values()
        for t in (cache if isinstance(cache, tuple) else (cache,))
    ]


def _query(tokens: list[int], salt: str = "") -> LookupQuery:
    return LookupQuery("r", tokens, salt)


def _req(tokens: list[int], n: int, blocks: dict[int, list[int]], salt: str = "") -> ReqMeta:
    per_group = [blocks.get(i, []) for i in range(3)]
    return ReqMeta(
        "r", tokens, per_group[0], salt, load=LoadSpec(0, n, n), group_block_ids=per_group
    )


def _saved(caches: dict[str, object], states: MambaStates, boundaries: list[int]) -> None:
    """Each boundary's state in blocks ``boundary // BLOCK`` (values = boundary), offered."""
    offered = []
    for b in boundaries:
        _fill(caches, b // BLOCK, b % 100)
        offered += [(0, b // BLOCK, b), (2, b // BLOCK, b)]
    states.save([StateSaves("w", PROMPT[: max(boundaries)], "", {}, offered)])


def test_a_saved_state_is_loaded_into_the_block_vllm_allocated():
    src, dst = _caches(), _caches()
    saver = _states(src)
    _saved(src, saver, [16, 32, 48])
    want = _block(src, 32 // BLOCK)
    loader = _states(dst, saver._engine.tier)  # another engine of the same model, one tier
    assert loader.hit(_query(PROMPT[:40]), 64) == 32  # below the last prompt token
    assert loader.hit(_query(PROMPT), 40) == 32  # the attention streams' hit caps it
    assert loader.hit(_query(PROMPT), 64) == 48
    col = (48 - 1) // BLOCK  # vLLM's block for the state after 48 tokens
    assert loader.load(_req(PROMPT, 48, {0: [0] * col + [9], 2: [0] * col + [10]})) == ""
    got = _block(dst, 9)[:1] + _block(dst, 10)[1:]
    assert all(torch.equal(a, b) for a, b in zip(got, _block(src, 48 // BLOCK), strict=True))
    assert loader.hit(_query(PROMPT[:47]), 64) == 32
    assert loader.load(_req(PROMPT, 32, {0: [0, 0, 0, 3], 2: [0, 0, 0, 4]})) == ""
    assert torch.equal(_block(dst, 3)[0], want[0]) and torch.equal(_block(dst, 4)[1], want[1])


def test_keys_tell_prompts_salts_and_boundaries_apart():
    caches = _caches()
    states = _states(caches)
    _saved(caches, states, [32])
    assert states.hit(_query(PROMPT), 64) == 32
    assert states.hit(_query(PROMPT, salt="tenant-b"), 64) == 0
    other = [*PROMPT[:31], 7, *PROMPT[32:]]  # the 32nd token differs
    assert states.hit(_query(other), 64) == 0
    assert states.hit(_query(PROMPT[:32] + [1] * 20), 64) == 32  # what follows does not matter


def test_a_group_without_its_state_is_no_hit():
    caches = _caches()
    states = _states(caches)
    _fill(caches, 4, 1)
    states.save([StateSaves("w", PROMPT[:48], "", {}, [(0, 4, 32), (0, 6, 48), (2, 6, 48)])])
    assert states.hit(_query(PROMPT), 64) == 48
    assert states.hit(_query(PROMPT), 47) == 0  # group 2 has no state after 32 tokens


def test_a_damaged_state_is_refused_at_lookup_and_at_load():
    caches = _caches()
    states = _states(caches)
    _saved(caches, states, [16, 32])
    tier = states._engine.tier
    assert states.hit(_query(PROMPT), 64) == 32
    for entry in list(tier._entries.values()):  # damaged after the lookup
        entry.lease.tensor[0] ^= 1
    why = states.load(_req(PROMPT, 32, {0: [0, 5], 2: [0, 6]}))
    assert "missing or damaged" in why
    assert states.hit(_query(PROMPT), 64) == 0  # and no hit afterwards


def test_a_state_without_a_block_fails_the_load():
    caches = _caches()
    states = _states(caches)
    _saved(caches, states, [32])
    assert states.hit(_query(PROMPT), 64) == 32
    assert "group 0: no block" in states.load(_req(PROMPT, 32, {0: [0] * 4, 2: [0, 0, 0, 6]}))
    assert "group 2: no block" in states.load(_req(PROMPT, 32, {0: [0, 0, 0, 5], 2: [0]}))
    assert "cannot be loaded" in states.load(_req(PROMPT, 24, {0: [0, 5], 2: [0, 6]}))


def test_leases_are_released_and_clear_drops_only_states():
    caches = _caches()
    states = _states(caches)
    _saved(caches, states, [32])
    tier = states._engine.tier
    (entry, *_) = tier._entries.values()
    assert states.hit(_query(PROMPT), 64) == 32 and entry.lease.ref_count == 2
    states.release(["r"])
    assert entry.lease.ref_count == 1
    assert states.hit(_query(PROMPT), 64) == 32
    states.close()
    assert entry.lease.ref_count == 1
    states.clear()
    assert len(tier) == 0


def test_states_that_cannot_be_read_as_bytes_turn_hits_off(caplog):
    caches = _caches()
    caches["m0"] = torch.zeros(40, NUM_BLOCKS).t()  # a block's state is strided
    states = _states(caches)
    states.save([StateSaves("w", PROMPT[:32], "", {}, [(0, 4, 32), (2, 4, 32)])])
    assert states.hit(_query(PROMPT), 64) == 0
    assert "not contiguous" in caplog.text


@pytest.mark.parametrize("boundary", [0, 12, 72])
def test_offers_off_the_grid_or_beyond_the_tokens_are_not_stored(boundary):
    caches = _caches()
    states = _states(caches)
    states.save([StateSaves("w", PROMPT[:boundary], "", {}, [(0, 1, boundary), (2, 1, boundary)])])
    assert len(states._engine.tier) == 0
