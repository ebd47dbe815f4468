# SPDX-License-Identifier: Apache-2.0
"""How far a chain of chunk keys is present in a tier, asked in as few queries as pay off."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["present_prefix"]


def present_prefix(
    keys: Sequence[bytes], missing: Callable[[list[bytes]], list[int]], at_once: bool = False
) -> int:
    """How many leading ``keys`` are present, asking ``missing`` (positions of the absent ones
    in a run of keys, e.g. :meth:`lmcache.tiers.CPUTier.missing`: one lock per call) about
    runs of 1, 2, 4, ... keys up to the first absent one.

    A lazy :class:`KeyChain` is hashed a run at a time: at most about twice as far as the
    present prefix goes. A bad token id of a list in a run is read only if the answer needs
    it: that run is then asked key by key.

    ``at_once``: ask about every key in one call, for a ``missing`` that is a round trip to
    another process (the node cache), where a call costs more than hashing the whole chain.
    A bad token id anywhere then falls back to the runs.
    """
    if at_once:
        try:
            batch = list(keys)
        except (TypeError, ValueError):
            batch = None
        if batch is not None:
            absent = missing(batch)
            return absent[0] if absent else len(batch)
    found, run, total = 0, 1, len(keys)
    while found < total:
        try:
            batch = list(keys[found : found + run])
        except (TypeError, ValueError):  # a bad token id in the run: raise only if it counts
            while found < total and not missing([keys[found]]):
                found += 1
            return found
        absent = missing(batch)
        if absent:
            return found + absent[0]
        found, run = found + len(batch), run * 2
    return found
