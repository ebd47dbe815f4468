# SPDX-License-Identifier: Apache-2.0
"""A lookup asked again names the lookup sent before (``OP_AGAIN``: request id and frame digest)
instead of sending every token id again; a server that does not remember it answers
``UNKNOWN`` and gets it whole. Answers, leases and callbacks are as for whole lookups."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

from lmcache_vllm.lookup_wire import (
    OP_AGAIN,
    OP_LOOKUP,
    REPLY,
    UNKNOWN,
    Again,
    LookupQuery,
    decode_request,
    encode_again,
    encode_lookup,
    lookup_digest,
)
from lmcache_vllm.scheduler.lookup_client import LookupClient
from lmcache_vllm.scheduler.prefix_lookups import PrefixLookups
from lmcache_vllm.scheduler.sent_lookups import SentLookups
from lmcache_vllm.worker import lookup_server
from lmcache_vllm.worker.lookup_server import LookupServer


@pytest.fixture
def base() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="lmc-again-") as folder:
        yield Path(folder)


@pytest.fixture
def ops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The op of every request the servers decode, in order."""
    seen: list[int] = []
    decode = lookup_server.decode_request_body

    def recording(sock: socket.socket, op: int) -> object:
        seen.append(op)
        return decode(sock, op)

    monkeypatch.setattr(lookup_server, "decode_request_body", recording)
    return seen


class Rig:
    def __init__(self, base: Path, lookup: Callable[[LookupQuery], int]) -> None:
        self.base = base
        self.lookup = lookup
        self.seen: list[LookupQuery] = []
        self.server = self.start()
        self.client = LookupClient("again", 1, base=base, in_process=False)

    def start(self) -> LookupServer:
        def lookup(query: LookupQuery) -> int:
            self.seen.append(query)
            return self.lookup(query)

        return LookupServer("again", 0, lookup, lambda: None, base=self.base)

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.fixture
def rig(base: Path) -> Iterator[Rig]:
    r = Rig(base, lambda query: len(query.tokens) // 4 * 4)
    yield r
    r.close()


def test_digest_of_a_decoded_lookup_is_that_of_its_frame():
    for tokens in ([], [7], list(range(1000, 1531)), np.arange(300, dtype=np.int64)):
        query = LookupQuery("cmpl-é", tokens, "salt-é", {0: b"\x01", 2: b"m" * 64})
        frame = encode_lookup(query)
        a, b = socket.socketpair()
        with a, b:
            a.sendall(frame)
            decoded = decode_request(b)
        assert isinstance(decoded, LookupQuery)
        want = xxhash.xxh3_128_digest(frame)
        assert lookup_digest(decoded) == lookup_digest(query) == lookup_digest(query, frame) == want


def test_again_round_trips_and_checks_its_fields():
    digest = bytes(range(16))
    a, b = socket.socketpair()
    with a, b:
        a.sendall(encode_again("r-é", digest))
        assert decode_request(b) == Again("r-é", digest)
    assert encode_again("r", digest)[0] == OP_AGAIN
    with pytest.raises(ValueError, match="digest is 15 bytes"):
        encode_again("r", digest[:15])
    with pytest.raises(ValueError, match="request id"):
        encode_again("x" * 300, digest)


def test_asked_again_sends_a_few_bytes_and_gets_the_same_answer(rig, ops):
    tokens = list(range(5000, 5103))
    query = LookupQuery("r1", tokens, "s", {1: b"mm"})
    assert rig.client.lookup(query) == 100
    assert rig.client.lookup(query) == 100
    again = LookupQuery("r1", tokens, "s", {1: b"mm"})  # a new query of the same lookup
    assert rig.client.lookup(again) == 100
    assert ops == [OP_LOOKUP, OP_AGAIN, OP_AGAIN]
    # the worker's lookup runs every time, on a query equal to the one sent whole
    assert len(rig.seen) == 3 and all(seen == query for seen in rig.seen)
    assert rig.client.failures == 0


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda t: (list(t), "s", {}), id="an equal new token list"),
        pytest.param(lambda t: (t[:-1], "s", {}), id="fewer tokens"),
        pytest.param(lambda t: (t, "other-salt", {}), id="another salt"),
        pytest.param(lambda t: (t, "s", {0: b"img"}), id="other extra keys"),
    ],
)
def test_any_other_lookup_of_the_request_is_sent_whole(rig, ops, change):
    tokens = list(range(40))
    assert rig.client.lookup(LookupQuery("r1", tokens, "s")) == 40
    new_tokens, salt, extra = change(tokens)
    query = LookupQuery("r1", new_tokens, salt, extra)
    assert rig.client.lookup(query) == len(new_tokens) // 4 * 4
    assert ops == [OP_LOOKUP, OP_LOOKUP]
    assert rig.seen[-1] == query


