# SPDX-License-Identifier: Apache-2.0
"""Configuration of the SGLang hooks: typed errors, config files, LMCache's daemon keys."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmcache.config import ConfigError
from lmcache_sglang.hook_config import hook_config, model_facts
from lmcache_sglang.mp_connector import lmcache_config_for_sglang


@pytest.fixture(autouse=True)
def _no_lmcache_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)


def test_extra_config_keys_and_prefix() -> None:
    cfg = hook_config({"chunk_size": 64, "lmcache.max_local_cpu_size": 0.5}, hook="x")
    assert (cfg.chunk_size, cfg.max_local_cpu_size) == (64, 0.5)


def test_unknown_key_is_one_typed_error_naming_the_nearest() -> None:
    with pytest.raises(ConfigError) as excinfo:
        hook_config({"chunk_sise": 64}, hook="linker_extra_config")
    assert "chunk_sise" in str(excinfo.value) and "chunk_size" in str(excinfo.value)


def test_sglang_keys_are_left_to_sglang() -> None:
    cfg = hook_config(
        {"backend_name": "lmcache", "interface_v1": 1, "chunk_size": 32},
        hook="hicache",
        ignore=("backend_name", "interface_v1"),
    )
    assert cfg.chunk_size == 32


def test_config_file_key_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "lmcache.yaml"
    path.write_text("chunk_size: 128\nmax_local_cpu_size: 1.5\n")
    cfg = hook_config({"config_file": str(path), "chunk_size": 64}, hook="x")
    assert (cfg.chunk_size, cfg.max_local_cpu_size) == (64, 1.5)  # extra config wins
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "32")
    assert hook_config({"config_file": str(path)}, hook="x").chunk_size == 32
    with pytest.raises(ConfigError):
        hook_config({"config_file": 5}, hook="x")


def test_lmcache_config_file_accepts_daemon_keys_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "mp.yaml"
    path.write_text("mp_host: 127.0.0.1\nmp_port: 5556\nchunk_size: 64\n")
    with caplog.at_level(logging.INFO, logger="lmcache_sglang"):
        cfg = lmcache_config_for_sglang(str(path))
    assert cfg.chunk_size == 64
    lines = [r for r in caplog.records if "mp_host" in r.getMessage()]
    assert len(lines) == 1 and "no daemon is needed" in lines[0].getMessage()


def test_lmcache_config_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("mp_port: 5556\nchunk_size: 'many'\n")
    with pytest.raises(ConfigError) as excinfo:
        lmcache_config_for_sglang(str(path))
    assert str(path) in str(excinfo.value) and "chunk_size" in str(excinfo.value)
    with pytest.raises(ConfigError):
        lmcache_config_for_sglang(str(tmp_path / "missing.yaml"))
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        lmcache_config_for_sglang(str(tmp_path / "list.yaml"))


def test_model_facts_cover_what_changes_the_bytes() -> None:
    args = SimpleNamespace(
        model_path="/m", revision="abc", quantization="awq", kv_cache_dtype="fp8_e4m3"
    )
    facts = model_facts(args)
    assert (facts.model_name, facts.model_revision, facts.quantization, facts.kv_cache_dtype) == (
        "/m",
        "abc",
        "awq",
        "fp8_e4m3",
    )
    assert model_facts(SimpleNamespace(model_path="/m", kv_cache_dtype="auto")).kv_cache_dtype == ""
    with pytest.raises(ConfigError):
        model_facts(SimpleNamespace(model_path=""))


def test_model_digest_follows_weights_config_and_overrides(tmp_path) -> None:
    """A model folder rebuilt in place, or served with other overrides, gets other keys."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"rope_theta": 10000.0}')
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\0" * 64)

    def digest(**more: object) -> str:
        return model_facts(SimpleNamespace(model_path=str(folder), **more)).model_digest

    base = digest()
    assert base and base == digest()
    assert digest(json_model_override_args='{"rope_theta": 500000.0}') != base
    (folder / "config.json").write_text('{"rope_theta": 20000.0}')
    edited = digest()
    assert edited != base
    weights.write_bytes(b"\1" * 64)
    os.utime(weights, ns=(1, weights.stat().st_mtime_ns + 10**9))
    assert digest() not in {base, edited}


def test_model_digest_is_the_one_vllm_computes(tmp_path: Path) -> None:
    """SGLang's digest is that of the effective Hugging Face configuration, the form vLLM's
    adapter digests (``hf_config.to_dict()``, after its overrides), so that both engines key one
    model alike and share its chunks through the node cache."""
    auto_config = pytest.importorskip("transformers", reason="needs transformers").AutoConfig
    from lmcache.model_identity import hf_config_dict, model_digest

    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128, '
        '"vocab_size": 100}'
    )
    (folder / "model.safetensors").write_bytes(b"\0" * 64)

    def vllm_side(overrides: dict[str, object]) -> str:  # vllm_model_digest of vLLM's hf_config
        config = auto_config.from_pretrained(str(folder))
        config.update(overrides)
        return model_digest(str(folder), config=hf_config_dict(config), revision=None)

    def sglang_side(**more: object) -> str:
        return model_facts(SimpleNamespace(model_path=str(folder), **more)).model_digest

    assert sglang_side() == vllm_side({})
    overridden = sglang_side(json_model_override_args='{"rope_theta": 500000.0}')
    assert overridden == vllm_side({"rope_theta": 500000.0}) != sglang_side()


def test_plain_requests_get_vllms_salt_and_others_never_do() -> None:
    """A request with neither SGLang ``extra_key`` (LoRA id included) nor ``cache_salt`` gets
    the salt vLLM gives a plain request (``""``); every other request a salt of its own."""
    from lmcache_sglang.mp_connector import UnifiedLMCacheMPConnector

    salt = UnifiedLMCacheMPConnector.build_cache_salt
    assert salt(None, None, None) == ""  # type: ignore[arg-type]
    others = [("", None), (None, ""), ("s", None), (None, "lora1"), ("s", "lora1"), ("", "")]
    salts = [salt(None, cache_salt, extra_key) for cache_salt, extra_key in others]  # type: ignore[arg-type]
    assert "" not in salts and len(set(salts)) == len(salts)
