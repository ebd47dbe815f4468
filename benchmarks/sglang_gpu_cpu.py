# SPDX-License-Identifier: Apache-2.0
"""Stand-ins that let SGLang's HiCache run on its CPU engine, for ``sglang_gpu.py --device cpu``.

SGLang 0.5.23's HiCache host pool registers its buffer with CUDA (``cudaHostRegister``) and
moves pages between the device pool and the host pool with ``sgl_kernel.kvcacheio`` ops, which
have no CPU build. On the CPU engine the "device" pool is host memory too, so this module:

- allocates the host pool unpinned (:func:`_unpinned`), and
- replaces ``MHATokenToKVPoolHost.backup_from_device_all_layer`` and
  ``load_to_device_per_layer`` with torch indexing over the per-layer views SGLang builds
  (``k_data_refs`` / ``v_data_refs``) in every layout and I/O backend.

Everything else (the cache controller's threads, its prefetch and backup queues, the storage
backends, the radix tree) is SGLang's own code. The copies here are host-to-host at memory
speed: a HiCache figure on the CPU measures SGLang's storage path and the backend, not PCIe.
Benchmark-only: :func:`apply` is called in SGLang's scheduler process (the benchmark script
imported as ``__mp_main__``), never by lmcache.
"""

from __future__ import annotations

from typing import Any

import torch


def _unpinned(
    dims: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    # nothing to pin or register without CUDA; zeros so that a stray read is deterministic
    return torch.zeros(dims, dtype=dtype, device=device)


def _views(pool: Any, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(host view, device buffer)]`` of ``layer``'s K and V: host views are ``[slots, H,
    D]`` (``layer_first``, ``page_first``) or ``[pages, page_size, H, D]``
    (``page_first_direct``)."""
    return [
        (pool.k_data_refs[layer], pool.device_k_buffers[layer]),
        (pool.v_data_refs[layer], pool.device_v_buffers[layer]),
    ]


def _host_index(pool: Any, view: torch.Tensor, host_indices: torch.Tensor) -> tuple[Any, ...]:
    if view.dim() == 4:  # page_first_direct: [pages, page_size, H, D]
        return (host_indices // pool.page_size, host_indices % pool.page_size)
    return (host_indices,)


def _backup(
    self: Any, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor, io: str
) -> None:
    host_indices, device_indices = host_indices.long(), device_indices.long()
    for layer in range(self.layer_num):
        for view, dev in _views(self, layer):
            view[_host_index(self, view, host_indices)] = dev[device_indices]


def _load(
    self: Any,
    device_pool: Any,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    layer_id: int,
    io_backend: str,
    *,
    is_draft: bool = False,
) -> None:
    if not is_draft and not 0 <= layer_id < self.target_layer_num:
        return
    host_indices, device_indices = host_indices.long(), device_indices.long()
    for view, dev in _views(self, layer_id):
        dev[device_indices] = view[_host_index(self, view, host_indices)]


def apply() -> None:
    """Patch SGLang's HiCache host pool for the CPU engine (see the module docstring)."""
    from sglang.srt.mem_cache.pool_host import base, common, mha

    common.ALLOC_MEMORY_FUNCS["cpu"] = _unpinned
    init = base.HostKVCache.__init__

    def _init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["pin_memory"] = False  # torch cannot pin without CUDA
        init(self, *args, **kwargs)

    base.HostKVCache.__init__ = _init
    mha.MHATokenToKVPoolHost.backup_from_device_all_layer = _backup
    mha.MHATokenToKVPoolHost.load_to_device_per_layer = _load
