# SPDX-License-Identifier: Apache-2.0
"""lmcache_xpu is a skeleton: it imports cleanly, exports nothing and registers no entry point."""

from __future__ import annotations

from importlib.metadata import distribution

import lmcache_xpu


def test_public_api_is_pinned() -> None:
    assert lmcache_xpu.__all__ == []


def test_declares_no_entry_points_until_code_exists() -> None:
    assert list(distribution("lmcache-xpu").entry_points) == []
