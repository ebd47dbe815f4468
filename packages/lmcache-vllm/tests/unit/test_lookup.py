# SPDX-License-Identifier: Apache-2.0
"""Lookup protocol over real Unix sockets: framing, parallel ranks under one deadline,
failures are misses (never exceptions), socket ownership and permissions."""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmcache_vllm import lookup_sockets, lookup_wire
from lmcache_vllm.lookup_sockets import socket_dir, socket_path
from lmcache_vllm.lookup_wire import (
    MAX_EXTRA_KEYS,
    MAX_ID_BYTES,
    MAX_SALT_BYTES,
    MAX_TOKENS,
    LookupQuery,
    check_lookup,
    decode_request,
    encode_clear,
    encode_lookup,
)
from lmcache_vllm.scheduler import lookup_client
from lmcache_vllm.scheduler.lookup_client import LookupClient
from lmcache_vllm.worker import lookup_server
from lmcache_vllm.worker.lookup_server import LookupServer

# The client logs under lmcache_vllm.scheduler.lookup_client, the server under
# lmcache_vllm.worker.lookup_server: their common parent's level reaches both.
LOGGER = "lmcache_vllm"


def prefix_lookup(stored: list[int]) -> Callable[[LookupQuery], int]:
    """A fake cache holding ``stored``: hit = common prefix length, rounded down to 4 tokens."""

    def lookup(query: LookupQuery) -> int:
        if query.salt == "other-tenant":
            return 0
        n = 0
        for a, b in zip(query.tokens, stored, strict=False):
            if a != b:
                break
            n += 1
        return n // 4 * 4

    return lookup


def q(tokens: list[int], salt: str = "", req_id: str = "req-1") -> LookupQuery:
    return LookupQuery(req_id=req_id, tokens=tokens, salt=salt)


def closed_without_reply(raw: socket.socket) -> bool:
    """The server closed ``raw`` without answering (a reset when it left bytes unread)."""
    try:
        return raw.recv(8) == b""
    except ConnectionResetError:
        return True


class Harness:
    """Starts servers and clients under one folder and closes them all at the end."""

    def __init__(self, base: os.PathLike[str]) -> None:
        self.base = base
        self.closers: list[Callable[[], None]] = []

    def server(
        self,
        key: str,
        rank: int,
        lookup: Callable[[LookupQuery], int],
        clear: Callable[[], None] = lambda: None,
    ) -> LookupServer:
        server = LookupServer(key, rank, lookup, clear, base=self.base)
        self.closers.append(server.close)
        return server

    def client(
        self, key: str, world_size: int, timeout_s: float = 1.0, *, in_process: bool = False
    ) -> LookupClient:
        """A client; through the sockets unless ``in_process`` (these servers stand for
        workers in other processes)."""
        client = LookupClient(
            key, world_size, timeout_s=timeout_s, base=self.base, in_process=in_process
        )
        self.closers.append(client.close)
        return client


@pytest.fixture
def base() -> Iterator[Path]:
    """A private folder of our own: pytest's ``tmp_path`` root is pruned by any concurrent pytest
    run on the host (it keeps the 3 newest), which would pull the sockets from under a test."""
    with tempfile.TemporaryDirectory(prefix="lmc-lookup-") as folder:
        yield Path(folder)


@pytest.fixture
def h(base: Path) -> Iterator[Harness]:
    harness = Harness(base)
    yield harness
    for close in reversed(harness.closers):
        close()


# --- framing -------------------------------------------------------------------------------


def test_encode_decode_round_trip():
    query = LookupQuery(
        req_id="cmpl-é-7",
        tokens=[0, 1, 2**32 - 1, 7],
        salt="tenant-é",
        extra_keys={0: b"\x00", 3: b"m" * 64, 2**32 - 1: b"img-hash"},
    )
    a, b = socket.socketpair()
    with a, b:
        a.sendall(encode_lookup(query) + encode_clear() + encode_lookup(q([])))
        got = decode_request(b)
        assert got is not None
        assert (got.req_id, list(got.tokens), got.salt) == (query.req_id, query.tokens, query.salt)
        assert dict(got.extra_keys) == query.extra_keys
        assert decode_request(b) is None
        empty = decode_request(b)
        assert empty is not None and list(empty.tokens) == [] and empty.salt == ""


