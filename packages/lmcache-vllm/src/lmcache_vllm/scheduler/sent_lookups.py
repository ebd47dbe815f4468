# SPDX-License-Identifier: Apache-2.0
"""What the scheduler's lookup client sent whole, so that it can ask again in a few bytes.

vLLM asks a waiting request's lookup again at every scheduler step until the request is
scheduled. Over the sockets a lookup carries 4 bytes per prompt token (128 KiB for 32k tokens),
and packing them costs more than the worker's answer, which reuses the lease it holds. So the
client remembers the lookups it sent whole (request id, token list, salt, extra keys and the
frame's digest). When the same lookup comes again, it sends an
:data:`~lmcache_vllm.lookup_wire.OP_AGAIN` naming it: request id and digest. A server that does
not remember it answers :data:`~lmcache_vllm.lookup_wire.UNKNOWN`, and the client sends it whole.

"The same lookup" means the same token list object, of the same length, with an equal salt and
equal extra keys. vLLM never changes a request's prompt token ids, and the worker's lease reuse
already takes a request's lookups for the same prompt (``LookupLeases.reuse``). A new list, even
with equal ids, is sent whole.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmcache_vllm.lookup_wire import LookupQuery, encode_again, encode_lookup, lookup_digest

__all__ = ["SENT_LOOKUPS", "SentLookups"]

SENT_LOOKUPS = 1024
"""Most lookups remembered (the newest); each holds a reference to its token list."""


class _Sent:
    __slots__ = ("again", "extra_keys", "n", "salt", "tokens")

    def __init__(self, query: LookupQuery, again: bytes) -> None:
        self.tokens: Sequence[int] | Any = query.tokens
        self.n = len(query.tokens)
        self.salt = query.salt
        self.extra_keys: Mapping[int, bytes] = dict(query.extra_keys)
        self.again = again


class SentLookups:
    """Lookups sent whole, by request id (thread-safe; see the module docstring)."""

    def __init__(self, capacity: int = SENT_LOOKUPS) -> None:
        self._capacity = capacity
        self._by_id: OrderedDict[str, _Sent] = OrderedDict()
        self._lock = threading.Lock()

    def payload(self, query: LookupQuery) -> tuple[bytes, Callable[[], bytes] | None]:
        """What to send for ``query``: its :data:`~lmcache_vllm.lookup_wire.OP_AGAIN` frame
        when it was sent whole before, with a function that frames it whole (once, for every
        rank that does not remember it); else its whole frame, remembered, and ``None``.

        Raises:
            ValueError: As :func:`~lmcache_vllm.lookup_wire.encode_lookup`.
        """
        again = self.again(query)
        if again is None:
            frame = encode_lookup(query)
            self.sent(query, frame)
            return frame, None
        framed: list[bytes] = []

        def whole() -> bytes:
            if not framed:
                framed.append(encode_lookup(query))
            return framed[0]

        return again, whole

    def again(self, query: LookupQuery) -> bytes | None:
        """The :data:`~lmcache_vllm.lookup_wire.OP_AGAIN` frame of ``query`` when the same
        lookup was sent whole before, else ``None``."""
        with self._lock:
            sent = self._by_id.get(query.req_id)
            if sent is not None:
                self._by_id.move_to_end(query.req_id)
        if (
            sent is None
            or sent.tokens is not query.tokens
            or sent.n != len(query.tokens)
            or sent.salt != query.salt
            or sent.extra_keys != query.extra_keys
        ):
            return None
        return sent.again

    def sent(self, query: LookupQuery, frame: bytes) -> None:
        """Remember ``query``, just sent whole as ``frame`` (its :func:`encode_lookup`)."""
        again = encode_again(query.req_id, lookup_digest(query, frame))
        with self._lock:
            self._by_id.pop(query.req_id, None)
            self._by_id[query.req_id] = _Sent(query, again)
            while len(self._by_id) > self._capacity:
                self._by_id.popitem(last=False)

    def forget(self, req_id: str) -> None:
        """Forget ``req_id``'s lookup: its next one is sent whole."""
        with self._lock:
            self._by_id.pop(req_id, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)
