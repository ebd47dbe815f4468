# SPDX-License-Identifier: Apache-2.0
"""lmcache_xpu's public surface, and the entry points its pyproject declares."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import lmcache_xpu

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_public_api_is_pinned() -> None:
    assert lmcache_xpu.__all__ == ["XpuBackend", "register"]
    from lmcache_xpu.device import XpuBackend, register

    assert lmcache_xpu.XpuBackend is XpuBackend
    assert lmcache_xpu.register is register


def test_declared_entry_points_resolve_to_callables() -> None:
    """The venvs' entry points come from an installed copy; this checks the source's own."""
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    eps = project["entry-points"]
    assert eps["lmcache.devices"] == {"xpu": "lmcache_xpu.device:register"}
    assert eps["lmcache.gpu_connectors"] == {
        "vllm.xpu": "lmcache_xpu.connectors:select_vllm",
        "sglang.xpu": "lmcache_xpu.connectors:select_sglang",
    }
    for group in eps.values():
        for target in group.values():
            module, _, attr = target.partition(":")
            assert callable(getattr(importlib.import_module(module), attr)), target


def test_no_engine_dependency() -> None:
    """`lmcache-core[xpu]` pulls this package: it must never pull an engine."""
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    assert project["dependencies"] == ["lmcache-core>=0.1.0,<0.2"]
    assert "optional-dependencies" not in project