def test_wire_format_is_little_endian_struct():
    data = encode_lookup(LookupQuery(req_id="r", tokens=[1, 258], salt="ab", extra_keys={5: b"xy"}))
    assert data == (
        b"\x01"
        + struct.pack("<H", 1)
        + b"r"
        + struct.pack("<H", 2)
        + b"ab"
        + struct.pack("<H", 1)
        + struct.pack("<IB", 5, 2)
        + b"xy"
        + struct.pack("<I", 2)
        + struct.pack("<2I", 1, 258)
    )
    assert encode_clear() == b"\x02"


@pytest.mark.parametrize(
    ("query", "match"),
    [
        (LookupQuery("r", [1], salt="x" * (MAX_SALT_BYTES + 1)), "salt is 257 utf-8 bytes"),
        (LookupQuery("é" * (MAX_ID_BYTES // 2 + 1), [1]), "request id is 258 utf-8 bytes"),
        (LookupQuery("r", [1, -1]), r"token 1 is -1, expected a value in \[0, 2\*\*32\)"),
        (LookupQuery("r", [2**32]), r"token 0 is 4294967296"),
        (LookupQuery("r", [1, "2"]), "token 1 is a str"),  # type: ignore[list-item]
        (LookupQuery("r", range(MAX_TOKENS + 1)), "at most 4194304"),
        (LookupQuery("r", [1], extra_keys={0: b""}), "is 0 bytes; expected 1 to 64"),
        (LookupQuery("r", [1], extra_keys={0: b"x" * 65}), "is 65 bytes"),
        (LookupQuery("r", [1], extra_keys={-1: b"x"}), r"chunk index -1"),
        (LookupQuery("r", [1], extra_keys={0: "text"}), "expected bytes"),  # type: ignore[dict-item]
        (
            LookupQuery("r", [1], extra_keys=dict.fromkeys(range(MAX_EXTRA_KEYS + 1), b"k")),
            "4097 extra keys",
        ),
        (LookupQuery("\ud800", [1]), "not encodable as utf-8"),
    ],
)
def test_encode_rejects_what_breaks_a_limit(query, match):
    with pytest.raises(ValueError, match=match):
        encode_lookup(query)
    if "token " not in match:  # an in-process lookup checks every limit but token values
        with pytest.raises(ValueError, match=match):
            check_lookup(query)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\x07", r"unknown op 7; expected 1 \(lookup\), 2 \(clear\) or 3 \(lookup again\)"),
        (b"\x01" + struct.pack("<H", MAX_ID_BYTES + 1), "request id length 257 exceeds the limit"),
        (b"\x01\x00\x00" + struct.pack("<H", MAX_SALT_BYTES + 1), "salt length 257 exceeds"),
        (
            b"\x01\x00\x00\x00\x00" + struct.pack("<H", MAX_EXTRA_KEYS + 1),
            "4097 extra keys exceed the limit 4096",
        ),
        (
            b"\x01\x00\x00\x00\x00\x01\x00" + struct.pack("<IB", 0, 65),
            "extra key of chunk 0 is 65 bytes; expected 1 to 64",
        ),
        (
            b"\x01\x00\x00\x00\x00\x02\x00"
            + struct.pack("<IB", 4, 1)
            + b"a"
            + struct.pack("<IB", 4, 1),
            "chunk index 4 appears twice",
        ),
        (
            b"\x01\x00\x00\x00\x00\x00\x00" + struct.pack("<I", MAX_TOKENS + 1),
            "token count 4194305 exceeds the limit 4194304",
        ),
        (b"\x01\x02\x00\xff\xfe", r"request id is not utf-8 \(invalid start byte at byte 0\)"),
        (b"\x01\x00\x00\x02\x00a\xff", r"salt is not utf-8 \(invalid start byte at byte 1\)"),
    ],
)
def test_decode_rejects_malformed_requests(payload, match):
    a, b = socket.socketpair()
    with a, b:
        a.sendall(payload + b"\x00" * 16)
        with pytest.raises(ValueError, match=match) as info:
            decode_request(b)
    # lmcache's own ValueError, not Python's UnicodeDecodeError (a ValueError subclass) escaping
    assert type(info.value) is ValueError


def test_lookup_modules_pin_their_names():
    assert lookup_sockets.__all__ == [
        "LOG_EVERY_S",
        "LogThrottle",
        "engine_key",
        "socket_dir",
        "socket_path",
        "unsafe_folder",
    ]
    assert lookup_server.__all__ == ["LookupServer", "local_server"]
    assert lookup_client.__all__ == ["LookupClient"]
    for module in (lookup_sockets, lookup_server, lookup_client, lookup_wire):
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)
    # Both sides take the wire format from lookup_wire: one definition, no copies.
    assert lookup_client.LookupQuery is lookup_wire.LookupQuery
    assert lookup_server.LookupQuery is lookup_wire.LookupQuery


