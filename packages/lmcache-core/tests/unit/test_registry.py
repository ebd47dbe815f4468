# SPDX-License-Identifier: Apache-2.0
"""The GPU connector registry: keys, duplicates, entry-point discovery, CreateGPUConnector."""

from __future__ import annotations

import importlib.metadata
import logging
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from lmcache._install_hint import adapter_install_command
from lmcache.config import LMCacheConfig
from lmcache.gpu_connector import (
    ChunkTransfer,
    CreateGPUConnector,
    EngineInfo,
    KVLayoutError,
    TransferSpec,
    register_gpu_connector,
    registered_gpu_connectors,
)
from lmcache.gpu_connector import registry as registry_mod
from lmcache.metadata import LMCacheMetadata
from lmcache.testing.paged_cpu_connector import PagedCPUConnector

MOCK_TARGET = "lmcache.testing.paged_cpu_connector:select"
META = LMCacheMetadata(
    model_name="m",
    world_size=1,
    worker_id=0,
    local_worker_id=0,
    local_world_size=1,
    kv_dtype=torch.float32,
    num_layers=2,
    num_kv_heads=2,
    head_size_k=4,
    head_size_v=4,
    chunk_size=4,
)
CONFIG = LMCacheConfig(chunk_size=4)


def _engine(name: str = "mock", device: str = "cpu", page_size: int = 4) -> EngineInfo:
    caches = [torch.randn(5, page_size, META.kv_width) for _ in range(META.num_layers)]
    return EngineInfo(name=name, device=device, kv_caches=caches, extra={"page_size": page_size})


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("LMCACHE_PLUGINS", raising=False)
    monkeypatch.delenv("LMCACHE_PLUGIN_AUTOLOAD", raising=False)
    registry_mod._reset_for_tests()
    yield
    registry_mod._reset_for_tests()


