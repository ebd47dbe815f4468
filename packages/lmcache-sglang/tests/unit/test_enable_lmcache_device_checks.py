# SPDX-License-Identifier: Apache-2.0
"""``--enable-lmcache`` on a CUDA pool verifies chunks on the device by default.

Both connectors SGLang's ``--enable-lmcache`` loads (``UnifiedLMCacheMPConnector`` on 0.5.21+,
``LMCacheMPConnector`` on 0.5.17-0.5.19) run lmcache's cache engine, which resolves
``checksum_for(device, connector.verifies_checksums)``. A CUDA pool is simulated without a GPU:
the connector factory is handed ``EngineInfo.device == "cuda"`` over CPU tensors and the kernel
path is attached by hand (its ops run as the pure-torch reference). With default settings the
stored chunks keep the sums the device computed (nothing hashed on the host), and a byte flipped
in a chunk of the CPU tier is caught at load: the chunk is never written into SGLang's pool, it
is dropped, and the load reports only the tokens before it.
"""

from __future__ import annotations

import dataclasses
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lmcache.devices import register_backend
from lmcache.devices import registry as device_registry
from lmcache.gpu_ops import chunk_checksum
from lmcache.testing.recording_backend import RecordingBackend
from lmcache.tiers import CPUTier, reset_process_cpu_tiers
from lmcache_sglang import legacy_adapter, mp_connector
from lmcache_sglang.legacy_adapter import LMCacheLayerwiseConnector, LoadMetadata, StoreMetadata
from lmcache_sglang.mp_connector import UnifiedLMCacheMPConnector

CHUNK, LAYERS, HEADS, HEAD, SLOTS = 8, 3, 2, 8, 128
TOKENS = list(range(100, 124))  # three chunks
DTYPE = torch.bfloat16


@pytest.fixture(autouse=True)
def _fresh_process_tier() -> Iterator[None]:
    reset_process_cpu_tiers()
    yield
    reset_process_cpu_tiers()