def test_decode_truncated_request_is_a_connection_error():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(encode_lookup(q([1, 2, 3]))[:-3])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError):
            decode_request(b)


def test_socket_path_is_short_and_per_engine_key(base):
    p = socket_path("x" * 500, 3, base=base)
    assert p.name == "rank3.sock"
    assert p.parent == socket_dir("x" * 500, base=base)
    assert p.parent.name.startswith(f"lmcache-vllm-{os.getuid()}-")
    assert len(p.name) + len(p.parent.name) < 60
    # one engine id, two engine instances: two folders
    assert socket_path("eng:inst-a", 0, base=base) != socket_path("eng:inst-b", 0, base=base)


# --- server and client ---------------------------------------------------------------------


def test_round_trip_reaches_the_callback_intact(h):
    seen: list[LookupQuery] = []

    def lookup(query: LookupQuery) -> int:
        seen.append(query)
        return 3

    h.server("k", 0, lookup)
    client = h.client("k", 1)
    query = LookupQuery(
        req_id="cmpl-42-0", tokens=[9, 8, 7, 6], salt="a1b2", extra_keys={1: b"mm", 7: b"\xff" * 64}
    )
    assert client.lookup(query) == 3
    assert len(seen) == 1
    got = seen[0]
    assert (got.req_id, list(got.tokens), got.salt) == ("cmpl-42-0", [9, 8, 7, 6], "a1b2")
    assert dict(got.extra_keys) == {1: b"mm", 7: b"\xff" * 64}
    assert client.failures == 0


def test_min_over_three_ranks_and_clear(h):
    stored = list(range(100, 140))
    cleared: list[int] = []
    for rank, held in enumerate((40, 20, 32)):
        h.server("k", rank, prefix_lookup(stored[:held]), lambda r=rank: cleared.append(r))
    client = h.client("k", 3)
    assert client.lookup(q(stored)) == 20  # rank 1 holds the least: the minimum wins
    assert client.lookup(q(stored[:9])) == 8
    assert client.lookup(q([1, 2, 3])) == 0
    assert client.lookup(q(stored, salt="other-tenant")) == 0
    assert client.clear() is True
    assert sorted(cleared) == [0, 1, 2]
    assert client.failures == 0


def test_socket_is_0600_in_a_0700_folder_and_close_removes_both(h):
    s0 = h.server("k", 0, lambda query: 0)
    s1 = h.server("k", 1, lambda query: 0)
    for server in (s0, s1):
        assert stat.S_ISSOCK(os.lstat(server.path).st_mode)
        assert stat.S_IMODE(os.lstat(server.path).st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(s0.path.parent).st_mode) == 0o700
    s0.close()
    assert not s0.path.exists() and s1.path.exists()  # the folder stays while rank 1 is in it
    s1.close()
    s1.close()  # idempotent
    assert not s1.path.parent.exists()


def test_ranks_are_asked_in_parallel_under_one_deadline(h):
    def slow(query: LookupQuery) -> int:
        time.sleep(0.4)
        return len(query.tokens)

    for rank in range(3):
        h.server("k", rank, slow)
    client = h.client("k", 3, timeout_s=1.0)
    start = time.monotonic()
    assert client.lookup(q([1, 2, 3, 4, 5])) == 5
    elapsed = time.monotonic() - start
    assert elapsed < 1.0, f"3 ranks x 0.4 s took {elapsed:.2f} s: asked one after another?"


