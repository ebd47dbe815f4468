# SPDX-License-Identifier: Apache-2.0
"""lmcache on Intel GPUs (XPU): the ``torch.xpu`` device backend and the ``*.xpu`` connector keys.

- :mod:`lmcache_xpu.device`: :class:`XpuBackend`, the :class:`lmcache.devices.DeviceBackend` of
  ``xpu`` devices (device of a local rank, streams, events, pinned host memory where torch offers
  it for XPU, copies, synchronize), registered by the ``lmcache.devices`` entry point
  ``xpu = "lmcache_xpu.device:register"``.
- :mod:`lmcache_xpu.connectors`: the ``vllm.xpu`` and ``sglang.xpu`` keys of the
  ``lmcache.gpu_connectors`` entry points: lmcache-vllm's and lmcache-sglang's connector classes,
  unchanged, reaching the XPU through :class:`XpuBackend` (no class copied or subclassed).
- :mod:`lmcache_xpu.testing`: a recording stand-in for ``torch.xpu`` that runs the whole path on
  CPU tensors (what the tests use: this package has never run on XPU hardware).

No engine is imported or required; an XPU engine's adapter (lmcache-vllm or lmcache-sglang) is
imported when its ``*.xpu`` key is first used.
"""

from __future__ import annotations

from lmcache_xpu.device import XpuBackend, register

__all__ = ["XpuBackend", "register"]