def _pool(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """SGLang's MHA device pool: per layer K and V ``[slots, heads, head]``."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, SLOTS, HEADS, HEAD, generator=g).to(DTYPE)
    v = torch.randn(LAYERS, SLOTS, HEADS, HEAD, generator=g).to(DTYPE)
    return list(k), list(v)


def _simulate_cuda(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType) -> list[Any]:
    """Make ``module``'s connector factory build SGLang's CUDA connector over the CPU pools."""
    real = module.CreateGPUConnector
    made: list[Any] = []

    def create(config: Any, metadata: Any, engine: Any, hints: Any = None) -> Any:
        conn = real(config, metadata, dataclasses.replace(engine, device="cuda"), hints)
        conn.kernels = conn.kernel_transfer()
        assert conn.verifies_checksums and conn.engine.device == "cuda"
        made.append(conn)
        return conn

    monkeypatch.setattr(module, "CreateGPUConnector", create)
    return made


def _rows(pool: tuple[list[torch.Tensor], list[torch.Tensor]], slots: torch.Tensor) -> torch.Tensor:
    k, v = pool
    return torch.cat(
        [torch.stack([t[slots].reshape(len(slots), -1) for t in part]) for part in (k, v)], 2
    ).view(torch.uint8)


def _entries(tier: CPUTier) -> list[Any]:
    """The tier's entries in the order they were stored (chunk order for one request)."""
    return list(tier._entries.values())


def _check_device_sums(tier: CPUTier) -> list[Any]:
    entries = _entries(tier)
    assert len(entries) == 3
    for e in entries:  # the device's sum, kept with the bytes; nothing hashed on the host
        assert e.checksum is None and e.lease.checksum == chunk_checksum(e.lease.tensor)
    return entries


def _flip(entry: Any) -> None:
    entry.lease.tensor.reshape(-1).view(torch.uint8)[9] ^= 0x08


def _config_file(folder: Path, **extra: Any) -> str:
    """An ``--lmcache-config-file`` with LMCache's daemon keys and only a small budget."""
    path = folder / "lmcache.yaml"
    keys = {"mp_host": "127.0.0.1", "mp_port": 5556, "chunk_size": CHUNK}
    path.write_text(yaml.safe_dump({**keys, "max_local_cpu_size": 0.01, **extra}))
    return str(path)


def _legacy(
    tmp_path: Path, pool: tuple[list[torch.Tensor], list[torch.Tensor]], **extra: Any
) -> LMCacheLayerwiseConnector:
    config = legacy_adapter.lmcache_get_config(_config_file(tmp_path, **extra)).config
    k, v = pool
    return LMCacheLayerwiseConnector(
        sgl_config=types.SimpleNamespace(model_path=str(tmp_path)),
        tp_size=1,
        rank=0,
        k_pool=k,
        v_pool=v,
        config=config,
    )


def test_legacy_enable_lmcache_verifies_on_the_device_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang 0.5.17-0.5.19 (``LMCRadixCache``): ``retrieve_kv`` counts the tokens before the
    bad chunk, so SGLang computes the rest."""
    _simulate_cuda(monkeypatch, legacy_adapter)
    pool = _pool(1)
    conn = _legacy(tmp_path, pool)
    try:
        assert conn.engine._tiers.checksum is True
        src = torch.arange(8, 32)
        assert conn.store_kv(StoreMetadata(None, TOKENS, src)) == 24
        _flip(_check_device_sums(conn.engine.tier)[1])
        assert conn.lookup_kv(TOKENS, "r1") == 24  # verified at load, on the device
        dst = torch.arange(64, 88)
        before = _rows(pool, dst).clone()
        assert conn.retrieve_kv(LoadMetadata(TOKENS, dst, request_id="r1")) == CHUNK
        assert torch.equal(_rows(pool, dst[:8]), _rows(pool, src[:8]))
        assert torch.equal(_rows(pool, dst[8:16]), before[:, 8:16])  # never written
        assert conn.engine.metrics.value("checksum_failures") == 1
        assert conn.lookup_kv(TOKENS) == CHUNK  # the bad chunk left the tier
    finally:
        conn.close()


def test_legacy_enable_lmcache_checksum_false_turns_it_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _simulate_cuda(monkeypatch, legacy_adapter)
    conn = _legacy(tmp_path, _pool(2), checksum=False)
    try:
        assert conn.engine._tiers.checksum is False
        assert conn.store_kv(StoreMetadata(None, TOKENS, torch.arange(8, 32))) == 24
        assert all(
            e.lease.checksum is None and e.checksum is None
            for e in conn.engine.tier._entries.values()
        )
    finally:
        conn.close()


def test_unified_enable_lmcache_verifies_on_the_device_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang 0.5.21+ (``LMCacheUnifiedRadixCache``): a load that cannot land in full raises,
    and SGLang prefills those tokens."""
    made = _simulate_cuda(monkeypatch, mp_connector)
    pool = _pool(3)
    k, v = pool
    kvcache = types.SimpleNamespace(k_buffer=k, v_buffer=v)
    conn = UnifiedLMCacheMPConnector(
        config_file=_config_file(tmp_path),
        model_config=types.SimpleNamespace(model_path=str(tmp_path)),
        tp_size=1,
        tp_rank=0,
        page_size=4,
        token_to_kv_pool_allocator=types.SimpleNamespace(get_kvcache=lambda: kvcache),
    )
    try:
        assert conn.engine is not None and len(made) == 1
        assert conn.engine._tiers.checksum is True
        src = torch.arange(8, 32)
        store = conn.submit_store("r0", TOKENS, src)
        assert store is not None
        conn.complete_store(store)
        _flip(_check_device_sums(conn.engine.tier)[1])
        lookup = conn.submit_lookup("r1", TOKENS)
        assert conn.poll_lookup(lookup) == 24
        dst = torch.arange(64, 88)
        before = _rows(pool, dst).clone()
        with pytest.raises(RuntimeError, match="16 of 24 tokens landed"):
            conn.submit_load(lookup, dst, local_hit_tokens=0)
        assert torch.equal(_rows(pool, dst[:8]), _rows(pool, src[:8]))
        assert torch.equal(_rows(pool, dst[8:16]), before[:, 8:16])  # never written
        assert conn.engine.metrics.value("checksum_failures") == 1
        conn.finish_request("r1")
        again = conn.submit_lookup("r2", TOKENS)
        assert conn.poll_lookup(again) == CHUNK  # the bad chunk left the tier
        conn.complete_load(conn.submit_load(again, dst[:8], local_hit_tokens=0))
        conn.finish_request("r2")
    finally:
        conn.close()


def _deferred(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: bool = False
) -> tuple[RecordingBackend, Any, LMCacheLayerwiseConnector, threading.Event]:
    """The legacy connector on a device with streams (the recording stand-in of CUDA), its
    commits held until the returned event is set (``fail``: waiting for the copy raises)."""
    monkeypatch.setattr(device_registry, "_BACKENDS", dict(device_registry._BACKENDS))
    backend = RecordingBackend("cpu")
    register_backend(backend, clobber=True)
    _simulate_cuda(monkeypatch, legacy_adapter)
    pool = _pool(3)
    conn = _legacy(tmp_path, pool)
    gate = threading.Event()
    commit = conn._stores.commit

    def gated(staged: Any, copied: Any) -> int:
        gate.wait(30)
        return int(commit(staged, copied))

    if fail:

        def broken(event: Any) -> None:
            raise OSError("the device failed")

        monkeypatch.setattr(backend, "event_synchronize", broken)

    monkeypatch.setattr(conn._stores, "commit", gated)
    return backend, pool, conn, gate


def test_legacy_close_publishes_the_stores_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing the connector waits for the stores it started: their chunks are published."""
    _, _, conn, gate = _deferred(tmp_path, monkeypatch)
    tier = conn.engine.tier
    assert conn.store_kv(StoreMetadata(None, TOKENS, torch.arange(8, 32))) == 24
    closer = threading.Thread(target=conn.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive() and _entries(tier) == []  # waits for the commit
    gate.set()
    closer.join(30)
    assert not closer.is_alive()
    _check_device_sums(tier)


def test_legacy_store_that_fails_after_returning_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose publication fails (after ``store_kv`` returned) is a miss for the next
    lookup, which does not raise, and its buffers go back to the pool."""
    _, _, conn, gate = _deferred(tmp_path, monkeypatch, fail=True)
    try:
        assert conn.store_kv(StoreMetadata(None, TOKENS, torch.arange(8, 32))) == 24
        gate.set()
        assert conn.lookup_kv(TOKENS) == 0
        assert _entries(conn.engine.tier) == [] and conn.engine.tier.pool.used_bytes == 0
    finally:
        conn.close()


def test_legacy_store_returns_before_its_copy_and_sglang_waits_only_for_the_gather(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang 0.5.17-0.5.19 may reuse the pages once ``store_kv`` returns and answers the
    request only after it: the store returns with the chunks unpublished, the caller's stream
    waits for the gather out of the pools (not for the host copy), a lookup of the prompt waits
    for the publication, another prompt's does not, and the loaded KV is the stored KV."""
    backend, pool, conn, gate = _deferred(tmp_path, monkeypatch)
    try:
        caller = backend.current_stream(torch.device("cpu"))
        src = torch.arange(8, 32)
        backend.clear()
        assert conn.store_kv(StoreMetadata(None, TOKENS, src)) == 24
        assert _entries(conn.engine.tier) == []  # nothing published before the host copy
        waits = [c for c in backend.of("wait_event") if c.detail[0] is caller]
        copies = [i for i, c in enumerate(backend.calls) if c.name.startswith("copy")]
        assert len(waits) == 1 and copies
        at = backend.calls.index(waits[0])
        assert at > copies[-1]
        # the event the caller waits on was recorded before the copies to the host
        (event,) = waits[0].detail[1:2]
        recorded = [i for i, c in enumerate(backend.calls) if event in c.detail]
        assert recorded and recorded[0] < copies[0]

        other: list[int] = []
        worker = threading.Thread(target=lambda: other.append(conn.lookup_kv(list(range(9, 33)))))
        worker.start()
        worker.join(30)
        assert other == [0]  # another prompt does not wait for this store
        same: list[int] = []
        worker = threading.Thread(target=lambda: same.append(conn.lookup_kv(TOKENS)))
        worker.start()
        worker.join(0.2)
        assert same == []  # this prompt's lookup waits for the publication
        gate.set()
        worker.join(30)
        assert same == [24]
        _check_device_sums(conn.engine.tier)
        assert conn.lookup_kv(TOKENS, "r1") == 24
        dst = torch.arange(64, 88)
        assert conn.retrieve_kv(LoadMetadata(TOKENS, dst, request_id="r1")) == 24
        assert torch.equal(_rows(pool, dst), _rows(pool, src))
    finally:
        gate.set()
        conn.close()
