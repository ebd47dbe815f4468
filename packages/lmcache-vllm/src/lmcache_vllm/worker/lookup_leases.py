# SPDX-License-Identifier: Apache-2.0
"""Chunks leased at lookup time, held per request until its load (or its end).

When the scheduler promises vLLM N matched tokens, the chunks behind them must still be there
when the worker loads them. A failed load is not a safe fallback: vLLM's default
``kv_load_failure_policy`` fails the request, and ``"recompute"`` is unreliable on some model
runners. So each rank's lookup takes verified leases on the chunks it found
(:meth:`LMCacheEngine.lookup_and_lease`) and parks them here under the request id. A leased
chunk is never evicted. The load uses the leases and releases them. So do the request's end, a
newer lookup of the same request, and a timeout for requests that vanished (counted).

A lookup may still be running when its request ends, e.g. aborted while its lookup reads a slow
disk. :meth:`LookupLeases.finish` remembers ended requests for a while, so a lease put for one
of them later is released at once. vLLM makes every request id unique, so an id never returns.

A hit also keeps what its chunk keys were computed for (:class:`LookedUp`: token ids, salt,
extra keys). The load reuses the keys of the leading chunks whose tokens, salt and extra keys it
finds equal (:meth:`LookedUp.keys_for`), and hashes the rest again. Keys never leave the worker
process that computed them, since they depend on its rank's fingerprint.

Comparing token ids costs about as much as hashing them, unless both lists share their int
objects. That is the case when the scheduler and the worker share a process (vLLM's
single-worker engine core, also in its default multiprocess mode): comparing is then a pointer
walk, about a third of hashing again (``benchmarks/lookup.py``). When the metadata was pickled to
the worker, or the lookup came over a socket, the load hashes its tokens again.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from lmcache.cache_engine import HeldHit

__all__ = ["LookupLeases", "LookedUp"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LookedUp:
    """What a held hit's keys were computed for: the lookup's token ids, salt and extra keys.

    Attributes:
        tokens: The lookup's token ids (the request's prompt), a snapshot (see :meth:`of`).
        salt: The request's key salt.
        extra_keys: Chunk index -> extra key material of the lookup.
    """

    tokens: Sequence[int] | npt.NDArray[Any]
    salt: str
    extra_keys: Mapping[int, bytes] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        tokens: Sequence[int] | npt.NDArray[Any],
        salt: str,
        extra_keys: Mapping[int, bytes] | None,
    ) -> LookedUp:
        """What a lookup of ``tokens`` made its keys for, with a snapshot of the tokens: a
        read-only array (a decoded query's) as it is, anything else copied to a list (a
        pointer copy; the int objects are shared, so comparing with the prompt they came from
        stays a pointer comparison)."""
        if not (isinstance(tokens, np.ndarray) and not tokens.flags.writeable):
            tokens = list(tokens) if not isinstance(tokens, np.ndarray) else tokens.copy()
        return cls(tokens, salt, dict(extra_keys or {}))

    def keys_for(
        self,
        hit: HeldHit,
        tokens: Sequence[int],
        salt: str,
        extra_keys: Mapping[int, bytes] | None,
        chunk_size: int,
    ) -> list[bytes]:
        """The keys of ``hit`` that are also the leading chunk keys of ``tokens`` with ``salt``
        and ``extra_keys`` (a load's), or ``[]``.

        A key is reused only when its chunk covers the same token range in both requests, and
        the salt, the extra keys of those chunks and every token through the last reused chunk
        are equal; otherwise the load hashes its tokens again (a wrong key would load another
        prompt's KV). Never raises: anything unexpected means no reuse.
        """
        try:
            return self._keys_for(hit, tokens, salt, extra_keys, chunk_size)
        except Exception:  # e.g. a malformed request: the load hashes (and checks) it itself
            logger.debug("lmcache: not reusing a lookup's keys", exc_info=True)
            return []

    def _keys_for(
        self,
        hit: HeldHit,
        tokens: Sequence[int],
        salt: str,
        extra_keys: Mapping[int, bytes] | None,
        chunk_size: int,
    ) -> list[bytes]:
        if salt != self.salt or not hit.keys or len(tokens) == 0:
            return []
        n = len(tokens)
        count = min(len(hit.keys), -(-n // chunk_size))
        # a partial last chunk is the same chunk only if both requests end at the same token
        if min(count * chunk_size, n) != min(count * chunk_size, len(self.tokens)):
            count -= 1
        if count <= 0:
            return []
        mine = {i: e for i, e in self.extra_keys.items() if i < count}
        theirs = {i: e for i, e in (extra_keys or {}).items() if i < count}
        m = min(count * chunk_size, n)
        if mine != theirs or not _cheap_to_compare(self.tokens, tokens, m):
            return []
        return hit.keys[:count] if _same_leading(self.tokens, tokens, m) else []


def _cheap_to_compare(
    a: Sequence[int] | npt.NDArray[Any], b: Sequence[int] | npt.NDArray[Any], m: int
) -> bool:
    """Whether comparing the first ``m`` ids of ``a`` and ``b`` costs clearly less than hashing
    them: two arrays, or two lists whose sampled ids are the same int objects (slices of one
    prompt list). A list against an array, or lists of separately made ints (unpickled), cost
    about what hashing costs: the caller hashes instead."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return True
    if not (isinstance(a, list) and isinstance(b, list)) or len(a) < m or len(b) < m:
        return False
    return all(a[i] is b[i] for i in {0, m // 3, m // 2, 2 * m // 3, m - 1} if i < m)


def _same_leading(
    a: Sequence[int] | npt.NDArray[Any], b: Sequence[int] | npt.NDArray[Any], m: int
) -> bool:
    """Whether the first ``m`` token ids of ``a`` and ``b`` are equal (both hold ``m``)."""
    if len(a) < m or len(b) < m:
        return False
    if a is b:
        return True
    x = a if len(a) == m else a[:m]
    y = b if len(b) == m else b[:m]
    if isinstance(x, list) and isinstance(y, list):
        return x == y  # C loop; equal int objects (one prompt list's) compare by identity
    try:
        return bool(np.array_equal(_int64(x), _int64(y)))
    except (OverflowError, TypeError, ValueError):
        return False  # not all ints (or beyond int64): not the ids any key was made from


def _int64(tokens: Sequence[int] | npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    """Token ids as int64 values (a list by one C loop, not numpy's per-object conversion)."""
    if isinstance(tokens, np.ndarray):
        if tokens.dtype.kind not in "iu" or (tokens.dtype.kind == "u" and tokens.itemsize > 4):
            raise TypeError(f"token ids of dtype {tokens.dtype}")
        return tokens.astype(np.int64, copy=False)
    return np.frombuffer(array("q", tokens), dtype=np.int64)


@dataclass
class _Held:
    hit: HeldHit
    num_query_tokens: int
    salt: str
    expires: float
    looked_up: LookedUp | None = None


class LookupLeases:
    """Leased lookup hits by request id (thread-safe: the lookup server thread puts, the
    worker's step pops).

    Args:
        timeout_s: A hit not taken within this many seconds of its last lookup is released.
        ended_s: How long an ended request is remembered (a lookup still in flight for it then
            releases its hit at once): longer than any lookup may run.
        ended_max: Most ended requests remembered (the oldest are forgotten first; a late hit
            of a forgotten one is released by the timeout).

    Attributes:
        expired: Hits released by the timeout since construction.
        late: Hits put for requests that had ended already (released at once) since
            construction.
    """

    def __init__(
        self, timeout_s: float = 120.0, ended_s: float = 600.0, ended_max: int = 65536
    ) -> None:
        self.timeout_s = timeout_s
        self.ended_s = ended_s
        self.ended_max = ended_max
        self._held: dict[str, _Held] = {}
        self._ended: OrderedDict[str, float] = OrderedDict()  # request id -> when it ended
        self._lock = threading.Lock()
        self.expired = 0
        self.late = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def reuse(self, req_id: str, num_query_tokens: int, salt: str) -> int | None:
        """The held hit's token count when ``req_id`` already holds one for the same query
        (vLLM asks again while a request waits), refreshing its timeout; else ``None``."""
        with self._lock:
            held = self._held.get(req_id)
            if held is None or held.num_query_tokens != num_query_tokens or held.salt != salt:
                return None
            held.expires = time.monotonic() + self.timeout_s
            return held.hit.num_tokens

    def put(
        self,
        req_id: str,
        hit: HeldHit,
        num_query_tokens: int,
        salt: str,
        looked_up: LookedUp | None = None,
    ) -> None:
        """Hold ``hit`` for ``req_id``, releasing what it held before (an empty hit, or one of a
        request that has ended already, is released at once); ``looked_up``: what its keys were
        computed for (:meth:`take` gives it back for the load to reuse them)."""
        new = None
        if hit.num_tokens > 0:
            expires = time.monotonic() + self.timeout_s
            new = _Held(hit, num_query_tokens, salt, expires, looked_up)
        with self._lock:
            ended = req_id in self._ended
            old = self._held.pop(req_id, None)
            if new is not None and not ended:
                self._held[req_id] = new
            elif ended:
                self.late += 1
        if new is None or ended:
            hit.release()
        if old is not None:
            old.hit.release()

    def has_ended(self, req_id: str) -> bool:
        """Whether ``req_id`` ended (:meth:`finish`) and is still remembered."""
        with self._lock:
            return req_id in self._ended

    def pop(self, req_id: str) -> HeldHit | None:
        """Take the hit held for ``req_id`` (the caller releases it)."""
        return self.take(req_id)[0]

    def take(self, req_id: str) -> tuple[HeldHit | None, LookedUp | None]:
        """Take the hit held for ``req_id`` and what its keys were computed for (``None``
        when not given to :meth:`put`); the caller releases the hit."""
        with self._lock:
            held = self._held.pop(req_id, None)
        return (None, None) if held is None else (held.hit, held.looked_up)

    def release(self, req_ids: Iterable[str]) -> None:
        """Release the hits of ``req_ids`` (those that hold one)."""
        for req_id in req_ids:
            hit = self.pop(req_id)
            if hit is not None:
                hit.release()

    def finish(self, req_ids: Iterable[str]) -> None:
        """Requests that ended (finished, aborted): release their hits, and remember them so a
        hit a lookup still in flight puts for one of them later is released at once."""
        now = time.monotonic()
        hits = []
        with self._lock:
            for req_id in req_ids:
                self._ended[req_id] = now
                self._ended.move_to_end(req_id)
                held = self._held.pop(req_id, None)
                if held is not None:
                    hits.append(held.hit)
            while self._ended and (
                len(self._ended) > self.ended_max
                or next(iter(self._ended.values())) < now - self.ended_s
            ):
                self._ended.popitem(last=False)
        for hit in hits:
            hit.release()

    def expire(self, now: float | None = None) -> int:
        """Release hits past their timeout; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [r for r, h in self._held.items() if h.expires <= now]
            hits = [self._held.pop(r).hit for r in gone]
        for hit in hits:
            hit.release()
        if hits:
            self.expired += len(hits)
            logger.info(
                "lmcache: released the leased chunks of %d request(s) not loaded within %.0f s "
                "of their lookup",
                len(hits),
                self.timeout_s,
            )
        return len(hits)

    def clear(self) -> None:
        """Release everything."""
        with self._lock:
            hits = [h.hit for h in self._held.values()]
            self._held.clear()
        for hit in hits:
            hit.release()
