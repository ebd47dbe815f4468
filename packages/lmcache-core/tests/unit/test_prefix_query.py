# SPDX-License-Identifier: Apache-2.0
"""present_prefix: how far a key chain is present, in runs or in one query (the node cache)."""

from __future__ import annotations

import pytest

from lmcache.keys import KeyChain, chunk_keys
from lmcache.tiers.prefix_query import present_prefix

CHUNK = 4


class Tier:
    """A tier's ``missing`` over a set of keys, counting its calls."""

    def __init__(self, keys: list[bytes]) -> None:
        self.held = set(keys)
        self.calls: list[int] = []

    def missing(self, run: list[bytes]) -> list[int]:
        self.calls.append(len(run))
        return [i for i, k in enumerate(run) if k not in self.held]


@pytest.mark.parametrize("held", [0, 1, 5, 16, 32])
def test_runs_and_one_query_agree(held: int) -> None:
    tokens = list(range(32 * CHUNK))
    keys = chunk_keys(tokens, b"fp", CHUNK)
    tier = Tier(keys[:held])
    in_runs = present_prefix(keys, tier.missing)
    runs = list(tier.calls)
    tier.calls.clear()
    at_once = present_prefix(KeyChain(tokens, b"fp", CHUNK), tier.missing, at_once=True)
    assert in_runs == at_once == held
    assert tier.calls == [32]  # one query for the whole chain
    assert len(runs) > 1 or held == 0  # runs of 1, 2, 4, ... up to the first miss


def test_one_query_falls_back_to_runs_on_a_bad_token_past_the_prefix() -> None:
    good = list(range(8 * CHUNK))
    tokens = good + [-1] * CHUNK  # the last chunk's ids cannot be hashed
    tier = Tier(chunk_keys(good, b"fp", CHUNK)[:3])
    assert present_prefix(KeyChain(tokens, b"fp", CHUNK), tier.missing, at_once=True) == 3
    assert 9 not in tier.calls  # the whole chain was never asked about


def test_one_query_raises_for_a_bad_token_the_answer_needs() -> None:
    tokens = [-1] * CHUNK + list(range(4 * CHUNK))
    with pytest.raises((TypeError, ValueError)):
        present_prefix(KeyChain(tokens, b"fp", CHUNK), Tier([]).missing, at_once=True)
