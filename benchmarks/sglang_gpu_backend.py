# SPDX-License-Identifier: Apache-2.0
"""``sglang_gpu.py --backend-only``: lmcache's HiCache backend alone, as SGLang's threads call it.

No engine starts: a host pool in each HiCache layout (``kv_buffer`` as SGLang allocates it,
pinned when CUDA is present, the attributes the backend reads) is registered with
``LMCacheHiCacheStorage`` (built from a plain config object, so any SGLang version serves), and a
prompt's pages are backed up and prefetched the way HiCache's controller does it: batches of 128
pages, ``batch_set_v1`` then ``batch_exists`` + ``batch_get_v1`` (zero-copy), or SGLang's
``get_data_page`` / flat ``batch_set`` and flat ``batch_get`` / ``set_from_flat_data_page``
(``layer_first`` flat). Each figure is a median of ``--reps`` passes over new pages, beside a
host memcpy of the same bytes.

``busy`` runs each pass again while another Python thread spins, as SGLang's scheduler thread
does while a request waits for its prefetch: every call that releases the GIL (a torch op, a
thread hand-off) may then wait up to the interpreter's switch interval (5 ms) to get it back,
so the figure shows how many such calls a path makes.
"""

from __future__ import annotations

import statistics
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch

PAGE, BATCH = 16, 128
LAYOUTS = ("page_first", "page_first_direct", "layer_first")


class HostPool:
    """What the backend reads of SGLang's ``MHATokenToKVPoolHost`` (and SGLang's own flat-page
    methods, for the flat path)."""

    def __init__(self, layout: str, layers: int, slots: int, pin: bool) -> None:
        self.layout, self.layer_num, self.page_size = layout, layers, PAGE
        self.head_num, self.head_dim, self.v_head_dim = 8, 128, 128
        self.dtype = torch.bfloat16
        dims = {
            "layer_first": (2, layers, slots, 8, 128),
            "page_first": (2, slots, layers, 8, 128),
            "page_first_direct": (2, slots // PAGE, layers, PAGE, 8, 128),
        }[layout]
        self.kv_buffer = torch.empty(dims, dtype=self.dtype, pin_memory=pin).normal_()
        self.pin = pin

    def _page(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + PAGE]
        if self.layout == "page_first":
            return self.kv_buffer[:, index : index + PAGE]
        return self.kv_buffer[:, index // PAGE : index // PAGE + 1]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self._page(index).flatten()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        n = 2 * self.layer_num * PAGE * 8 * 128
        return torch.zeros(n, dtype=self.dtype, pin_memory=self.pin)

    def set_from_flat_data_page(self, index: int, page: torch.Tensor) -> None:
        view = self._page(index)
        view.copy_(page.view(view.shape))


def _backend(pool: HostPool, flat: bool, checksum: bool, cpu_gb: float) -> Any:
    from lmcache_sglang.hicache_backend import LMCacheHiCacheStorage

    extra = {"interface_v1": 0 if flat else 1, "max_local_cpu_size": cpu_gb}
    extra["checksum"] = checksum
    config = SimpleNamespace(model_name="/models/bench", is_mla_model=False, extra_config=extra)
    backend = LMCacheHiCacheStorage(config)
    backend.register_mem_pool_host(pool)
    return backend


def _pass(backend: Any, pool: HostPool, keys: list[str], flat: bool) -> tuple[float, float]:
    """Seconds to back up then prefetch ``keys`` (one page each, host slots in order)."""
    idx = torch.arange(len(keys) * PAGE, dtype=torch.int64)
    t = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        ks = keys[i : i + BATCH]
        if flat:
            ok = backend.batch_set(ks, [pool.get_data_page((i + j) * PAGE) for j in range(len(ks))])
        else:
            ok = all(backend.batch_set_v1(ks, idx[i * PAGE : (i + len(ks)) * PAGE]))
        assert ok, "a backup failed"
    stored = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        ks = keys[i : i + BATCH]
        assert backend.batch_exists(ks) == len(ks)
        if flat:
            pages = backend.batch_get(ks, [pool.get_dummy_flat_data_page() for _ in ks])
            for j, page in enumerate(pages):
                pool.set_from_flat_data_page((i + j) * PAGE, page)
        else:
            assert all(backend.batch_get_v1(ks, idx[i * PAGE : (i + len(ks)) * PAGE]))
    return stored, time.perf_counter() - t


def run(tokens: int, layers: int, reps: int) -> None:
    """Print backup and prefetch GB/s per layout (checksums on and off, idle and busy)."""
    from lmcache.tiers import reset_process_cpu_tiers

    pin = torch.cuda.is_available()
    pages = tokens // PAGE
    nbytes = pages * PAGE * layers * 2 * 8 * 128 * 2
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).random_(0, 255)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 2):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    memcpy = statistics.median(times[2:])
    del src, dst
    print(
        f"backend alone: {pages} pages ({nbytes / 2**20:.0f} MiB, {layers} layers), batches of "
        f"{BATCH}, host memcpy {nbytes / memcpy / 1e9:.1f} GB/s ({1e3 * memcpy:.1f} ms); "
        f"median of {reps} passes, GB/s (ms)"
    )
    # 1.5 passes fit: later passes reuse evicted buffers (pageable memory a pass touched first
    # would cost page faults an engine's pool pays once)
    cpu_gb = 1.5 * nbytes / 2**30
    spin = {"on": False}

    def _spin() -> None:
        x = 0
        while True:
            if spin["on"]:
                x += 1
            else:
                time.sleep(0.001)

    threading.Thread(target=_spin, daemon=True).start()
    for layout, flat in [(x, False) for x in LAYOUTS] + [("layer_first", True)]:
        pool = HostPool(layout, layers, pages * PAGE + PAGE, pin)
        for checksum in (True, False):
            reset_process_cpu_tiers()
            backend = _backend(pool, flat, checksum, cpu_gb)
            cells = []
            for busy in (False, True):
                spin["on"] = busy
                got = [
                    _pass(backend, pool, [f"{layout}{busy}{r}-{i}" for i in range(pages)], flat)
                    for r in range(reps + 1)
                ][1:]
                spin["on"] = False
                st, ld = (statistics.median(x) for x in zip(*got, strict=True))
                cells.append(
                    f"{'busy' if busy else 'idle'}: backup {nbytes / st / 1e9:.2f} "
                    f"({1e3 * st:.0f}), prefetch {nbytes / ld / 1e9:.2f} ({1e3 * ld:.0f})"
                )
            backend.close()
            name = f"{layout}{' flat' if flat else ''}, checksum {'on' if checksum else 'off'}"
            print(f"  {name:<34} " + "; ".join(cells), flush=True)
