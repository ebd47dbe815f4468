# SPDX-License-Identifier: Apache-2.0
"""LMCacheConfig and load_config: sources, precedence, parsing and error messages."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import pytest

from lmcache.config import ConfigError, LMCacheConfig, load_config

DEFAULTS = {
    "chunk_size": 256,
    "local_cpu": True,
    "max_local_cpu_size": 5.0,
    "local_disk": None,
    "max_local_disk_size": 0.0,
    "remote_url": None,
    "remote_namespace": "lmcache",
    "remote_timeout": 1.0,
    "remote_ttl": 0.0,
    "tier_timeout": 5.0,
    "use_layerwise": False,
    "save_decode_cache": False,
    "save_unfull_chunk": False,
    "cache_salt": "",
    "checksum": None,
    "gpu_staging_buffer": True,
    "node_cache": False,
    "node_cache_dir": None,
    "node_cache_autostart": True,
}


def write(tmp_path: Path, text: str, name: str = "lmcache.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_and_to_dict() -> None:
    cfg = load_config(env={})
    assert cfg == LMCacheConfig()
    assert cfg.to_dict() == DEFAULTS
    assert [f.name for f in dataclasses.fields(LMCacheConfig)] == list(DEFAULTS)
    assert load_config(env={}, overrides=cfg.to_dict()) == cfg


def test_frozen() -> None:
    cfg = LMCacheConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.chunk_size = 1  # type: ignore[misc]


def test_max_local_cpu_bytes() -> None:
    assert LMCacheConfig(max_local_cpu_size=5.0).max_local_cpu_bytes == 5 * 1024**3
    assert LMCacheConfig(max_local_cpu_size=0.5).max_local_cpu_bytes == 512 * 1024**2
    assert LMCacheConfig(max_local_cpu_size=1e-9).max_local_cpu_bytes == int(1e-9 * 1024**3)
    assert isinstance(LMCacheConfig().max_local_cpu_bytes, int)


def test_yaml_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "chunk_size: 512\nlocal_cpu: yes\nmax_local_cpu_size: 2\ncache_salt: t1\nchecksum: false\n",
    )
    cfg = load_config(path, env={})
    assert cfg == LMCacheConfig(
        chunk_size=512, max_local_cpu_size=2.0, cache_salt="t1", checksum=False
    )
    assert isinstance(cfg.max_local_cpu_size, float)  # YAML int widened to float
    assert load_config(str(path), env={}) == cfg


def test_yaml_file_from_env(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 64\n")
    assert load_config(env={"LMCACHE_CONFIG_FILE": str(path)}).chunk_size == 64
    # the path argument wins over LMCACHE_CONFIG_FILE
    other = write(tmp_path, "chunk_size: 32\n", "other.yaml")
    assert load_config(other, env={"LMCACHE_CONFIG_FILE": str(path)}).chunk_size == 32
    # empty LMCACHE_CONFIG_FILE means no file
    assert load_config(env={"LMCACHE_CONFIG_FILE": ""}) == LMCacheConfig()


def test_empty_yaml_file(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), env={}) == LMCacheConfig()


def test_os_environ_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "128")
    assert load_config().chunk_size == 128


@pytest.mark.parametrize(
    ("name", "text", "key", "expected"),
    [
        ("LMCACHE_CHUNK_SIZE", "512", "chunk_size", 512),
        ("LMCACHE_CHUNK_SIZE", " 64 ", "chunk_size", 64),
        ("LMCACHE_LOCAL_CPU", "false", "local_cpu", False),
        ("LMCACHE_USE_LAYERWISE", "TRUE", "use_layerwise", True),
        ("LMCACHE_USE_LAYERWISE", "Yes", "use_layerwise", True),
        ("LMCACHE_USE_LAYERWISE", "1", "use_layerwise", True),
        ("LMCACHE_CHECKSUM", "No", "checksum", False),
        ("LMCACHE_CHECKSUM", "0", "checksum", False),
        ("LMCACHE_CHECKSUM", "true", "checksum", True),
        ("LMCACHE_CHECKSUM", "none", "checksum", None),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.25", "max_local_cpu_size", 0.25),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "3", "max_local_cpu_size", 3.0),
        ("LMCACHE_MAX_LOCAL_DISK_SIZE", "1e1", "max_local_disk_size", 10.0),
        ("LMCACHE_CACHE_SALT", "tenant-7", "cache_salt", "tenant-7"),
        ("LMCACHE_CACHE_SALT", "none", "cache_salt", "none"),  # not optional: literal
        ("LMCACHE_LOCAL_DISK", "none", "local_disk", None),
        ("LMCACHE_LOCAL_DISK", "", "local_disk", None),
        ("LMCACHE_REMOTE_URL", "None", "remote_url", None),
    ],
)
def test_env_parsing(name: str, text: str, key: str, expected: Any) -> None:
    value = getattr(load_config(env={name: text}), key)
    assert value == expected
    assert type(value) is type(expected)


def test_precedence(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_size: 16\ncache_salt: file\nuse_layerwise: true\n")
    env = {
        "LMCACHE_CONFIG_FILE": str(path),
        "LMCACHE_CHUNK_SIZE": "32",
        "LMCACHE_CACHE_SALT": "env",
    }
    cfg = load_config(env=env, overrides={"cache_salt": "dict"})
    assert (cfg.chunk_size, cfg.cache_salt, cfg.use_layerwise) == (32, "dict", True)
    assert cfg.checksum is None  # default survives
    assert load_config(env=env).cache_salt == "env"
    assert load_config(env={"LMCACHE_CONFIG_FILE": str(path)}).cache_salt == "file"


def test_overrides_lmcache_prefix() -> None:
    cfg = load_config(env={}, overrides={"lmcache.chunk_size": 512, "save_unfull_chunk": True})
    assert (cfg.chunk_size, cfg.save_unfull_chunk) == (512, True)
    with pytest.raises(ConfigError, match=r"'lmcache\.chunk_size'.*'chunk_size'|given twice"):
        load_config(env={}, overrides={"lmcache.chunk_size": 512, "chunk_size": 256})


def test_non_config_env_vars_are_ignored() -> None:
    env = {
        "LMCACHE_PLUGINS": "mock.cpu",
        "LMCACHE_PLUGIN_AUTOLOAD": "0",
        "LMCACHE_REQUIRE_CEXT": "1",
        "LMCACHE_DISABLE_CEXT": "1",
        "LMCACHE_LOG_LEVEL": "DEBUG",
        "LMCACHE_CONFIG_FILE": "",
        "PATH": "/bin",
        "VLLM_CHUNK_SIZE": "x",
    }
    assert load_config(env=env) == LMCacheConfig()


# -- unknown keys: each error names the key, its source and the nearest valid key ---------------


def test_unknown_key_in_file(tmp_path: Path) -> None:
    path = write(tmp_path, "chunk_sise: 512\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    msg = str(info.value)
    assert "'chunk_sise'" in msg
    assert str(path) in msg
    assert "Did you mean 'chunk_size'" in msg


def test_unknown_env_var() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"LMCACHE_LOCAL_CPUS": "true"})
    msg = str(info.value)
    assert "LMCACHE_LOCAL_CPUS" in msg
    assert "Did you mean 'LMCACHE_LOCAL_CPU'" in msg
    # typos of non-config env vars point at them
    with pytest.raises(ConfigError, match="Did you mean 'LMCACHE_PLUGINS'"):
        load_config(env={"LMCACHE_PLUGIN": "x"})


def test_unknown_override() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"lmcache.max_local_cpu_szie": 1.0})
    msg = str(info.value)
    assert "'max_local_cpu_szie'" in msg
    assert "overrides['lmcache.max_local_cpu_szie']" in msg
    assert "Did you mean 'max_local_cpu_size'" in msg


def test_unknown_unrelated_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError, match=r"'zzz'.*Expected one of: chunk_size, local_cpu"):
        load_config(env={}, overrides={"zzz": 1})


# -- wrong types and bad values -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "key", "expected"),
    [
        ({"chunk_size": "512"}, "chunk_size", "an integer"),
        ({"chunk_size": 256.0}, "chunk_size", "an integer"),
        ({"chunk_size": True}, "chunk_size", "an integer"),
        ({"local_cpu": "false"}, "local_cpu", "a boolean"),
        ({"local_cpu": 1}, "local_cpu", "a boolean"),
        ({"max_local_cpu_size": "5"}, "max_local_cpu_size", "a finite number"),
        ({"max_local_cpu_size": False}, "max_local_cpu_size", "a finite number"),
        ({"cache_salt": 123}, "cache_salt", "a string"),
        ({"cache_salt": None}, "cache_salt", "a string"),
        ({"local_disk": 5}, "local_disk", "a string, or null"),
    ],
)
def test_wrong_type_in_overrides(overrides: dict[str, Any], key: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=overrides)
    msg = str(info.value)
    assert f"key {key!r}" in msg
    assert f"overrides[{key!r}]" in msg
    assert f"expected {expected}" in msg
    assert f"found {overrides[key]!r}" in msg


def test_wrong_type_in_file(tmp_path: Path) -> None:
    path = write(tmp_path, 'chunk_size: "512"\n')
    with pytest.raises(ConfigError, match=rf"'chunk_size' \(from file '{path}'\).*integer.*'512'"):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("LMCACHE_CHUNK_SIZE", "5.0", "an integer"),
        ("LMCACHE_CHUNK_SIZE", "", "an integer"),
        ("LMCACHE_LOCAL_CPU", "maybe", "a boolean"),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "lots", "a finite number"),
        ("LMCACHE_CHUNK_SIZE", "0", "a positive integer"),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "-1", "a finite size in GB >= 0"),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE", "nan", "a finite size in GB >= 0"),
        ("LMCACHE_MAX_LOCAL_DISK_SIZE", "-0.5", "a finite size in GB >= 0"),
    ],
)
def test_bad_env_value(name: str, text: str, expected: str) -> None:
    key = name.removeprefix("LMCACHE_").lower()
    with pytest.raises(ConfigError) as info:
        load_config(env={name: text})
    msg = str(info.value)
    assert f"key {key!r} (from env {name})" in msg
    assert f"expected {expected}" in msg
    assert "found " in msg


@pytest.mark.parametrize(
    ("overrides", "key", "expected"),
    [
        ({"chunk_size": 0}, "chunk_size", "a positive integer"),
        ({"chunk_size": -4}, "chunk_size", "a positive integer"),
        ({"max_local_cpu_size": -1.0}, "max_local_cpu_size", "a finite size"),
        ({"max_local_cpu_size": math.inf}, "max_local_cpu_size", "a finite size"),
        ({"max_local_disk_size": -2}, "max_local_disk_size", "a finite size"),
        ({"remote_url": "localhost:6379"}, "remote_url", "a URL with a scheme"),
        ({"remote_url": "redis:6379"}, "remote_url", "a URL with a scheme"),
        ({"local_disk": "  "}, "local_disk", "a directory path"),
        ({"remote_url": "lm://localhost:65432"}, "remote_url", "a Redis/Valkey URL"),
        ({"remote_url": "mooncakestore://h:1"}, "remote_url", "a Redis/Valkey URL"),
        ({"remote_namespace": "a b"}, "remote_namespace", "1-64 letters"),
        ({"remote_namespace": ""}, "remote_namespace", "1-64 letters"),
        ({"remote_timeout": 0}, "remote_timeout", "a number of seconds > 0"),
        ({"remote_ttl": -1}, "remote_ttl", "a number of seconds >= 0"),
        ({"tier_timeout": -0.5}, "tier_timeout", "a number of seconds >= 0 (0: no deadline)"),
        ({"tier_timeout": math.nan}, "tier_timeout", "a number of seconds >= 0 (0: no deadline)"),
        ({"max_local_cpu_size": 0}, "max_local_cpu_size", "a size > 0 GB while local_cpu"),
    ],
)
def test_bad_values(overrides: dict[str, Any], key: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=overrides)
    msg = str(info.value)
    assert f"key {key!r} (from overrides[{key!r}])" in msg
    assert f"expected {expected}" in msg


def test_cpu_tier_off_allows_zero_budget() -> None:
    cfg = load_config(env={"LMCACHE_LOCAL_CPU": "false"}, overrides={"max_local_cpu_size": 0})
    assert (cfg.local_cpu, cfg.max_local_cpu_bytes) == (False, 0)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("local_disk", "/tmp/lmcache"),
        ("local_disk", "file:///tmp/lmcache"),
        ("remote_url", "redis://localhost:6379"),
        ("remote_url", "rediss://user:pw@h:6380/2"),
        ("remote_url", "valkey://h:6379"),
        ("remote_url", "redis+cluster://h:7000"),
    ],
)
def test_tiers_from_every_source(tmp_path: Path, key: str, value: str) -> None:
    extra = {"max_local_disk_size": 1.0}
    for cfg in (
        load_config(overrides={key: value, **extra}, env={}),
        load_config(env={f"LMCACHE_{key.upper()}": value, "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}),
        load_config(path=write(tmp_path, f"{key}: {value}\nmax_local_disk_size: 1.0\n"), env={}),
    ):
        assert getattr(cfg, key) == value


def test_remote_password_never_in_messages_or_repr() -> None:
    cfg = load_config(env={}, overrides={"remote_url": "redis://u:s3cret-pw@h:6379/0"})
    assert "s3cret-pw" not in repr(cfg) and "redis://u:***@h:6379/0" in repr(cfg)
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides={"remote_url": "memcached://u:s3cret-pw@h:1"})
    assert "s3cret-pw" not in str(info.value) and "u:***@h" in str(info.value)


def test_cpu_off_with_a_lower_tier_needs_a_staging_budget() -> None:
    cfg = load_config(env={}, overrides={"local_cpu": False, "remote_url": "redis://h:1"})
    assert cfg.max_local_cpu_bytes > 0
    with pytest.raises(ConfigError, match="stage transfers"):
        load_config(
            env={},
            overrides={"local_cpu": False, "remote_url": "redis://h:1", "max_local_cpu_size": 0},
        )


def test_disk_tier_needs_a_budget() -> None:
    with pytest.raises(ConfigError, match=r"'max_local_disk_size' \(from defaults\).*local_disk"):
        load_config(env={}, overrides={"local_disk": "/tmp/x"})


def test_lmcache_remote_serde_is_accepted() -> None:
    assert load_config(env={}, overrides={"remote_serde": "naive"}) == LMCacheConfig()


def test_direct_construction_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"'chunk_size' \(from LMCacheConfig"):
        LMCacheConfig(chunk_size=0)
    with pytest.raises(ConfigError, match=r"'local_cpu'.*a boolean"):
        LMCacheConfig(local_cpu="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="chunk_size"):
        dataclasses.replace(LMCacheConfig(), chunk_size=-1)
    assert isinstance(LMCacheConfig(max_local_cpu_size=2).max_local_cpu_size, float)


# -- files that cannot be used --------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=rf"{missing}.*does not exist.*LMCACHE_CONFIG_FILE"):
        load_config(env={"LMCACHE_CONFIG_FILE": str(missing)})


def test_malformed_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "chunk_size: [1, 2\n"), env={})
    with pytest.raises(ConfigError, match=r"top-level mapping.*found a list"):
        load_config(write(tmp_path, "- chunk_size\n"), env={})
    with pytest.raises(ConfigError, match="keys must be strings"):
        load_config(write(tmp_path, "1: 2\n"), env={})


def test_yaml_is_loaded_safely(tmp_path: Path) -> None:
    path = write(tmp_path, "cache_salt: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path, env={})


# -- legacy LMCache keys --------------------------------------------------------------------------


def test_use_experimental_is_ignored_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache.config"):
        cfg = load_config(
            write(tmp_path, "use_experimental: true\n"),
            env={"LMCACHE_USE_EXPERIMENTAL": "True"},
        )
    assert cfg == LMCacheConfig()
    warnings = [r.getMessage() for r in caplog.records if "use_experimental" in r.getMessage()]
    assert len(warnings) == 2
    assert all("ignored" in w for w in warnings)


def test_enable_blending_false_is_a_noop_true_is_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache.config"):
        assert load_config(env={"LMCACHE_ENABLE_BLENDING": "false"}) == LMCacheConfig()
        assert load_config(env={}, overrides={"enable_blending": False}) == LMCacheConfig()
    assert any("enable_blending" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match=r"'enable_blending' \(from env LMCACHE_ENABLE_BLENDING"):
        load_config(env={"LMCACHE_ENABLE_BLENDING": "true"})
    with pytest.raises(ConfigError, match=r"'enable_blending'.*expected False.*found True"):
        load_config(env={}, overrides={"lmcache.enable_blending": True})


def test_checksum_default_follows_the_engine_device() -> None:
    """Unset: verified for KV in host memory, skipped over PCIe; set: as set, everywhere."""
    auto = LMCacheConfig()
    assert auto.checksum_for("cpu") is True
    assert auto.checksum_for("cuda") is False
    assert auto.checksum_for("xpu") is False
    for value in (True, False):
        cfg = load_config(overrides={"checksum": value})
        assert cfg.checksum_for("cpu") is value and cfg.checksum_for("cuda") is value
    with pytest.raises(ConfigError, match="checksum"):
        load_config(overrides={"checksum": "sometimes"})
