# SPDX-License-Identifier: Apache-2.0
"""Lookup protocol: real Unix sockets, permissions, min over ranks, failures are misses."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
import time

import pytest

from lmcache_vllm.lookup import (
    MAX_SALT_BYTES,
    LookupClient,
    LookupServer,
    decode_request,
    encode_clear,
    encode_lookup,
    socket_path,
)


def prefix_lookup(stored: list[int]):
    """A fake cache holding ``stored``: hit = common prefix length, rounded to 4 tokens."""

    def lookup(tokens: list[int], salt: str) -> int:
        if salt == "other-tenant":
            return 0
        n = 0
        for a, b in zip(tokens, stored, strict=False):
            if a != b:
                break
            n += 1
        return n // 4 * 4

    return lookup


@pytest.fixture
def base(tmp_path):
    return tmp_path


def test_encode_decode_round_trip():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(encode_lookup([0, 1, 2**32 - 1, 7], "tenant-é"))
        assert decode_request(b) == ("tenant-é", [0, 1, 2**32 - 1, 7])
        a.sendall(encode_clear())
        assert decode_request(b) is None
        a.sendall(encode_lookup([], ""))
        assert decode_request(b) == ("", [])


def test_wire_format_is_little_endian_struct():
    data = encode_lookup([1, 258], "ab")
    assert data == struct.pack("<I", 2) + b"ab" + struct.pack("<I", 2) + struct.pack("<2I", 1, 258)


def test_oversized_salt_is_rejected():
    with pytest.raises(ValueError, match="cache salt"):
        encode_lookup([1], "x" * (MAX_SALT_BYTES + 1))


def test_round_trip_min_over_ranks_and_clear(base):
    stored = list(range(100, 140))
    cleared = []
    s0 = LookupServer("eng", 0, prefix_lookup(stored), lambda: cleared.append(0), base=base)
    s1 = LookupServer("eng", 1, prefix_lookup(stored[:20]), lambda: cleared.append(1), base=base)
    client = LookupClient("eng", 2, base=base)
    try:
        assert client.lookup(stored) == 20  # rank 1 holds less: the minimum wins
        assert client.lookup(stored[:9]) == 8
        assert client.lookup([1, 2, 3]) == 0
        assert client.lookup(stored, "other-tenant") == 0
        assert client.clear() is True
        assert sorted(cleared) == [0, 1]
        for server in (s0, s1):
            assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(s0.path.parent).st_mode) == 0o700
    finally:
        client.close()
        s0.close()
        s1.close()
    assert not s0.path.exists()


def test_unreachable_rank_is_a_miss(base):
    s0 = LookupServer("eng2", 0, prefix_lookup(list(range(64))), lambda: None, base=base)
    client = LookupClient("eng2", 2, base=base, first_wait_s=0.1)  # rank 1 never starts
    try:
        assert client.lookup(list(range(64))) == 0
        assert client.clear() is False
    finally:
        client.close()
        s0.close()


def test_slow_rank_is_a_miss_and_the_client_recovers(base):
    slow = threading.Event()

    def lookup(tokens, salt):
        if slow.is_set():
            time.sleep(1.0)
        return len(tokens)

    server = LookupServer("eng3", 0, lookup, lambda: None, base=base)
    client = LookupClient("eng3", 1, base=base, timeout_s=0.2)
    try:
        assert client.lookup([1, 2, 3]) == 3
        slow.set()
        assert client.lookup([1, 2, 3]) == 0
        slow.clear()
        assert client.lookup([1, 2, 3, 4]) == 4  # reconnects after dropping the late reply
    finally:
        client.close()
        server.close()


def test_failing_lookup_is_a_miss(base):
    def boom(tokens, salt):
        raise RuntimeError("tier exploded")

    server = LookupServer("eng4", 0, boom, lambda: None, base=base)
    client = LookupClient("eng4", 1, base=base)
    try:
        assert client.lookup([1, 2]) == 0
    finally:
        client.close()
        server.close()


def test_client_waits_for_a_late_server(base):
    client = LookupClient("eng5", 1, base=base, first_wait_s=5.0)
    holder = []
    timer = threading.Timer(
        0.3, lambda: holder.append(LookupServer("eng5", 0, lambda t, s: 7, lambda: None, base=base))
    )
    timer.start()
    try:
        assert client.lookup([1]) == 7
    finally:
        timer.join()
        client.close()
        for server in holder:
            server.close()


def test_garbage_request_closes_only_that_connection(base):
    server = LookupServer("eng6", 0, lambda t, s: len(t), lambda: None, base=base)
    try:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(str(server.path))
        raw.sendall(struct.pack("<I", MAX_SALT_BYTES + 10))
        raw.settimeout(2)
        assert raw.recv(8) == b""  # closed, no reply
        raw.close()
        client = LookupClient("eng6", 1, base=base)
        assert client.lookup([5, 6]) == 2
        client.close()
    finally:
        server.close()


def test_socket_path_is_short_and_per_engine(base):
    p = socket_path("x" * 500, 3, base=base)
    assert p.name == "rank3.sock"
    assert len(p.name) + len(p.parent.name) < 60
    assert socket_path("a", 0, base=base) != socket_path("b", 0, base=base)


def test_foreign_folder_is_refused(base):
    folder = socket_path("eng7", 0, base=base).parent
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.write_text("not a folder")
    with pytest.raises((PermissionError, FileExistsError)):
        LookupServer("eng7", 0, lambda t, s: 0, lambda: None, base=base)