def test_a_server_that_does_not_remember_gets_it_whole(rig, ops):
    tokens = list(range(64))
    query = LookupQuery("r1", tokens)
    assert rig.client.lookup(query) == 64
    rig.server.close()
    rig.server = rig.start()  # restarted: it remembers nothing
    assert rig.client.lookup(query) == 64
    assert ops == [OP_LOOKUP, OP_AGAIN, OP_LOOKUP]
    assert rig.seen[-1] == query and rig.client.failures == 0
    assert rig.client.lookup(query) == 64  # remembered again
    assert ops[-1] == OP_AGAIN


def test_the_server_answers_unknown_for_a_digest_it_does_not_hold(rig):
    tokens = list(range(32))
    frame = encode_lookup(LookupQuery("r1", tokens))
    other = encode_lookup(LookupQuery("r1", [*tokens[:-1], 99]))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with conn:
        conn.connect(str(rig.server.path))

        def ask(payload: bytes) -> int:
            conn.sendall(payload)
            got = b""
            while len(got) < REPLY.size:
                got += conn.recv(REPLY.size - len(got))
            return int(REPLY.unpack(got)[0])

        assert ask(encode_again("r1", xxhash.xxh3_128_digest(frame))) == UNKNOWN
        assert ask(frame) == 32
        assert ask(encode_again("r1", xxhash.xxh3_128_digest(frame))) == 32
        assert ask(encode_again("r2", xxhash.xxh3_128_digest(frame))) == UNKNOWN
        assert ask(encode_again("r1", xxhash.xxh3_128_digest(other))) == UNKNOWN
        assert ask(other) == 32  # the newest lookup of r1 replaces the one before
        assert ask(encode_again("r1", xxhash.xxh3_128_digest(frame))) == UNKNOWN
        assert ask(encode_again("r1", xxhash.xxh3_128_digest(other))) == 32
    assert len(rig.seen) == 4


def test_the_server_remembers_a_bounded_number_of_lookups(rig, monkeypatch, ops):
    monkeypatch.setattr(lookup_server, "REMEMBERED_LOOKUPS", 2)
    queries = [LookupQuery(f"r{i}", list(range(8))) for i in range(3)]
    for query in queries:
        assert rig.client.lookup(query) == 8
    for query in reversed(queries):  # the server forgot r0, the oldest: it asks for it whole
        assert rig.client.lookup(query) == 8
    assert ops == [OP_LOOKUP] * 3 + [OP_AGAIN, OP_AGAIN, OP_AGAIN, OP_LOOKUP]


def test_forgetting_a_request_sends_its_next_lookup_whole(rig, ops):
    lookups = PrefixLookups("again", 1, asynchronous=False)
    lookups.client = rig.client
    tokens = list(range(12))
    assert lookups.ask("r1", lambda: LookupQuery("r1", tokens)) == 12
    lookups.forget("r1")  # the request ended
    assert lookups.ask("r1", lambda: LookupQuery("r1", tokens)) == 12
    assert ops == [OP_LOOKUP, OP_LOOKUP]
    lookups.client = None  # closed by the rig


def test_sent_lookups_are_bounded_and_forgettable():
    sent = SentLookups(capacity=2)
    tokens = [1, 2, 3]
    queries = [LookupQuery(f"r{i}", tokens) for i in range(3)]
    for query in queries:
        frame, whole = sent.payload(query)
        assert frame == encode_lookup(query) and whole is None
    assert len(sent) == 2 and sent.again(queries[0]) is None
    frame, whole = sent.payload(queries[2])
    assert frame[0] == OP_AGAIN and whole is not None and whole() == encode_lookup(queries[2])
    sent.forget("r2")
    assert sent.again(queries[2]) is None


def test_a_server_that_cannot_read_again_costs_one_miss(rig, ops, monkeypatch):
    """A server of an older version closes the connection on op 3: that lookup is a miss, and
    the next one of the request is sent whole."""
    decode = lookup_server.decode_request_body

    def old(sock: socket.socket, op: int) -> object:
        if op == OP_AGAIN:
            raise ValueError(f"unknown op {op}")
        return decode(sock, op)

    monkeypatch.setattr(lookup_server, "decode_request_body", old)
    query = LookupQuery("r1", list(range(16)))
    assert rig.client.lookup(query) == 16
    assert rig.client.lookup(query) == 0  # closed without an answer: a counted miss
    assert rig.client.failures == 1
    assert rig.client.lookup(query) == 16
