# SPDX-License-Identifier: Apache-2.0
"""DiskTier: bit-exact round trips, restarts (in-process, new process, after kill -9), the LRU
quota, ENOSPC, corruption detection, the bounded write queue and configuration errors.

Chunk values are derived from their key (:func:`_values`), so a reader, including another
process, can recompute exactly what a writer stored and compare bits.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache.config import ConfigError
from lmcache.memory import HostMemoryPool
from lmcache.metrics import LMCacheMetrics
from lmcache.tiers import tensor_checksum
from lmcache.tiers.chunk_format import HEADER_BYTES, ChunkHeader, fingerprint_digest
from lmcache.tiers.disk.tier import DiskTier
from lmcache.tiers.lower_tier import ReadRequest

FP = fingerprint_digest(b"model-a")
FP_B = fingerprint_digest(b"model-b")
SHAPE = (2, 4, 32)  # [num_layers, num_tokens, kv_width]
DTYPE = torch.float32
CHUNK_BYTES = 2 * 4 * 32 * 4  # 1024
FILE_BYTES = HEADER_BYTES + CHUNK_BYTES


def _key(i: int) -> bytes:
    return i.to_bytes(8, "little") + b"chunkkey"


def _values(key: bytes, shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """The chunk a writer stores under ``key``: random values seeded by the key."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return torch.randn(shape, generator=gen).mul_(3).to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


def _store(
    tier: DiskTier,
    pool: HostMemoryPool,
    metrics: LMCacheMetrics,
    key: bytes,
    *,
    fp: bytes = FP,
    shape: tuple[int, int, int] = SHAPE,
    dtype: torch.dtype = DTYPE,
) -> bool:
    lease = pool.allocate(shape, dtype)
    assert lease is not None
    with lease:
        lease.tensor.copy_(_values(key, shape, dtype))
        return tier.submit_write(fp, key, lease, None, metrics)


def _load(
    tier: DiskTier,
    metrics: LMCacheMetrics,
    keys: list[bytes],
    *,
    fp: bytes = FP,
    shape: tuple[int, int, int] = SHAPE,
    dtype: torch.dtype = DTYPE,
) -> tuple[int, list[torch.Tensor]]:
    outs = [torch.full(shape, float("nan"), dtype=dtype) for _ in keys]
    done = tier.read_into(fp, [ReadRequest(k, o) for k, o in zip(keys, outs, strict=True)], metrics)
    return done, outs


def _files(root: Path, pattern: str = "*.lmc") -> list[Path]:
    return sorted(root.rglob(pattern))


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in _files(root))


@pytest.fixture
def pool() -> HostMemoryPool:
    return HostMemoryPool(64 << 20, pin=False, slab_bytes=16 << 20)


@pytest.fixture
def metrics() -> LMCacheMetrics:
    return LMCacheMetrics()


