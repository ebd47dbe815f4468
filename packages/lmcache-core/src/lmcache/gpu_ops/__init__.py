# SPDX-License-Identifier: Apache-2.0
"""Device ops between an engine's paged KV and chunk-major staging, one typed wrapper per op.

Each wrapper runs the implementation that :func:`implementation` names for its tensors' device:
on CUDA the compiled ``torch.ops.lmcache`` ops (:mod:`lmcache.gpu_ops._cext`), else their Triton
port (:mod:`lmcache.gpu_ops._triton`: no nvcc needed), else vectorized torch
(:mod:`lmcache.gpu_ops._vectorized`, also what CPU and XPU tensors take); the pure-torch
reference :mod:`lmcache.gpu_ops._ref` is the oracle all of them match bit for bit. Every one but
the reference runs a fixed number of launches per call and never waits for the device. The
first op on a CUDA device without the compiled ops logs one WARNING (cause, fallback, fix).

A transfer of ``num_chunks`` chunks of a request, all layers, in one launch::

    kv = PagedKV.from_vllm(layer_caches, head_size_k)          # or from_sglang(...), ...
    slots = ...        # [num_tokens] int64 on the device: slot of each staged token, -1: skip
    offsets = ...      # [num_chunks + 1] int64 on the device: 0, n_0, n_0 + n_1, ...
    staging = torch.empty(num_tokens * kv.num_layers * kv.kv_width, dtype=kv.dtype, device=dev)
    sums = torch.empty(num_chunks, dtype=torch.int64, device=dev)
    gather_kv(kv, slots, offsets, staging, checksums=sums)
    # chunk c is staging[o_c * L * W : o_{c+1} * L * W], laid out [L, n_c, W] like its host
    # buffer: one DMA each; sums[c] % 2**64 == chunk_checksum(host_buffer_c)

The staging layout and the slot rules are defined in :mod:`lmcache.gpu_ops._ref`, the checksum
in :mod:`lmcache.gpu_ops.mix64sum`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache.gpu_ops import _cext, _dispatch, _ref, _vectorized
from lmcache.gpu_ops._checks import build_chunk_offsets, check_chunk_offsets, check_data_offsets
from lmcache.gpu_ops._dispatch import IMPLEMENTATIONS, implementation
from lmcache.gpu_ops._ref import CHECKSUM_NAME, CHECKSUM_VERSION, chunk_checksum

__all__ = [
    "CHECKSUM_NAME",
    "CHECKSUM_VERSION",
    "IMPLEMENTATIONS",
    "PagedKV",
    "build_chunk_offsets",
    "check_chunk_offsets",
    "check_data_offsets",
    "checksum_chunks",
    "chunk_checksum",
    "gather_kv",
    "gather_kv_layer",
    "implementation",
    "one_launch_ops",
    "scatter_kv",
    "scatter_kv_layer",
    "uses_cext",
]


@dataclass(frozen=True)
class PagedKV:
    """An engine's paged KV, per layer, as the ops take it.

    Attributes:
        k: Per layer, K as a ``[num_pages, page_size, heads, head_size_k]`` view of the engine's
            memory (any strides, last axis contiguous; every layer alike).
        v: The same for V (``head_size_v``), or empty for MLA (``k`` holds the latent).
    """

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...] = ()

    @classmethod
    def from_vllm(cls, layers: Sequence[torch.Tensor], head_size_k: int) -> PagedKV:
        """vLLM's per-layer ``[num_blocks, kv_heads, block_size, head_size_k + head_size_v]``
        views (K‖V on the last axis; physical order NHD or HND, read from the strides)."""
        _expect_dims("from_vllm", layers, 4, "[num_blocks, kv_heads, block_size, head_k + head_v]")
        k = tuple(t[..., :head_size_k].transpose(1, 2) for t in layers)
        v = tuple(t[..., head_size_k:].transpose(1, 2) for t in layers)
        return cls(k, v)

    @classmethod
    def from_vllm_mla(cls, layers: Sequence[torch.Tensor]) -> PagedKV:
        """vLLM's MLA layers, ``[num_blocks, block_size, latent]`` each."""
        _expect_dims("from_vllm_mla", layers, 3, "[num_blocks, block_size, latent]")
        return cls(tuple(t.unsqueeze(2) for t in layers))

    @classmethod
    def from_sglang(
        cls, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor]
    ) -> PagedKV:
        """SGLang's per-layer K and V pools: ``[slots, heads, head_dim]`` (NHD token pools) or
        ``[pages, heads, page_size, head_dim]`` (HND)."""
        return cls(_sglang_views(k_buffers), _sglang_views(v_buffers))

    @classmethod
    def from_sglang_mla(cls, buffers: Sequence[torch.Tensor]) -> PagedKV:
        """SGLang's MLA pool, ``[slots, 1, latent]`` per layer."""
        _expect_dims("from_sglang_mla", buffers, 3, "[slots, 1, latent]")
        return cls(tuple(t.unsqueeze(1) for t in buffers))

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_pages(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def page_size(self) -> int:
        return int(self.k[0].shape[1])

    @property
    def heads(self) -> int:
        return int(self.k[0].shape[2])

    @property
    def head_size_k(self) -> int:
        return int(self.k[0].shape[3])

    @property
    def head_size_v(self) -> int:
        return int(self.v[0].shape[3]) if self.v else 0

    @property
    def kv_width(self) -> int:
        """Elements of one token of one layer in a chunk: all K heads, then all V heads."""
        return self.heads * (self.head_size_k + self.head_size_v)

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device


def _expect_dims(what: str, layers: Sequence[torch.Tensor], dims: int, shape: str) -> None:
    if not layers:
        raise ValueError(f"PagedKV.{what}: expected at least one layer, found none.")
    for i, t in enumerate(layers):
        if t.dim() != dims:
            raise ValueError(
                f"PagedKV.{what}: expected layer {i} as {shape}, found shape {list(t.shape)}."
            )


def _sglang_views(buffers: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if not buffers:
        raise ValueError("PagedKV.from_sglang: expected at least one layer, found none.")
    views = []
    for i, t in enumerate(buffers):
        if t.dim() == 3:
            views.append(t.unsqueeze(1))  # [slots, 1, heads, dim]: page size 1
        elif t.dim() == 4:
            views.append(t.transpose(1, 2))  # [pages, page_size, heads, dim]
        else:
            raise ValueError(
                "PagedKV.from_sglang: expected layer buffers [slots, heads, head_dim] or [pages, "
                f"heads, page_size, head_dim], found layer {i} of shape {list(t.shape)}."
            )
    return tuple(views)


def uses_cext(device: torch.device | str) -> bool:
    """Whether ops on ``device`` run the compiled CUDA extension (loading it on first use).

    Whether the one-launch kernel path is open is :func:`one_launch_ops` (the Triton port
    counts there).

    Raises:
        CextUnavailableError: ``LMCACHE_REQUIRE_CEXT=1`` and the extension cannot load.
    """
    dev = torch.device(device)
    if dev.type == "cuda" or _cext.required():
        return _cext.load().loaded and dev.type == "cuda"
    return False


def one_launch_ops(device: torch.device | str) -> bool:
    """Whether gather, scatter and checksums on ``device`` run as the kernels do: a fixed
    number of launches per transfer, all chunks and layers at once, no host wait (the compiled
    kernels, or their Triton port).

    Connectors take their one-launch kernel path when this holds. Loads the extension (and
    probes Triton) on first use; without the compiled kernels it logs the one WARNING.

    Raises:
        CextUnavailableError: ``LMCACHE_REQUIRE_CEXT=1`` and the extension cannot load.
    """
    return _dispatch.resolve(device) in ("cuda-kernels", "triton")


def _staging_view(staging: torch.Tensor, kv: PagedKV) -> torch.Tensor:
    if staging.dtype == kv.dtype:
        return staging
    try:
        return staging.view(-1).view(kv.dtype)
    except RuntimeError as exc:
        raise ValueError(
            f"staging must be contiguous and hold whole {kv.dtype} elements (the KV dtype); "
            f"found {staging.dtype} of shape {list(staging.shape)} ({exc})."
        ) from exc


def _offsets(
    op: str, chunk_offsets: torch.Tensor | Sequence[int], device: torch.device, num_tokens: int
) -> torch.Tensor:
    """Chunk offsets as an int64 tensor on ``device``; host values are checked first."""
    if isinstance(chunk_offsets, torch.Tensor) and chunk_offsets.device.type != "cpu":
        return chunk_offsets  # built on the device: trusted (its builder checked it)
    values = _host_values(chunk_offsets)
    check_chunk_offsets(op, values, num_tokens)
    return torch.tensor(values, dtype=torch.int64, device=device)


def _host_values(offsets: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(offsets, torch.Tensor):
        return [int(x) for x in offsets.reshape(-1).tolist()]  # a CPU tensor: no device wait
    return [int(x) for x in offsets]


def _layer_args(
    kv: PagedKV, layers: range | None
) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    if layers is None:
        return list(kv.k), list(kv.v), 0
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= kv.num_layers:
        raise ValueError(
            f"layers must be a non-empty range(a, b) with 0 <= a < b <= {kv.num_layers}, found "
            f"{layers}."
        )
    k = list(kv.k[layers.start : layers.stop])
    v = list(kv.v[layers.start : layers.stop]) if kv.v else []
    return k, v, layers.start


def _run(
    name: str,
    kv: PagedKV,
    slots: torch.Tensor,
    chunk_offsets: torch.Tensor | Sequence[int],
    staging: torch.Tensor,
    checksums: torch.Tensor | None,
    layers: range | None,
    staging_full: bool,
    accumulate: bool,
    max_sms: int,
) -> None:
    k, v, first = _layer_args(kv, layers)
    stage = _staging_view(staging, kv)
    offsets = _offsets(name, chunk_offsets, stage.device, slots.numel())
    if checksums is not None and not accumulate:
        checksums.zero_()
    args: tuple[Any, ...] = (
        k,
        v,
        slots,
        offsets,
        stage,
        checksums,
        first,
        kv.num_layers,
        staging_full,
        max_sms,
    )
    _call(name, stage.device, args)


def _call(name: str, device: torch.device, args: tuple[Any, ...]) -> None:
    """Run op ``name`` with the implementation :func:`implementation` names for ``device``."""
    impl = _dispatch.resolve(device)
    if impl == "cuda-kernels":
        getattr(torch.ops.lmcache, name).default(*args)
    elif impl == "triton":
        from lmcache.gpu_ops import _triton

        try:
            getattr(_triton, name)(*args)
        except ValueError:
            raise  # an argument error: the same from every implementation
        except Exception as exc:  # a compile or launch failure: fall back, say so once
            _dispatch.triton_failed(device, exc)
            getattr(_vectorized, name)(*args)
    elif impl == "torch-vectorized":
        getattr(_vectorized, name)(*args)
    else:
        getattr(_ref, name)(*args)


def gather_kv(
    kv: PagedKV,
    slots: torch.Tensor,
    chunk_offsets: torch.Tensor | Sequence[int],
    staging: torch.Tensor,
    *,
    checksums: torch.Tensor | None = None,
    layers: range | None = None,
    staging_full: bool = False,
    accumulate: bool = False,
    max_sms: int = 0,
) -> None:
    """Copy the KV of the staged tokens from the paged cache into chunk-major staging.

    Args:
        kv: The paged KV (:class:`PagedKV`).
        slots: ``[num_tokens]`` int64 on the staging's device: the slot of each staged token;
            ``< 0`` skips it (its staging rows are left as they are).
        chunk_offsets: ``[num_chunks + 1]`` int64 staging token offsets, non-decreasing from 0
            to ``num_tokens``. A list or CPU tensor is checked here, before any launch, then
            uploaded; a device tensor is trusted (its builder checks it on the host: reading it
            back would wait for the device).
        staging: Contiguous device buffer of ``num_tokens * layers * kv.kv_width`` KV elements
            (or the same bytes in another dtype); chunk ``c`` is ``[layers, n_c, kv_width]``.
        checksums: ``[num_chunks]`` int64, or ``None``: receives each chunk's checksum (of the
            moved layers; of the whole chunk once every layer has been moved).
        layers: Layers to move (default all); the first is the chunk's layer ``layers.start``.
        staging_full: Staging holds all layers of each chunk (else only those of ``layers``).
        accumulate: Add to ``checksums`` (later layers of the same chunks) instead of
            overwriting them.
        max_sms: Use at most this many SMs (0: all).

    Raises:
        ValueError: host ``chunk_offsets`` are malformed (before any launch), or (torch and
            Triton ops) an argument does not match; RuntimeError from the CUDA op. Each says
            what was expected and what was found.
        CextUnavailableError: ``LMCACHE_REQUIRE_CEXT=1`` and the extension cannot load.
    """
    _run(
        "gather_kv",
        kv,
        slots,
        chunk_offsets,
        staging,
        checksums,
        layers,
        staging_full,
        accumulate,
        max_sms,
    )


def scatter_kv(
    kv: PagedKV,
    slots: torch.Tensor,
    chunk_offsets: torch.Tensor | Sequence[int],
    staging: torch.Tensor,
    *,
    checksums: torch.Tensor | None = None,
    layers: range | None = None,
    staging_full: bool = False,
    accumulate: bool = False,
    max_sms: int = 0,
) -> None:
    """Copy chunk-major staging into the paged cache: :func:`gather_kv` in reverse.

    Slots ``< 0`` (e.g. tokens the engine already holds) are not written. ``checksums``
    receive the checksums of the staged bytes of the moved layers, skipped tokens included
    (compare them with the stored ones to verify whole chunks).
    """
    _run(
        "scatter_kv",
        kv,
        slots,
        chunk_offsets,
        staging,
        checksums,
        layers,
        staging_full,
        accumulate,
        max_sms,
    )


def gather_kv_layer(
    kv: PagedKV,
    layer: int,
    slots: torch.Tensor,
    chunk_offsets: torch.Tensor | Sequence[int],
    staging: torch.Tensor,
    **kwargs: Any,
) -> None:
    """:func:`gather_kv` of one layer (layerwise store); keyword arguments as there."""
    gather_kv(kv, slots, chunk_offsets, staging, layers=range(layer, layer + 1), **kwargs)


def scatter_kv_layer(
    kv: PagedKV,
    layer: int,
    slots: torch.Tensor,
    chunk_offsets: torch.Tensor | Sequence[int],
    staging: torch.Tensor,
    **kwargs: Any,
) -> None:
    """:func:`scatter_kv` of one layer (layerwise load); keyword arguments as there."""
    scatter_kv(kv, slots, chunk_offsets, staging, layers=range(layer, layer + 1), **kwargs)


def checksum_chunks(
    data: torch.Tensor,
    offsets: torch.Tensor | Sequence[int],
    *,
    unit_bytes: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Checksums of byte ranges of ``data``: chunk ``c`` is bytes ``[offsets[c] * unit_bytes,
    offsets[c + 1] * unit_bytes)``.

    Args:
        data: Contiguous tensor of any dtype (e.g. staging just copied from the host).
        offsets: ``[num_chunks + 1]`` int64, non-decreasing, within the data. A list or CPU
            tensor is checked here, before any launch; a device tensor is trusted.
        unit_bytes: Bytes per offset unit.
        out: ``[num_chunks]`` int64 to write, or ``None`` (allocated).

    Returns:
        ``out``: the checksums as int64 bits (``v % 2**64`` equals :func:`chunk_checksum`).
    """
    offs = offsets
    if not isinstance(offs, torch.Tensor) or offs.device.type == "cpu":
        values = _host_values(offs)
        check_data_offsets("checksum_chunks", values, data, unit_bytes)
        offs = torch.tensor(values, dtype=torch.int64, device=data.device)
    if out is None:
        out = torch.empty(max(offs.numel() - 1, 0), dtype=torch.int64, device=data.device)
    _call("checksum_chunks", data.device, (data, offs, unit_bytes, out))
    return out
