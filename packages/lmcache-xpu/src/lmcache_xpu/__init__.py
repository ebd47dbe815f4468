# SPDX-License-Identifier: Apache-2.0
"""lmcache device support for Intel GPUs (XPU) (skeleton).

This package will hold XPU device detection, streams/events, host memory and copy ops, registered
through the ``lmcache.devices`` entry point and injected into the engines' ``*.xpu`` connectors.

Nothing is registered yet: it declares no entry point until working code stands behind it.
"""

from __future__ import annotations

__all__: list[str] = []