@pytest.fixture(autouse=True)
def _close_tiers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Close every tier a test made (their writer threads end)."""
    made: list[DiskTier] = []
    init = DiskTier.__init__

    def tracking_init(self: DiskTier, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(DiskTier, "__init__", tracking_init)
    yield
    for tier in made:
        tier.close(5)


def _tier(path: Path | str, max_bytes: int = 1 << 20, **kwargs: object) -> DiskTier:
    return DiskTier(str(path), max_bytes, fsync=False, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize(
    ("dtype", "shape"), [(torch.bfloat16, (3, 16, 40)), (torch.float32, SHAPE)]
)
def test_round_trip_bit_exact_with_modes(
    tmp_path: Path,
    pool: HostMemoryPool,
    metrics: LMCacheMetrics,
    dtype: torch.dtype,
    shape: tuple[int, int, int],
) -> None:
    root = tmp_path / "a" / "b" / "cache"  # two missing parents
    tier = DiskTier(f"file://{root}", 1 << 20)  # fsync on: the production path
    keys = [_key(i) for i in range(4)]
    assert all(_store(tier, pool, metrics, k, shape=shape, dtype=dtype) for k in keys)
    assert tier.flush(10)
    assert tier.contains(FP, [*keys, _key(99)], metrics) == [True] * 4 + [False]

    done, outs = _load(tier, metrics, keys, shape=shape, dtype=dtype)
    assert done == 4
    for key, out in zip(keys, outs, strict=True):
        assert _same_bits(out, _values(key, shape, dtype))
    assert metrics.value("disk_stored_chunks") == 4
    assert metrics.value("disk_hit_chunks") == 4
    assert metrics.value("tier_errors") == metrics.value("checksum_failures") == 0

    for folder in (tmp_path / "a", tmp_path / "a" / "b", root, root / FP.hex()):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    files = _files(root)
    assert [p.name for p in files] == sorted(k.hex() + ".lmc" for k in keys)
    nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.stat().st_size == HEADER_BYTES + nbytes
    assert tier.used_bytes == _disk_bytes(root)
    tier.close()


def test_a_read_with_the_wrong_geometry_or_model_is_a_miss_not_a_wrong_tensor(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics
) -> None:
    tier = _tier(tmp_path)
    _store(tier, pool, metrics, _key(1))
    tier.flush(10)
    assert tier.contains(FP_B, [_key(1)], metrics) == [False]
    assert _load(tier, metrics, [_key(1)], fp=FP_B)[0] == 0  # other model: no such file
    assert metrics.value("checksum_failures") == 0
    assert _load(tier, metrics, [_key(1)], shape=(2, 4, 16), dtype=torch.float64)[0] == 0
    assert metrics.value("checksum_failures") == 1  # the header does not match the request


def test_rewriting_a_present_key_keeps_one_file(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics
) -> None:
    tier = _tier(tmp_path)
    for _ in range(3):
        _store(tier, pool, metrics, _key(1))
    tier.flush(10)
    assert len(_files(tmp_path)) == 1 and len(tier) == 1 and tier.used_bytes == FILE_BYTES
    assert _load(tier, metrics, [_key(1)])[0] == 1


def _aligned(shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
    nbytes = shape[0] * shape[1] * shape[2] * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    skip = -raw.data_ptr() % 4096
    out = raw[skip : skip + nbytes].view(dtype).view(shape)
    assert out.data_ptr() % 4096 == 0
    return out


@pytest.mark.parametrize("refuse", [False, True], ids=["direct", "direct-refused"])
def test_aligned_buffers_read_with_o_direct_and_fall_back(
    tmp_path: Path,
    pool: HostMemoryPool,
    metrics: LMCacheMetrics,
    monkeypatch: pytest.MonkeyPatch,
    refuse: bool,
) -> None:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    shape = (2, 8, 300)  # 9600 bytes: two 4 KiB blocks read direct, a 1408-byte tail buffered
    tier = _tier(tmp_path)
    for i in range(2):
        _store(tier, pool, metrics, _key(i), shape=shape, dtype=torch.bfloat16)
    tier.flush(10)
    real_open = os.open
    direct_opens: list[str] = []

    def spy(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            direct_opens.append(path)
            if refuse:
                raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", spy)
    for i in range(2):
        out = _aligned(shape, torch.bfloat16)
        out.fill_(float("nan"))
        assert tier.read_into(FP, [ReadRequest(_key(i), out)], metrics) == 1
        assert _same_bits(out, _values(_key(i), shape, torch.bfloat16))
    # Refused once: the tier stops trying. Accepted: each aligned read is direct.
    assert len(direct_opens) == (2 if tier._direct else 1)
    assert not (refuse and tier._direct)  # refused once: the tier stopped trying
    # a buffer 256 bytes past a 4 KiB boundary (a plain tensor could land aligned by chance)
    base = _aligned((1, 1, shape[0] * shape[1] * shape[2] + 128), torch.bfloat16).view(-1)
    unaligned = base[128:].view(shape).fill_(float("nan"))
    assert unaligned.data_ptr() % 4096 == 256
    assert tier.read_into(FP, [ReadRequest(_key(0), unaligned)], metrics) == 1
    assert _same_bits(unaligned, _values(_key(0), shape, torch.bfloat16))
    assert len(direct_opens) == (2 if tier._direct else 1)  # the unaligned buffer read buffered
    assert metrics.value("tier_errors") == 0


# --------------------------------------------------------------------------- restart


KILL_SHAPE = (4, 256, 256)  # 1 MiB of float32: a write takes long enough to be caught in it


def _write_main(path: str) -> None:
    """A writer process: stores ``_key(0)``, ``_key(1)``, ... until it is killed."""
    pool = HostMemoryPool(64 << 20, pin=False, slab_bytes=16 << 20)
    metrics = LMCacheMetrics()
    tier = DiskTier(path, 1 << 30, write_queue_bytes=4 << 20)
    for i in itertools.count():
        while not _store(tier, pool, metrics, _key(i), shape=KILL_SHAPE):
            tier.flush(10)  # queue full: wait rather than drop, so every key gets its write


def _read_main(path: str, count: int) -> None:
    """A reader process: prints how many of ``_key(0..count)`` loaded bit-exact."""
    metrics = LMCacheMetrics()
    tier = DiskTier(path, 1 << 20)
    keys = [_key(i) for i in range(count)]
    done, outs = _load(tier, metrics, keys)
    exact = sum(
        _same_bits(o, _values(k, SHAPE, DTYPE)) for k, o in zip(keys[:done], outs, strict=False)
    )
    print(f"loaded={done} exact={exact} failures={metrics.value('checksum_failures')}")


def _python(code: str) -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    prelude = f"import sys; sys.path.insert(0, {here!r}); import test_disk_tier as t; "
    return [sys.executable, "-c", prelude + code]


def test_tiers_sharing_a_folder_see_each_others_new_chunks(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics
) -> None:
    """Two engines (processes) on one folder: chunks one writes after the other started are
    found and read, verified, by the other; a file deleted meanwhile is a clean miss."""
    reader = _tier(tmp_path, 8 * FILE_BYTES)
    writer = _tier(tmp_path, 8 * FILE_BYTES)
    keys = [_key(i) for i in range(3)]
    for key in keys:
        _store(writer, pool, metrics, key)
    assert writer.flush(10)
    assert len(reader) == 0  # started before the writes
    assert reader.contains(FP, [*keys, _key(7)], metrics) == [True, True, True, False]
    done, outs = _load(reader, metrics, keys)
    assert done == 3
    assert all(_same_bits(o, _values(k, SHAPE, DTYPE)) for k, o in zip(keys, outs, strict=True))
    (tmp_path / FP.hex() / f"{keys[0].hex()}.lmc").unlink()  # the writer evicted it
    assert _load(reader, metrics, keys)[0] == 0
    assert metrics.value("checksum_failures") == 0


def test_restart_finds_the_entries_in_lru_order(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics
) -> None:
    tier = _tier(tmp_path, 4 * FILE_BYTES)
    keys = [_key(i) for i in range(4)]
    for key in keys:
        _store(tier, pool, metrics, key)
        tier.flush(10)
    assert _load(tier, metrics, keys[:1])[0] == 1  # key 0 becomes the most recent
    tier.close()

    again = _tier(tmp_path, 4 * FILE_BYTES)
    assert len(again) == 4 and again.used_bytes == 4 * FILE_BYTES
    _store(again, pool, metrics, _key(9))
    again.flush(10)
    # The order came back from the files: key 0 (read) is newer than 1, 2, 3; key 1 went.
    assert again.contains(FP, keys, metrics) == [True, False, True, True]
    kept = [keys[0], keys[2], keys[3], _key(9)]
    done, outs = _load(again, metrics, kept)
    assert done == 4
    assert all(_same_bits(o, _values(k, SHAPE, DTYPE)) for k, o in zip(kept, outs, strict=True))


def test_restart_in_a_new_process_reads_bit_exact(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics
) -> None:
    tier = DiskTier(str(tmp_path), 1 << 20)
    for i in range(6):
        _store(tier, pool, metrics, _key(i))
    tier.close()
    run = subprocess.run(
        _python(f"t._read_main({str(tmp_path)!r}, 6)"), capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "loaded=6 exact=6 failures=0.0"


def test_kill_9_mid_writes_leaves_only_entries_that_verify(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        _python(f"t._write_main({str(tmp_path)!r})"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:  # kill once 16 writes landed, at a moment a temporary file is seen (mid-write)
        deadline = time.monotonic() + 120
        while len(_files(tmp_path)) < 16 or not _files(tmp_path, ".tmp-*"):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the writer did not land 16 writes in 120 s"
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        if proc.stderr:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    on_disk = _files(tmp_path)
    assert len(on_disk) >= 16

    metrics = LMCacheMetrics()
    tier = _tier(tmp_path, 1 << 30)
    assert not _files(tmp_path, ".tmp-*"), "temporary files survived the restart"
    assert _files(tmp_path) == on_disk and len(tier) == len(on_disk)  # no real name was half
    for path in on_disk:
        key = bytes.fromhex(path.stem)
        done, (out,) = _load(tier, metrics, [key], shape=KILL_SHAPE)
        assert done == 1, path
        assert _same_bits(out, _values(key, KILL_SHAPE, DTYPE)), path
    assert metrics.value("checksum_failures") == 0
    assert metrics.value("disk_hit_chunks") == len(on_disk)


def test_start_deletes_abandoned_temp_files_but_not_live_ones(tmp_path: Path) -> None:
    _tier(tmp_path).close()
    folder = tmp_path / FP.hex()
    folder.mkdir(mode=0o700)
    abandoned = folder / f".tmp-{_key(1).hex()}-1-0"
    abandoned.write_bytes(b"half a chunk")
    live = folder / f".tmp-{_key(2).hex()}-2-0"
    live.write_bytes(b"a write in progress")
    unrelated = tmp_path / "notes.txt"
    unrelated.write_text("not ours")
    with open(live, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # as a live writer holds it
        _tier(tmp_path)
        assert not abandoned.exists()
        assert live.exists()
    assert unrelated.read_text() == "not ours"


# --------------------------------------------------------------------------- quota and LRU


def test_quota_is_never_exceeded_and_reads_keep_entries(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics
) -> None:
    quota = 5 * FILE_BYTES + 100
    tier = _tier(tmp_path, quota)
    for i in range(5):  # a..e
        _store(tier, pool, metrics, _key(i))
        tier.flush(10)
    # Read the run [1, 2]: key 1, the head, becomes the most recent; order 0 3 4 2 1.
    assert _load(tier, metrics, [_key(1), _key(2)])[0] == 2
    for i in range(5, 12):
        _store(tier, pool, metrics, _key(i))
        tier.flush(10)
        assert _disk_bytes(tmp_path) == tier.used_bytes <= quota
        if i == 7:  # evicted 0, 3, 4 (never read); kept 2 and 1 (read)
            assert tier.contains(FP, [_key(k) for k in range(5)], metrics) == [
                False,
                True,
                True,
                False,
                False,
            ]
        if i == 8:  # then the run's tail before its head
            assert tier.contains(FP, [_key(1), _key(2)], metrics) == [True, False]
    assert len(tier) == 5
    assert metrics.value("disk_stored_chunks") == 12


def test_a_smaller_quota_at_restart_evicts_the_oldest(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics
) -> None:
    tier = _tier(tmp_path)
    for i in range(6):
        _store(tier, pool, metrics, _key(i))
        tier.flush(10)
    tier.close()
    small = _tier(tmp_path, 2 * FILE_BYTES)
    assert small.contains(FP, [_key(i) for i in range(6)], metrics) == [False] * 4 + [True] * 2
    assert _disk_bytes(tmp_path) == 2 * FILE_BYTES


def test_evictions_during_reads_never_return_wrong_bytes(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics
) -> None:
    tier = _tier(tmp_path, 3 * FILE_BYTES)
    stop = threading.Event()
    bad: list[int] = []
    hits = [0]

    def reader() -> None:
        while not stop.is_set():
            for i in range(40):
                done, (out,) = _load(tier, metrics, [_key(i)])
                if done:
                    hits[0] += 1
                    if not _same_bits(out, _values(_key(i), SHAPE, DTYPE)):
                        bad.append(i)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i in range(40):
        _store(tier, pool, metrics, _key(i))
        tier.flush(10)
    stop.set()
    for t in threads:
        t.join(30)
    assert not bad
    assert hits[0] > 0
    assert metrics.value("checksum_failures") == metrics.value("tier_errors") == 0
    assert _disk_bytes(tmp_path) <= 3 * FILE_BYTES


# --------------------------------------------------------------------------- ENOSPC


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({mount.stderr.strip()}); the injected test covers ENOSPC"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _check_enospc_then_recovery(
    tier: DiskTier,
    root: Path,
    pool: HostMemoryPool,
    metrics: LMCacheMetrics,
    shape: tuple[int, int, int],
    *,
    fill: Callable[[], object],
    free: Callable[[], object],
) -> None:
    """Key 0 is stored; after ``fill()`` key 1 does not fit; after ``free()`` it stores."""
    assert _store(tier, pool, metrics, _key(0), shape=shape) is True
    assert tier.flush(10)
    fill()
    assert _store(tier, pool, metrics, _key(1), shape=shape) is True  # accepted; fails later
    assert tier.flush(10)
    assert metrics.value("tier_errors") == 1
    assert metrics.value("disk_stored_chunks") == 1
    assert [p.stem for p in _files(root)] == [_key(0).hex()]  # nothing under a real name
    assert not _files(root, ".tmp-*")
    assert tier.contains(FP, [_key(0), _key(1)], metrics) == [True, False]

    free()
    assert _store(tier, pool, metrics, _key(1), shape=shape)
    assert tier.flush(10)
    done, (out,) = _load(tier, metrics, [_key(1)], shape=shape)
    assert done == 1 and _same_bits(out, _values(_key(1), shape, DTYPE))
    assert metrics.value("tier_errors") == 1


def test_enospc_on_a_full_tmpfs(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics
) -> None:
    shape = (2, 16, 256)  # 32 KiB + a 4 KiB header: one fits in 64 KiB, two do not
    with _tmpfs(tmp_path / "mnt", "64k") as root:
        tier = DiskTier(str(root), 1 << 20)  # the quota is not what stops the second write
        _check_enospc_then_recovery(
            tier,
            root,
            pool,
            metrics,
            shape,
            fill=lambda: None,
            free=lambda: tier.delete(FP, _key(0), metrics),
        )
        tier.close()


def test_enospc_injected_mid_write(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = DiskTier(str(tmp_path), 1 << 20)
    real_writev = os.writev
    full = threading.Event()

    def writev(fd: int, buffers: list[memoryview]) -> int:
        if not full.is_set():
            return real_writev(fd, buffers)
        if len(buffers[0]) == HEADER_BYTES:  # the header lands, then the disk is full
            return real_writev(fd, buffers[:1])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "writev", writev)
    _check_enospc_then_recovery(
        tier, tmp_path, pool, metrics, SHAPE, fill=full.set, free=full.clear
    )
    done, (out,) = _load(tier, metrics, [_key(0)])
    assert done == 1 and _same_bits(out, _values(_key(0), SHAPE, DTYPE))


# --------------------------------------------------------------------------- corruption


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _corrupt(root: Path, kind: str) -> list[bytes]:
    """Damage the entries of keys 1 (and 2); returns the keys that must now miss."""
    one = root / FP.hex() / f"{_key(1).hex()}.lmc"
    two = root / FP.hex() / f"{_key(2).hex()}.lmc"
    if kind == "payload-bit":
        _flip(one, HEADER_BYTES + 100)
    elif kind == "header-bit":
        _flip(one, 60)  # inside the dtype field
    elif kind == "truncated":
        os.truncate(one, HEADER_BYTES + CHUNK_BYTES // 2)
    elif kind == "swapped":
        tmp = root / "swap"
        one.rename(tmp)
        two.rename(one)
        tmp.rename(two)
        return [_key(1), _key(2)]
    elif kind == "other-model":  # a valid entry of model B under model A's name
        payload = _values(_key(1), SHAPE, DTYPE)
        header = ChunkHeader(_key(1), FP_B, SHAPE, DTYPE, CHUNK_BYTES, tensor_checksum(payload))
        one.write_bytes(header.encode() + payload.numpy().tobytes())
    return [_key(1)]


KINDS = ["payload-bit", "header-bit", "truncated", "swapped", "other-model"]


@pytest.mark.parametrize("restart", [False, True], ids=["live", "restart"])
@pytest.mark.parametrize("kind", KINDS)
def test_corruption_is_detected_deleted_and_never_loaded(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics, kind: str, restart: bool
) -> None:
    tier = _tier(tmp_path)
    keys = [_key(i) for i in range(4)]
    for key in keys:
        _store(tier, pool, metrics, key)
    tier.flush(10)
    bad = _corrupt(tmp_path, kind)
    if restart:
        tier.close()
        tier = _tier(tmp_path)
        if kind != "payload-bit":  # the start scan checks headers, names and sizes only
            assert tier.contains(FP, bad, metrics) == [False] * len(bad)
            assert not any((tmp_path / FP.hex() / f"{k.hex()}.lmc").exists() for k in bad)

    # A run [0, 1, 2, 3] stops at the first bad chunk; every chunk it reports is exact.
    done, outs = _load(tier, metrics, keys)
    assert done == 1
    assert _same_bits(outs[0], _values(keys[0], SHAPE, DTYPE))
    for key in bad:
        done, _ = _load(tier, metrics, [key])
        assert done == 0
        assert not (tmp_path / FP.hex() / f"{key.hex()}.lmc").exists()
    assert tier.contains(FP, bad, metrics) == [False] * len(bad)
    expected_failures = len(bad) if not restart or kind == "payload-bit" else 0
    assert metrics.value("checksum_failures") == expected_failures
    assert metrics.value("tier_errors") == 0
    assert tier.used_bytes == _disk_bytes(tmp_path)
    done, (out,) = _load(tier, metrics, [_key(3)])
    assert done == 1 and _same_bits(out, _values(_key(3), SHAPE, DTYPE))


# --------------------------------------------------------------------------- write queue


class _GatedDiskTier(DiskTier):
    """Writes wait for ``gate``; ``entered`` is set when a write starts."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _write(self, fingerprint: bytes, key: bytes, header: bytes, payload: memoryview) -> None:
        self.entered.set()
        assert self.gate.wait(30)
        super()._write(fingerprint, key, header, payload)


