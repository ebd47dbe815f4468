# SPDX-License-Identifier: Apache-2.0
"""lmcache's start-up line from the SGLang hooks: one per hook and process, SGLang's version."""

from __future__ import annotations

import logging
import sys
from types import SimpleNamespace

import pytest

from lmcache import banner
from lmcache_sglang.hook_config import log_start_line


def test_one_line_per_hook_and_process(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(banner, "_logged", set())
    monkeypatch.setitem(sys.modules, "sglang", SimpleNamespace(__version__="0.5.23"))
    with caplog.at_level(logging.INFO, logger="lmcache.banner"):
        assert log_start_line("UnifiedCacheLinker", "cpu")
        assert not log_start_line("UnifiedCacheLinker", "cpu")  # a second linker
        assert log_start_line("HiCache storage backend", "cpu")
    lines = [r.getMessage() for r in caplog.records if " serves SGLang " in r.getMessage()]
    assert len(lines) == 2, lines
    assert " serves SGLang 0.5.23 (UnifiedCacheLinker) on cpu: kernels: " in lines[0]
    assert lines[0].endswith("(CPU path, no CUDA kernels)")
    assert " (lmcache-core " in lines[0] and ", lmcache-sglang " in lines[0]
    assert " serves SGLang 0.5.23 (HiCache storage backend) on cpu: " in lines[1]


def test_without_sglang_imported_reads_its_metadata(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(banner, "_logged", set())
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    with caplog.at_level(logging.INFO, logger="lmcache.banner"):
        log_start_line("--enable-lmcache", "cpu")
    (line,) = [r.getMessage() for r in caplog.records if " serves SGLang " in r.getMessage()]
    assert f" serves SGLang {banner.dist_version('sglang')} (--enable-lmcache) on cpu" in line
