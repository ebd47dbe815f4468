# SPDX-License-Identifier: Apache-2.0
"""What vLLM's configuration puts into the model fingerprint (every fact that changes the KV)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmcache.gpu_connector import KVLayoutError
from lmcache_vllm.worker.kv_registration import build_metadata, order_caches


def _config(**model: object) -> SimpleNamespace:
    cache_dtype = model.pop("cache_dtype", "auto")
    mc = {"model": "org/m", "use_mla": False, "get_head_size": lambda: 32, "dtype": "bfloat16"}
    mc.update(model)
    return SimpleNamespace(
        model_config=SimpleNamespace(**mc),
        cache_config=SimpleNamespace(block_size=16, cache_dtype=cache_dtype),
        parallel_config=SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1, rank=1),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )


def _fingerprint(**model: object) -> bytes:
    caches = [torch.zeros(4, 2, 16, 64, device="meta") for _ in range(3)]
    md, _ = build_metadata(
        _config(**model), ["a", "b", "c"], caches, chunk_size=64, world_size=2, rank=1
    )
    return md.fingerprint()


def test_geometry_and_rank_read_from_the_tensors():
    caches = [torch.zeros(4, 2, 16, 64, device="meta") for _ in range(3)]
    md, _ = build_metadata(_config(), ["a", "b", "c"], caches, chunk_size=64, world_size=2, rank=1)
    assert (md.num_layers, md.num_kv_heads, md.head_size_k, md.head_size_v) == (3, 2, 32, 32)
    assert (md.world_size, md.worker_id, md.kv_dtype) == (2, 1, torch.float32)


@pytest.mark.parametrize(
    "change",
    [
        {"revision": "v2"},
        {"quantization": "awq"},
        {"cache_dtype": "fp8_e4m3"},
        {"model": "org/other"},
    ],
    ids=["revision", "quantization", "kv-cache-dtype", "model"],
)
def test_every_fact_that_changes_the_kv_changes_the_fingerprint(change):
    assert _fingerprint(**change) != _fingerprint()


def test_fp8_cache_fingerprint_depends_on_the_model_dtype():
    a = _fingerprint(cache_dtype="fp8_e4m3", dtype="bfloat16")
    b = _fingerprint(cache_dtype="fp8_e4m3", dtype="float16")
    assert a != b


def test_caches_in_layer_order_and_bad_views_refused():
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(1) + i for i in (2, 0, 1)}
    names, ordered = order_caches(caches)
    assert [float(t) for t in ordered] == [0.0, 1.0, 2.0]
    assert names[0].startswith("model.layers.0.")
    with pytest.raises(KVLayoutError, match="no KV caches"):
        order_caches({})
    with pytest.raises(KVLayoutError, match=r"expected the per-layer view"):
        build_metadata(
            _config(), ["a"], [torch.zeros(4, 16, 64)], chunk_size=64, world_size=2, rank=1
        )


class _HfConfig:
    def __init__(self, **values: object) -> None:
        self.values = values

    def to_dict(self) -> dict[str, object]:
        return dict(self.values)


def test_effective_hf_config_changes_the_fingerprint():
    """Another RoPE base (``hf_overrides``) gives other KV for the same model name."""
    base = _fingerprint(hf_config=_HfConfig(rope_theta=10000.0, _name_or_path="org/m"))
    assert base == _fingerprint(hf_config=_HfConfig(rope_theta=10000.0, _name_or_path="x"))
    assert base != _fingerprint(hf_config=_HfConfig(rope_theta=500000.0, _name_or_path="org/m"))
    assert base != _fingerprint()  # no hf_config: name, revision and geometry only


def test_local_weights_rebuilt_in_place_change_the_fingerprint(tmp_path):
    """A model folder rebuilt with other weights (same path) must not meet its old KV (a disk
    or Redis tier keeps it across restarts)."""
    from lmcache_vllm.testing import build_tiny_llama

    tiny = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
    folder = build_tiny_llama(tmp_path / "m", seed=0, **tiny)
    first = _fingerprint(model=str(folder))
    assert _fingerprint(model=str(folder)) == first
    build_tiny_llama(folder, seed=1, **tiny)  # same folder, new random weights
    assert _fingerprint(model=str(folder)) != first


def test_hub_snapshot_commit_changes_the_fingerprint(tmp_path, monkeypatch):
    """A hub id resolves to its snapshot's commit in the local Hugging Face cache: an update of
    the model under the same id gets new keys."""
    from huggingface_hub import constants

    repo = tmp_path / "models--org--hubm"
    for commit in ("a" * 40, "b" * 40):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    (repo / "refs" / "main").write_text("a" * 40)
    first = _fingerprint(model="org/hubm")
    (repo / "refs" / "main").write_text("b" * 40)
    assert _fingerprint(model="org/hubm") != first
    assert _fingerprint(model="org/hubm", revision="a" * 40) != _fingerprint(
        model="org/hubm", revision="b" * 40
    )
