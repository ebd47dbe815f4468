# SPDX-License-Identifier: Apache-2.0
"""lmcache's start-up line from the vLLM connector: one per process, through vLLM's logger,
however many connectors (scheduler and worker sides, several engines) the process builds."""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from lmcache import banner
from lmcache_vllm import vllm_v1_adapter as adapter


class Records(logging.Handler):
    """Keeps the start-up lines it sees."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if " serves vLLM " in record.getMessage():
            self.records.append(record)


@pytest.fixture
def start_lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[logging.LogRecord]]:
    """The start-up lines logged in a process that has logged none yet.

    The handler sits on the banner logger itself: once real vLLM configured its logging in this
    process, its ``vllm`` logger no longer propagates to the root logger (and caplog).
    """
    monkeypatch.setattr(banner, "_logged", set())
    handler = Records()
    log = adapter.BANNER_LOGGER
    log.addHandler(handler)
    before = log.level
    log.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        log.removeHandler(handler)
        log.setLevel(before)


def _vllm_config(rank: int = 0, tp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_role="kv_both",
            engine_id="e",
            kv_connector_extra_config={"lmcache.chunk_size": 64},
            kv_load_failure_policy="fail",
        ),
        cache_config=SimpleNamespace(block_size=16),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp, pipeline_parallel_size=1, rank=rank
        ),
        instance_id="i0",
    )


def _connector(role: str, cfg: SimpleNamespace | None = None) -> adapter.LMCacheConnectorV1Impl:
    impl = adapter.LMCacheConnectorV1Impl(cfg or _vllm_config(), SimpleNamespace(name=role), None)
    impl.shutdown()
    return impl


def test_one_line_per_process(start_lines: list[logging.LogRecord]) -> None:
    for role in ("WORKER", "SCHEDULER", "WORKER", "SCHEDULER"):
        _connector(role)
    assert len(start_lines) == 1, [r.getMessage() for r in start_lines]
    (record,) = start_lines
    assert record.levelno == logging.INFO
    assert record.name == "vllm.lmcache_vllm"
    core = importlib.metadata.version("lmcache-core")
    ours = importlib.metadata.version("lmcache-vllm")
    message = record.getMessage()
    assert message.startswith(f"lmcache {core} (lmcache-core {core}, lmcache-vllm {ours}) serves ")
    # Without a GPU (and without vLLM, or vLLM's CPU build) the KV lives on the CPU.
    assert " on cpu: kernels: " in message
    assert message.endswith("(CPU path, no CUDA kernels)")


def test_engine_version_is_vllms(start_lines: list[logging.LogRecord]) -> None:
    try:
        import vllm

        expected = vllm.__version__
    except ImportError:
        expected = "not installed"
    _connector("SCHEDULER")
    (record,) = start_lines
    assert f" serves vLLM {expected} on " in record.getMessage()


def test_gpu_worker_names_its_local_device(
    start_lines: list[logging.LogRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU worker names ``cuda:<local rank>``; the kernels come from ``lmcache.gpu_ops``."""
    monkeypatch.setattr(adapter, "get_vllm_torch_dev", lambda: ("cuda", None))
    monkeypatch.setattr(banner, "kernels_for", lambda device: f"test-kernels for {device}")
    assert adapter.log_start_line(_vllm_config(rank=1, tp=2), is_worker=True)
    (record,) = start_lines
    assert record.getMessage().endswith(" on cuda:1: kernels: test-kernels for cuda:1")


def test_scheduler_on_gpu_names_the_device_kind(
    start_lines: list[logging.LogRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(adapter, "get_vllm_torch_dev", lambda: ("cuda", None))
    monkeypatch.setattr(banner, "kernels_for", lambda device: "unknown")
    assert adapter.log_start_line(_vllm_config(), is_worker=False)
    (record,) = start_lines
    assert record.getMessage().endswith(" on cuda: kernels: unknown")


def test_never_stops_a_connector(
    start_lines: list[logging.LogRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken() -> tuple[str, object]:
        raise RuntimeError("no platform")

    def no_line(*args: object, **kwargs: object) -> str:
        raise RuntimeError("broken metadata")

    monkeypatch.setattr(adapter, "get_vllm_torch_dev", broken)
    monkeypatch.setattr(banner, "banner_line", no_line)
    assert _connector("SCHEDULER").scheduler is not None
    assert start_lines == []
