# SPDX-License-Identifier: Apache-2.0
"""The node cache's wire format, index, folder permissions and config keys; malformed frames sent
to a real owner process close only their own connection."""

from __future__ import annotations

import os
import socket
import stat
import struct
from pathlib import Path

import msgspec
import pytest

from lmcache.config import ConfigError, LMCacheConfig, load_config
from lmcache.node import wire
from lmcache.node.arena import NodeCacheError, ensure_private_dir
from lmcache.node.index import Entry, Leases, NodeIndex
from lmcache.testing.node_owner import NodeOwner

KEY = b"k" * 16


def _key(i: int) -> bytes:
    return i.to_bytes(2, "little") * 8


# ------------------------------------------------------------------------------ wire


def test_messages_round_trip_and_frames_split_a_stream() -> None:
    msgs: list[wire._Msg] = [
        wire.Missing([_key(1), _key(2)]),
        wire.Commit(7, KEY, None, b"fp", 2**64 - 1, -(2**63), [2, 256, 64], "bfloat16"),
        wire.Release([1, 2, 3]),
    ]
    stream = b"".join(wire.encode(m) for m in msgs)
    reader = wire.FrameReader()
    bodies = reader.feed(stream[:5]) + reader.feed(stream[5:])
    assert [wire.decode_request(b) for b in bodies] == msgs


@pytest.mark.parametrize(
    "bad",
    [
        wire.Missing([b""]),  # empty key
        wire.Missing([b"x" * 65]),  # key too long
        wire.Commit(1, KEY, None, b"", None, None, [1] * 9, "bfloat16"),  # 9 dims
        wire.Commit(1, KEY, None, b"", None, None, [1], "torch.bfloat16"),  # dtype form
        wire.Alloc(-1, 1, []),  # negative size
        wire.Release([0]),  # block ids start at 1
    ],
)
def test_out_of_bounds_fields_are_refused(bad: wire._Msg) -> None:
    with pytest.raises(wire.FrameError):
        wire.decode_request(wire.encode(bad)[4:])


def test_unknown_tags_and_garbage_are_refused() -> None:
    with pytest.raises(wire.FrameError):
        wire.decode_request(msgspec.msgpack.encode([55, b"x"]))
    with pytest.raises(wire.FrameError):
        wire.decode_request(b"\xc1\xff\x00")
    with pytest.raises(wire.FrameError):
        wire.FrameReader().feed(struct.pack("<I", wire.MAX_FRAME_BYTES + 1))


# ------------------------------------------------------------------------------ index


def _entry(index: NodeIndex, leases: Leases, key: bytes, parent: bytes | None = None) -> None:
    (block,), _ = index.alloc(leases, 256, 1, frozenset())
    entry = Entry(block, 256, [256], "uint8", None, None, b"")
    assert index.commit(leases, block.id, key, parent, entry) is None
    index.release(leases, block.id)


def test_index_only_hands_out_committed_blocks_and_frees_abandoned_ones() -> None:
    index = NodeIndex(4 * 256)
    a = Leases()
    (block,), _ = index.alloc(a, 256, 1, frozenset())
    assert index.get(a, KEY) is None and index.missing([KEY]) == [0]  # writing: invisible
    index.release(a, block.id)  # abandoned before commit
    assert index.used == 0 and index.free.free == [(0, 1024)]


def test_index_evicts_unleased_tails_first_and_never_protected_keys() -> None:
    index = NodeIndex(4 * 256)
    a, b = Leases(), Leases()
    chain = [_key(i) for i in range(4)]
    for i, key in enumerate(chain):
        _entry(index, a, key, chain[i - 1] if i else None)
    index.order.touch_chain(chain)
    assert index.get(b, chain[3]) is not None  # b leases the tail: it stays
    blocks, evicted = index.alloc(b, 256, 2, frozenset({chain[0]}))
    assert len(blocks) == 2 and evicted == 2
    assert index.missing(chain) == [1, 2]  # the LRU head-side of the tail went; chain[0] kept
    assert index.alloc(b, 256, 1, frozenset(chain))[0] == []  # nothing evictable left
    index.release_all(b)
    assert index.leased_blocks() == 0


