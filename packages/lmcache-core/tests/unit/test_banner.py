# SPDX-License-Identifier: Apache-2.0
"""lmcache's start-up line (``lmcache.banner``): its text, once per process, never an error."""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterator

import pytest

import lmcache
from lmcache import banner, gpu_ops
from lmcache.gpu_ops import _cext


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts as a process that has logged no start-up line."""
    monkeypatch.setattr(banner, "_logged", set())
    yield


def test_line_names_packages_engine_device_and_kernels() -> None:
    line = banner.banner_line("vLLM", "0.32.0", "lmcache-vllm", "cpu")
    core = importlib.metadata.version("lmcache-core")
    vllm_adapter = banner.dist_version("lmcache-vllm")
    assert line == (
        f"lmcache {lmcache.__version__} (lmcache-core {core}, lmcache-vllm {vllm_adapter}) "
        "serves vLLM 0.32.0 on cpu: kernels: "
        f"{banner.kernels_for('cpu')}"
    )
    assert line.endswith("(CPU path, no CUDA kernels)")
    hooked = banner.banner_line("SGLang", "0.5.23", "lmcache-sglang", "cpu", hook="linker")
    assert " serves SGLang 0.5.23 (linker) on cpu: kernels: " in hooked


def test_missing_distribution_is_named() -> None:
    assert banner.dist_version("lmcache-no-such-dist") == "not installed"


def test_kernels_name_where_compiled_kernels_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled kernels add their source (wheel or JIT) and the GPU code they hold."""
    monkeypatch.setattr(gpu_ops, "implementation", lambda device: "cuda-kernels")
    loaded = _cext.CextStatus(
        True, "wheel", "/x/liblmcache_kernels.so", 0.1, ("sm_90", "compute_120")
    )
    monkeypatch.setattr(_cext, "_STATUS", loaded)
    assert banner.kernels_for("cuda:0") == "cuda-kernels (wheel: sm_90, compute_120)"
    monkeypatch.setattr(gpu_ops, "implementation", lambda device: "triton")
    assert banner.kernels_for("cuda:0") == "triton"


def test_kernels_from_gpu_ops_implementation(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def implementation(device: object) -> str:
        seen.append(device)
        return "torch-vectorized" if str(device) == "cpu" else "triton"

    monkeypatch.setattr(gpu_ops, "implementation", implementation)
    assert banner.kernels_for("cuda:1") == "triton"
    assert banner.kernels_for("cpu") == "torch-vectorized (CPU path, no CUDA kernels)"
    assert [str(d) for d in seen] == ["cuda:1", "cpu"]

    def broken(device: object) -> str:
        raise RuntimeError("no driver")

    monkeypatch.setattr(gpu_ops, "implementation", broken)
    assert banner.kernels_for("cuda:0") == "unknown (RuntimeError: no driver)"


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if " serves " in r.getMessage()]


def test_logged_once_per_process_and_engine(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lmcache.banner"):
        assert banner.log_banner("vLLM", "0.32.0", "lmcache-vllm", "cpu")
        assert not banner.log_banner("vLLM", "0.32.0", "lmcache-vllm", "cpu")
        assert not banner.log_banner("vLLM", "0.32.0", "lmcache-vllm", "cuda:0")
        assert banner.log_banner("SGLang", "0.5.23", "lmcache-sglang", "cpu", hook="linker")
        assert banner.log_banner("SGLang", "0.5.23", "lmcache-sglang", "cpu", hook="hicache")
        assert not banner.log_banner("SGLang", "0.5.23", "lmcache-sglang", "cpu", hook="linker")
    lines = _lines(caplog)
    assert len(lines) == 3
    assert [r.levelno for r in caplog.records] == [logging.INFO] * 3
    assert "serves vLLM 0.32.0 on cpu" in lines[0]


def test_given_logger_is_used(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("vllm.lmcache_vllm_test")
    with caplog.at_level(logging.INFO, logger=log.name):
        banner.log_banner("vLLM", "0.32.0", "lmcache-vllm", "cpu", log=log)
    assert [r.name for r in caplog.records] == [log.name]


def test_lmcache_log_level_above_info_drops_it(caplog: pytest.LogCaptureFixture) -> None:
    """``LMCACHE_LOG_LEVEL=WARNING`` sets lmcache's loggers' level: the line goes with them,
    even through another logger."""
    root = logging.getLogger("lmcache")
    before = root.level
    root.setLevel(logging.WARNING)
    try:
        log = logging.getLogger("vllm.lmcache_vllm_test")
        with caplog.at_level(logging.INFO, logger=log.name):
            assert not banner.log_banner("vLLM", "0.32.0", "lmcache-vllm", "cpu", log=log)
    finally:
        root.setLevel(before)
    assert not _lines(caplog)


def test_a_line_that_cannot_be_composed_is_skipped(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object, **kwargs: object) -> str:
        raise RuntimeError("metadata is broken")

    monkeypatch.setattr(banner, "banner_line", boom)
    with caplog.at_level(logging.INFO, logger="lmcache.banner"):
        assert not banner.log_banner("vLLM", "0.32.0", "lmcache-vllm", "cpu")
    assert not _lines(caplog)