def _fake_dist(
    site: Path,
    dist: str,
    entry_points: dict[str, str],
    *,
    engine_requires: Sequence[str] = (),
    module_source: str | None = None,
) -> None:
    """Write ``<dist>-1.0.dist-info`` (and optionally a module) under ``site``."""
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {dist}", "Version: 1.0"]
    if engine_requires:
        lines.append("Provides-Extra: engine")
        lines += [f'Requires-Dist: {req}; extra == "engine"' for req in engine_requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    eps = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[lmcache.gpu_connectors]\n{eps}")
    if module_source is not None:
        (site / f"{dist.replace('-', '_')}.py").write_text(module_source)


PLUGIN_SOURCE = (
    "from lmcache.testing.paged_cpu_connector import PagedCPUConnector\n\n"
    "def select(config, metadata, engine, layout_hints):\n"
    "    return PagedCPUConnector\n"
)


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    before = set(sys.modules)
    yield path
    for name in set(sys.modules) - before:
        if name.startswith("lmc_fake"):
            del sys.modules[name]


def test_register_and_create_round_trips_through_the_connector() -> None:
    register_gpu_connector("mock.cpu", MOCK_TARGET)
    engine = _engine()
    connector = CreateGPUConnector(CONFIG, META, engine)
    assert type(connector) is PagedCPUConnector
    assert connector.engine is engine and connector.config is CONFIG and connector.metadata is META
    slots = torch.tensor([3, 17, 0, 9, 12])
    buf = torch.zeros(connector.chunk_shape(5))
    connector.from_gpu([ChunkTransfer(0, 5, buf)], TransferSpec(slots))
    flat = [c.reshape(-1, META.kv_width) for c in engine.kv_caches]
    assert torch.equal(buf, torch.stack([f[slots] for f in flat]))


def test_registered_view_is_read_only_and_live() -> None:
    view = registered_gpu_connectors()
    assert isinstance(view, MappingProxyType)
    with pytest.raises(TypeError):
        view["x.y"] = "a:b"  # type: ignore[index]
    register_gpu_connector("mock.cpu", MOCK_TARGET)
    assert view["mock.cpu"] == MOCK_TARGET


def test_unknown_key_lists_registered_and_names_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # Hermetic: adapters installed in this environment (lmcache-vllm registers vllm.cuda) stay out.
    monkeypatch.setenv("LMCACHE_PLUGIN_AUTOLOAD", "0")
    registry_mod._reset_for_tests()
    register_gpu_connector("mock.cpu", MOCK_TARGET)
    with pytest.raises(ValueError) as excinfo:
        CreateGPUConnector(CONFIG, META, _engine(name="vllm", device="cuda"))
    assert str(excinfo.value) == (
        "No GPU connector for 'vllm.cuda'. Registered: ['mock.cpu']. "
        f"Install lmcache-vllm: {adapter_install_command('vllm')}."
    )
    assert "./dist/lmcache_vllm-" in str(excinfo.value)


def test_duplicate_rejected_naming_both_and_clobber_replaces() -> None:
    register_gpu_connector("mock.cpu", MOCK_TARGET)
    register_gpu_connector("mock.cpu", MOCK_TARGET)  # same target: idempotent
    with pytest.raises(ValueError) as excinfo:
        register_gpu_connector("mock.cpu", "other_mod:select")
    assert MOCK_TARGET in str(excinfo.value) and "other_mod:select" in str(excinfo.value)
    assert "clobber=True" in str(excinfo.value)
    register_gpu_connector("mock.cpu", "other_mod:select", clobber=True)
    assert registered_gpu_connectors()["mock.cpu"] == "other_mod:select"


@pytest.mark.parametrize("key", ["mock", "mock.", ".cpu", "a.b.c"])
def test_malformed_key_rejected(key: str) -> None:
    with pytest.raises(ValueError, match=r"<engine>\.<device>"):
        register_gpu_connector(key, MOCK_TARGET)


def test_malformed_target_rejected() -> None:
    with pytest.raises(ValueError, match="module:attr"):
        register_gpu_connector("mock.cpu", "lmcache.testing.paged_cpu_connector.select")


def test_selector_declining_raises_layout_error() -> None:
    register_gpu_connector("mock.gpu", MOCK_TARGET)  # the mock selector declines non-CPU devices
    with pytest.raises(KVLayoutError, match=r"'mock.gpu' \(lmcache.testing.*\) declined"):
        CreateGPUConnector(CONFIG, META, _engine(device="gpu"))


def test_layout_error_from_constructor_propagates() -> None:
    register_gpu_connector("mock.cpu", MOCK_TARGET)
    engine = EngineInfo("mock", "cpu", [torch.zeros(5, 4, 3)] * 2, extra={"page_size": 4})
    with pytest.raises(KVLayoutError, match=r"expected KV shape .*kv_width=16.*found \[5, 4, 3\]"):
        CreateGPUConnector(CONFIG, META, engine)


def test_entry_point_discovered(site: Path) -> None:
    _fake_dist(site, "lmc-fake-a", {"fake.cpu": "lmc_fake_a:select"}, module_source=PLUGIN_SOURCE)
    registry_mod._reset_for_tests()
    assert registered_gpu_connectors()["fake.cpu"] == "lmc_fake_a:select"
    connector = CreateGPUConnector(CONFIG, META, _engine(name="fake"))
    assert type(connector) is PagedCPUConnector
    # An explicit registration now conflicts with the discovered one.
    with pytest.raises(
        ValueError, match=r"lmc_fake_a:select.*entry point 'fake.cpu' of lmc-fake-a 1.0"
    ):
        register_gpu_connector("fake.cpu", MOCK_TARGET)


def test_discovery_runs_once(site: Path) -> None:
    registry_mod._reset_for_tests()
    assert "fake.cpu" not in registered_gpu_connectors()
    _fake_dist(site, "lmc-fake-late", {"fake.cpu": "lmc_fake_late:select"})
    assert "fake.cpu" not in registered_gpu_connectors()  # installed after discovery
    registry_mod._reset_for_tests()  # control: a new discovery does find it
    assert registered_gpu_connectors()["fake.cpu"] == "lmc_fake_late:select"


def test_plugins_allowlist(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dist(
        site,
        "lmc-fake-b",
        {"fake.cpu": "lmc_fake_b:select", "fake.xpu": "lmc_fake_b:select"},
        module_source=PLUGIN_SOURCE,
    )
    monkeypatch.setenv("LMCACHE_PLUGINS", " fake.xpu ,other.cuda")
    registry_mod._reset_for_tests()
    view = registered_gpu_connectors()
    assert "fake.xpu" in view and "fake.cpu" not in view


def test_plugin_autoload_off(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dist(site, "lmc-fake-c", {"fake.cpu": "lmc_fake_c:select"}, module_source=PLUGIN_SOURCE)
    monkeypatch.setenv("LMCACHE_PLUGIN_AUTOLOAD", "0")
    registry_mod._reset_for_tests()
    assert "fake.cpu" not in registered_gpu_connectors()
    with pytest.raises(ValueError, match=r"No GPU connector for 'fake.cpu'"):
        CreateGPUConnector(CONFIG, META, _engine(name="fake"))
    register_gpu_connector("mock.cpu", MOCK_TARGET)  # explicit registration still works
    assert "mock.cpu" in registered_gpu_connectors()


def test_engine_extra_out_of_range_skipped(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    _fake_dist(
        site,
        "lmc-fake-d",
        {"fake.cpu": "lmc_fake_d:select"},
        engine_requires=["torch>=99", "lmc-not-installed-engine>=1"],
        module_source=PLUGIN_SOURCE,
    )
    registry_mod._reset_for_tests()
    with caplog.at_level(logging.WARNING, logger="lmcache.gpu_connector.registry"):
        view = registered_gpu_connectors()
    assert "fake.cpu" not in view
    torch_version = importlib.metadata.version("torch")
    assert f"lmc-fake-d requested torch>=99 but found torch {torch_version}" in caplog.text
    assert "lmc_fake_d" not in sys.modules  # skipped before anything was imported


def test_engine_extra_in_range_or_absent_accepted(site: Path) -> None:
    _fake_dist(
        site,
        "lmc-fake-e",
        {"fake.cpu": "lmc_fake_e:select"},
        engine_requires=["torch>=2", "lmc-not-installed-engine==0.1"],
        module_source=PLUGIN_SOURCE,
    )
    registry_mod._reset_for_tests()
    assert type(CreateGPUConnector(CONFIG, META, _engine(name="fake"))) is PagedCPUConnector


def test_import_error_logged_and_reported(site: Path, caplog: pytest.LogCaptureFixture) -> None:
    _fake_dist(
        site,
        "lmc-fake-f",
        {"fake.cpu": "lmc_fake_f:select"},
        module_source="import lmc_fake_missing_engine\n",
    )
    registry_mod._reset_for_tests()
    for _ in range(2):  # the failure is remembered: same error, no second import attempt
        with (
            caplog.at_level(logging.WARNING, logger="lmcache.gpu_connector.registry"),
            pytest.raises(ValueError) as excinfo,
        ):
            CreateGPUConnector(CONFIG, META, _engine(name="fake"))
        message = str(excinfo.value)
        assert "'fake.cpu'" in message and "lmc_fake_f:select" in message
        assert "No module named 'lmc_fake_missing_engine'" in message
    assert caplog.text.count("Could not import GPU connector") == 1
    # Other keys keep working.
    register_gpu_connector("mock.cpu", MOCK_TARGET)
    assert type(CreateGPUConnector(CONFIG, META, _engine())) is PagedCPUConnector


def test_other_errors_while_loading_propagate(site: Path) -> None:
    _fake_dist(
        site,
        "lmc-fake-g",
        {"fake.cpu": "lmc_fake_g:select"},
        module_source="raise RuntimeError('broken plug-in')\n",
    )
    registry_mod._reset_for_tests()
    with pytest.raises(RuntimeError, match="broken plug-in"):
        CreateGPUConnector(CONFIG, META, _engine(name="fake"))


def test_conflicting_entry_points_refuse_to_guess(site: Path) -> None:
    _fake_dist(site, "lmc-fake-h", {"fake.cpu": "lmc_fake_h:select"}, module_source=PLUGIN_SOURCE)
    _fake_dist(site, "lmc-fake-i", {"fake.cpu": "lmc_fake_i:select"}, module_source=PLUGIN_SOURCE)
    registry_mod._reset_for_tests()
    with pytest.raises(ValueError, match="several plug-ins") as excinfo:
        CreateGPUConnector(CONFIG, META, _engine(name="fake"))
    assert "lmc_fake_h:select" in str(excinfo.value) and "lmc_fake_i:select" in str(excinfo.value)
    register_gpu_connector("fake.cpu", "lmc_fake_i:select", clobber=True)
    assert type(CreateGPUConnector(CONFIG, META, _engine(name="fake"))) is PagedCPUConnector


def test_reentrant_registration_while_loading(site: Path) -> None:
    source = PLUGIN_SOURCE + (
        "\nfrom lmcache.gpu_connector import register_gpu_connector, registered_gpu_connectors\n"
        "registered_gpu_connectors()\n"
        f"register_gpu_connector('fake.xpu', {MOCK_TARGET!r})\n"
    )
    _fake_dist(site, "lmc-fake-j", {"fake.cpu": "lmc_fake_j:select"}, module_source=source)
    registry_mod._reset_for_tests()
    assert type(CreateGPUConnector(CONFIG, META, _engine(name="fake"))) is PagedCPUConnector
    assert registered_gpu_connectors()["fake.xpu"] == MOCK_TARGET


def test_selector_returning_non_class_is_a_type_error(site: Path) -> None:
    _fake_dist(
        site,
        "lmc-fake-k",
        {"fake.cpu": "lmc_fake_k:select"},
        module_source="def select(config, metadata, engine, layout_hints):\n    return object()\n",
    )
    registry_mod._reset_for_tests()
    with pytest.raises(TypeError, match="expected a subclass"):
        CreateGPUConnector(CONFIG, META, _engine(name="fake"))