def test_a_full_write_queue_drops_and_never_blocks(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics
) -> None:
    tier = _GatedDiskTier(str(tmp_path), 1 << 20, write_queue_bytes=CHUNK_BYTES, fsync=False)
    assert _store(tier, pool, metrics, _key(0))
    assert tier.entered.wait(10)  # the writer holds key 0; the queue is empty
    assert _store(tier, pool, metrics, _key(1))  # one write always fits an empty queue
    assert not _store(tier, pool, metrics, _key(2))  # returns at once while the writer waits
    assert metrics.value("dropped_writes") == 1
    tier.gate.set()
    assert tier.flush(10)
    assert tier.contains(FP, [_key(0), _key(1), _key(2)], metrics) == [True, True, False]
    assert metrics.value("disk_stored_chunks") == 2
    assert pool.used_bytes == 0  # every lease the queue took was released
    tier.close()


# --------------------------------------------------------------------------- clear


def test_clear_one_model_or_all_and_never_foreign_files(
    tmp_path: Path, pool: HostMemoryPool, metrics: LMCacheMetrics
) -> None:
    tier = _tier(tmp_path)
    for i in range(3):
        _store(tier, pool, metrics, _key(i))
        _store(tier, pool, metrics, _key(i), fp=FP_B)
    (tmp_path / "notes.txt").write_text("not ours")
    tier.clear(FP, metrics)
    assert tier.contains(FP, [_key(0)], metrics) == [False]
    assert tier.contains(FP_B, [_key(i) for i in range(3)], metrics) == [True] * 3
    assert not (tmp_path / FP.hex()).exists()
    assert tier.used_bytes == _disk_bytes(tmp_path) == 3 * FILE_BYTES
    tier.clear(None, metrics)
    assert len(tier) == 0 and tier.used_bytes == 0 and not _files(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "not ours"
    _store(tier, pool, metrics, _key(5))  # the model folder comes back
    tier.flush(10)
    assert _load(tier, metrics, [_key(5)])[0] == 1


# --------------------------------------------------------------------------- configuration


def test_a_path_under_a_regular_file_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for path in (blocker, blocker / "cache", f"file://{blocker}/cache"):
        with pytest.raises(ConfigError, match=r"local_disk.*not a folder.*writable folder"):
            DiskTier(str(path), 1 << 20)


def test_a_read_only_folder_is_a_config_error(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "ro", "64k") as root:
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        with pytest.raises(ConfigError, match=r"local_disk.*cannot be created"):
            DiskTier(str(root), 1 << 20)


def test_a_remote_file_url_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"local_disk.*remote_url"):
        DiskTier(f"file://otherhost{tmp_path}", 1 << 20)


@pytest.mark.parametrize("quota", [0, -1, HEADER_BYTES])
def test_a_quota_below_one_chunk_is_a_config_error(tmp_path: Path, quota: int) -> None:
    with pytest.raises(ConfigError, match=r"max_local_disk_size"):
        DiskTier(str(tmp_path), quota)
    assert not list(tmp_path.iterdir())  # nothing created


def test_check_quota_against_the_chunk_size(tmp_path: Path) -> None:
    tier = _tier(tmp_path, FILE_BYTES)
    tier.check_quota(CHUNK_BYTES)
    with pytest.raises(ConfigError, match=r"max_local_disk_size.*chunk_size"):
        tier.check_quota(CHUNK_BYTES + 1)


def test_an_existing_open_folder_is_kept_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    with caplog.at_level(logging.WARNING, logger="lmcache.tiers.disk.tier"):
        _tier(folder)
    assert "chmod 700" in caplog.text
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755  # never chmod a folder we did not make