def test_a_slow_rank_is_a_miss_within_the_deadline_and_the_client_recovers(h):
    slow = threading.Event()
    answered: list[str] = []

    def rank1(query: LookupQuery) -> int:
        if slow.is_set():
            time.sleep(3.0)
        answered.append(query.req_id)
        return len(query.tokens)

    h.server("k", 0, lambda query: len(query.tokens))
    h.server("k", 1, rank1)
    h.server("k", 2, lambda query: len(query.tokens))
    client = h.client("k", 3, timeout_s=0.5)
    assert client.lookup(q([1, 2, 3])) == 3
    slow.set()
    start = time.monotonic()
    assert client.lookup(q([1, 2, 3], req_id="slow")) == 0
    elapsed = time.monotonic() - start
    assert elapsed < 0.5 + 0.5, f"a 3 s rank held the lookup for {elapsed:.2f} s"
    assert client.failures == 1
    slow.clear()
    # the late reply to "slow" must not be read as this answer: the connection was dropped
    assert client.lookup(q([1, 2, 3, 4], req_id="after")) == 4
    assert client.failures == 1


def test_no_server_is_an_immediate_miss_then_a_late_server_is_found(h):
    client = h.client("late", 2, timeout_s=1.0)
    start = time.monotonic()
    assert client.lookup(q([1, 2, 3, 4])) == 0
    assert time.monotonic() - start < 0.2
    assert client.failures == 2
    assert client.clear() is False
    h.server("late", 0, lambda query: 4)
    assert client.lookup(q([1, 2, 3, 4])) == 0  # rank 1 still missing
    h.server("late", 1, lambda query: 4)
    assert client.lookup(q([1, 2, 3, 4])) == 4


def test_a_restarted_server_is_reconnected_to(h):
    first = h.server("k", 0, lambda query: 1)
    client = h.client("k", 1)
    assert client.lookup(q([5, 6])) == 1
    first.close()
    h.server("k", 0, lambda query: 2)
    assert client.lookup(q([5, 6])) == 2  # the dead connection is noticed before sending


