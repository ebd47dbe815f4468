# SPDX-License-Identifier: Apache-2.0
"""lmcache_sglang is a skeleton: it imports cleanly, exports nothing and registers no entry point."""

from __future__ import annotations

from importlib.metadata import distribution

import lmcache_sglang


def test_public_api_is_pinned() -> None:
    assert lmcache_sglang.__all__ == []


def test_declares_no_entry_points_until_code_exists() -> None:
    assert list(distribution("lmcache-sglang").entry_points) == []