def test_reconcile_keeps_only_the_leases_a_reconnecting_client_still_holds() -> None:
    index = NodeIndex(8 * 256)
    a = Leases()
    blocks, _ = index.alloc(a, 256, 3, frozenset())
    index.lease(a, blocks[0])  # a second lease on block 0
    # the client says: block 0 once, block 1 once; block 2's reply was lost with a timeout
    index.reconcile(a, [(blocks[0].id, 1), (blocks[1].id, 1), (999, 4)])
    assert a.counts == {blocks[0].id: 1, blocks[1].id: 1}
    assert blocks[2].id not in index.blocks  # never committed, no lease left: freed
    assert index.used == 2 * 256


# ------------------------------------------------------------------------------ owner process


def _hello(sock: socket.socket) -> wire.Welcome:
    sock.sendall(wire.encode(wire.Hello(wire.PROTOCOL_VERSION, os.urandom(16), 0, "", [])))
    reply = wire.decode_reply(wire.read_frame(sock))
    assert isinstance(reply, wire.Welcome)
    return reply


def _connect(folder: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5.0)
    sock.connect(str(folder / "node.sock"))
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize(
    "frame",
    [
        struct.pack("<I", 3) + b"\xc1\xc1\xc1",  # not msgpack
        struct.pack("<I", 1 << 31),  # oversized
        wire.encode(wire.Missing([b"x" * 65])),  # out of bounds
        wire.encode(wire.Hello(wire.PROTOCOL_VERSION, os.urandom(16), 0, "", [])),  # twice
    ],
)
def test_a_malformed_frame_closes_only_its_connection(tmp_path: Path, frame: bytes) -> None:
    with NodeOwner(tmp_path / "node", 1 << 20) as owner:
        good, bad = _connect(owner.folder), _connect(owner.folder)
        _hello(good)
        _hello(bad)
        bad.sendall(frame)
        assert _closed_by_peer(bad)
        good.sendall(wire.encode(wire.Missing([KEY])))
        assert wire.decode_reply(wire.read_frame(good)) == wire.MissingReply([0])
        first = _connect(owner.folder)  # a request before Hello is refused too
        first.sendall(wire.encode(wire.Missing([KEY])))
        assert _closed_by_peer(first)
        for sock in (good, bad, first):
            sock.close()


def test_socket_arena_and_folder_are_private(tmp_path: Path) -> None:
    with NodeOwner(tmp_path / "node", 1 << 20) as owner:
        folder = owner.folder
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        names = sorted(p.name for p in folder.iterdir())
        assert "node.sock" in names and any(n.startswith("arena-") for n in names)
        for path in folder.iterdir():
            assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600, path.name
            assert os.lstat(path).st_uid == os.getuid()
        with _connect(folder) as sock:
            welcome = _hello(sock)
        assert welcome.budget_bytes == 1 << 20
        assert Path(welcome.arena_path).name == f"arena-{welcome.generation}.bin"


def test_a_folder_others_can_enter_is_refused(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(NodeCacheError, match="mode 0700"):
        ensure_private_dir(open_dir)
    with pytest.raises(NodeCacheError, match="short enough for a Unix socket"):
        ensure_private_dir(tmp_path / ("x" * 120))
    assert stat.S_IMODE(os.stat(ensure_private_dir(tmp_path / "new")).st_mode) == 0o700


# ------------------------------------------------------------------------------ config


def test_node_cache_config_keys() -> None:
    assert LMCacheConfig().node_cache is False  # per-process stays the default
    cfg = load_config(env={"LMCACHE_NODE_CACHE": "true", "LMCACHE_NODE_CACHE_DIR": "/dev/shm/x"})
    assert cfg.node_cache and cfg.node_cache_dir == "/dev/shm/x" and cfg.node_cache_autostart
    with pytest.raises(ConfigError, match=r"node_cache_dir.*absolute"):
        load_config(env={"LMCACHE_NODE_CACHE_DIR": "relative/dir"})
    with pytest.raises(ConfigError, match=r"node_cache.*local_cpu"):
        LMCacheConfig(node_cache=True, local_cpu=False)