def test_failures_are_logged_once_per_state_change(h, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    client = h.client("k", 1)
    for _ in range(5):
        assert client.lookup(q([1])) == 0
    assert client.failures == 5
    assert len([r for r in caplog.records if "rank 0" in r.getMessage()]) == 1
    caplog.clear()
    h.server("k", 0, lambda query: 1)
    for _ in range(3):
        assert client.lookup(q([1])) == 1
    assert [r.getMessage() for r in caplog.records if "rank 0" in r.getMessage()] == [
        f"lmcache lookup: rank 0 ({client.paths[0]}) answers again"
    ]


def test_bad_queries_are_logged_at_most_once_a_minute(h, caplog):
    h.server("k", 0, lambda query: 1)
    client = h.client("k", 1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(3):
            assert client.lookup(LookupQuery(f"bad-{i}", [-1])) == 0
    assert client.failures == 3
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "'bad-0'" in messages[0] and "token 0 is -1" in messages[0]


HOSTILE: dict[str, Callable[[], LookupQuery]] = {  # built per test: 10**7 tokens is 80 MB
    "salt-5000": lambda: LookupQuery("r", [1, 2], salt="s" * 5000),
    "id-1000": lambda: LookupQuery("r" * 1000, [1, 2]),
    "token-neg": lambda: LookupQuery("r", [1, -1]),
    "token-2**32": lambda: LookupQuery("r", [2**32]),
    "token-float": lambda: LookupQuery("r", [1.5]),  # type: ignore[list-item]
    "tokens-10**7": lambda: LookupQuery("r", [0] * 10**7),
    "extra-65-bytes": lambda: LookupQuery("r", [1], extra_keys={0: b"x" * 65}),
    "extra-5000-keys": lambda: LookupQuery("r", [1], extra_keys=dict.fromkeys(range(5000), b"k")),
    "extra-index-2**32": lambda: LookupQuery("r", [1], extra_keys={2**32: b"k"}),
    "id-surrogate": lambda: LookupQuery("\udcff", [1]),
    "tokens-None": lambda: LookupQuery("r", None),  # type: ignore[arg-type]
    "id-None": lambda: LookupQuery(None, [1]),  # type: ignore[arg-type]
    "salt-None": lambda: LookupQuery("r", [1], salt=None),  # type: ignore[arg-type]
    "extra-None": lambda: LookupQuery("r", [1], extra_keys=None),  # type: ignore[arg-type]
    "not-a-query": lambda: "hello",  # type: ignore[return-value,arg-type]
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_queries_never_raise(h, name):
    seen: list[LookupQuery] = []
    h.server("k", 0, lambda got: seen.append(got) or len(got.tokens))
    client = h.client("k", 1)
    assert client.lookup(HOSTILE[name]()) == 0
    assert client.failures == 1
    assert seen == []  # never sent
    assert client.lookup(q([1, 2])) == 2  # and the channel still works


def test_bad_callbacks_answer_minus_one_and_the_client_counts_a_miss(h, caplog):
    def boom(query: LookupQuery) -> int:
        raise RuntimeError("tier exploded")

    h.server("k", 0, boom)
    h.server("k", 1, lambda query: len(query.tokens) + 5)  # more than asked: garbage
    h.server("k", 2, lambda query: len(query.tokens))
    client = h.client("k", 3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert client.lookup(q([1, 2])) == 0
        assert client.lookup(q([1, 2])) == 0
    assert client.failures == 4
    server_errors = [r for r in caplog.records if "failed; answering -1" in r.getMessage()]
    assert len(server_errors) == 2  # throttled: once for rank 0, once for rank 1 (60 s window)


def test_garbage_from_a_raw_client_closes_only_that_connection(h, caplog):
    server = h.server("k", 0, lambda query: len(query.tokens))
    client = h.client("k", 1)
    assert client.lookup(q([5])) == 1
    garbage = [
        b"\x09hello",
        b"\x01" + struct.pack("<H", 60000),
        b"\x01\x00\x00\x00\x00\x00\x00" + struct.pack("<I", 2**31),
        b"\x01\x02\x00\xc3\x28",
    ]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for payload in garbage:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
                raw.settimeout(2.0)
                raw.connect(str(server.path))
                raw.sendall(payload)
                assert closed_without_reply(raw)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:  # truncated: silent
            raw.connect(str(server.path))
            raw.sendall(encode_lookup(q([1, 2, 3]))[:5])
    malformed = [r for r in caplog.records if "malformed request" in r.getMessage()]
    assert len(malformed) == len(garbage)
    assert client.lookup(q([5, 6])) == 2  # the persistent connection was untouched
    assert h.client("k", 1).lookup(q([5, 6, 7])) == 3  # and new ones work


def test_a_stalled_client_is_cut_off_and_blocks_nobody(h, monkeypatch):
    monkeypatch.setattr(lookup_server, "_BODY_TIMEOUT_S", 0.3)
    server = h.server("k", 0, lambda query: len(query.tokens))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(3.0)
        raw.connect(str(server.path))
        raw.sendall(b"\x01\x05")  # starts a request, never finishes it
        client = h.client("k", 1)
        start = time.monotonic()
        assert client.lookup(q([1, 2])) == 2  # served meanwhile
        assert time.monotonic() - start < 0.25
        assert closed_without_reply(raw)  # then the stalled one is closed
        assert time.monotonic() - start < 2.5


def test_closing_an_older_server_keeps_the_newer_socket(h):
    old = h.server("k", 0, lambda query: 1)
    new = h.server("k", 0, lambda query: 2)  # same engine key and rank: replaces the socket
    assert old.path == new.path
    old.close()
    assert new.path.exists()
    client = h.client("k", 1)
    assert client.lookup(q([1, 2])) == 2
    new.close()
    assert not new.path.exists() and not new.path.parent.exists()


def test_two_engines_on_one_host_do_not_share_sockets(h):
    h.server("eng:instance-a", 0, lambda query: 1)
    h.server("eng:instance-b", 0, lambda query: 2)
    assert h.client("eng:instance-a", 1).lookup(q([1, 2])) == 1
    assert h.client("eng:instance-b", 1).lookup(q([1, 2])) == 2


def test_a_non_directory_socket_folder_is_refused_by_lmcache(h, base, caplog):
    folder = socket_dir("k7", base=base)
    folder.write_text("not a folder")
    with pytest.raises(
        PermissionError,
        match=re.escape(
            f"lookup socket folder {folder}: expected a directory owned by uid {os.getuid()}, "
            f"found a non-directory owned by uid {os.getuid()}; remove it"
        ),
    ):
        LookupServer("k7", 0, lambda query: 0, lambda: None, base=base)
    assert folder.read_text() == "not a folder"
    client = h.client("k7", 1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert client.lookup(q([1])) == 0  # the client does not connect through it either
    assert f"unsafe folder ({folder}: it is not a directory; not connecting)" in caplog.text


def test_a_symlinked_socket_folder_is_refused_though_the_os_would_follow_it(h, base, caplog):
    """A link to a private folder of ours holding a live socket: the OS would bind and connect
    through it; lmcache's own ``lstat`` checks (server and client) refuse it."""
    target = h.server("elsewhere", 0, lambda query: 1)
    folder = socket_dir("k7", base=base)
    folder.symlink_to(target.path.parent, target_is_directory=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(folder / target.path.name))  # the OS itself lets a connect through
    with pytest.raises(PermissionError, match=r"found a non-directory owned by uid"):
        LookupServer("k7", 0, lambda query: 2, lambda: None, base=base)
    assert folder.is_symlink() and target.path.exists()
    client = h.client("k7", 1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert client.lookup(q([1])) == 0
    assert "unsafe folder" in caplog.text and "it is not a directory" in caplog.text
    assert client.failures == 1


def test_client_refuses_a_folder_others_can_enter(h, caplog):
    server = h.server("k8", 0, lambda query: 1)
    client = h.client("k8", 1)
    os.chmod(server.path.parent, 0o755)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert client.lookup(q([1])) == 0  # the OS would connect: lmcache's mode check refuses
    assert "its mode is 0755, expected 0700; not connecting" in caplog.text
    os.chmod(server.path.parent, 0o700)
    assert client.lookup(q([1])) == 1


def test_server_makes_an_open_folder_of_ours_private(h, base):
    folder = socket_dir("k10", base=base)
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)  # whatever the umask
    h.server("k10", 0, lambda query: 1)
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    assert h.client("k10", 1).lookup(q([1])) == 1


def test_closed_client_misses_without_raising(h):
    h.server("k", 0, lambda query: 1)
    client = h.client("k", 1)
    client.close()
    client.close()
    assert client.lookup(q([1])) == 0
    assert client.clear() is False


def test_too_long_a_socket_path_is_refused_with_a_fix(base):
    deep = base / ("d" * 120)
    deep.mkdir()
    with pytest.raises(ValueError, match="AF_UNIX allows at most 107: set TMPDIR"):
        LookupServer("k", 0, lambda query: 0, lambda: None, base=deep)
    assert LookupClient("k", 1, base=deep).lookup(q([1])) == 0  # the client just misses


def test_a_regular_file_at_the_socket_path_is_not_deleted(h, base):
    path = socket_path("k9", 0, base=base)
    path.parent.mkdir(mode=0o700)
    path.write_text("precious")
    with pytest.raises(FileExistsError, match="is not a socket"):
        LookupServer("k9", 0, lambda query: 0, lambda: None, base=base)
    assert path.read_text() == "precious"


def test_servers_in_this_process_are_called_directly(h):
    """Same answers as over the socket, no connection made; a closed server is a miss."""
    seen: list[LookupQuery] = []
    cleared: list[int] = []

    def lookup(query: LookupQuery) -> int:
        seen.append(query)
        return len(query.tokens) // 2

    server = h.server("direct", 0, lookup, lambda: cleared.append(1))
    direct = h.client("direct", 1, in_process=True)
    wire = h.client("direct", 1)
    query = q(list(range(40)), salt="s", req_id="r1")
    assert direct.lookup(query) == wire.lookup(query) == 20
    assert seen[0] == seen[1] == query
    assert direct._ranks[0].conn is None and wire._ranks[0].conn is not None  # no socket used
    assert direct.clear() and cleared == [1]
    # a query beyond a limit is a bad query in this process too: no call, a counted miss
    assert direct.lookup(q([1], salt="x" * (MAX_SALT_BYTES + 1))) == 0
    assert direct.failures == 1 and len(seen) == 2
    server.close()
    assert direct.lookup(query) == 0 and direct.failures >= 2
