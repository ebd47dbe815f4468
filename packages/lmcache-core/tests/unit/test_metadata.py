# SPDX-License-Identifier: Apache-2.0
"""LMCacheMetadata: validation and the fingerprint that seeds every chunk key."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lmcache.keys import chunk_keys
from lmcache.metadata import LMCacheMetadata

# The fingerprint of format lmcache-kv-v1 before model_revision/quantization/kv_cache_dtype
# existed. Metadata that leaves them empty must keep it byte for byte (stored chunks stay hits).
BASE_FINGERPRINT = (
    b'{"chunk_size":256,"format":"lmcache-kv-v1","head_size_k":128,"head_size_v":128,'
    b'"kv_dtype":"bfloat16","model_name":"org/model","num_kv_heads":8,"num_layers":32,'
    b'"use_mla":false,"worker_id":1,"world_size":2}'
)


def _metadata(**changes: object) -> LMCacheMetadata:
    base = LMCacheMetadata("org/model", 2, 1, 1, 2, torch.bfloat16, 32, 8, 128, 128)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_fingerprint_without_the_optional_facts_is_unchanged() -> None:
    assert _metadata().fingerprint() == BASE_FINGERPRINT
    explicit = _metadata(model_revision="", quantization="", kv_cache_dtype="")
    assert explicit.fingerprint() == BASE_FINGERPRINT
    # The local placement does not change the bytes, so it is not in the fingerprint.
    assert _metadata(local_worker_id=0, local_world_size=1).fingerprint() == BASE_FINGERPRINT


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_revision", "0123abcd"),
        ("quantization", "awq"),
        ("kv_cache_dtype", "fp8_e4m3"),
        ("model_digest", "9f0e"),
    ],
)
def test_each_optional_fact_changes_fingerprint_and_keys(field: str, value: str) -> None:
    md = _metadata(**{field: value})
    fingerprint = md.fingerprint()
    assert fingerprint != BASE_FINGERPRINT
    assert json.loads(fingerprint) == {**json.loads(BASE_FINGERPRINT), field: value}
    # Another value of the same fact is another fingerprint too.
    assert _metadata(**{field: value + "-2"}).fingerprint() != fingerprint
    tokens = list(range(600))
    base_keys = chunk_keys(tokens, BASE_FINGERPRINT, 256)
    keys = chunk_keys(tokens, fingerprint, 256)
    assert all(a != b for a, b in zip(base_keys, keys, strict=True))


def test_optional_facts_are_told_apart() -> None:
    prints = {
        _metadata(model_revision="x").fingerprint(),
        _metadata(quantization="x").fingerprint(),
        _metadata(kv_cache_dtype="x").fingerprint(),
        _metadata(model_digest="x").fingerprint(),
        _metadata(model_revision="x", quantization="x", kv_cache_dtype="x").fingerprint(),
    }
    assert len(prints) == 5


def test_invalid_metadata() -> None:
    with pytest.raises(ValueError, match=r"worker_id=2 must be in \[0, world_size=2\)"):
        _metadata(worker_id=2)
    with pytest.raises(ValueError, match="kv_cache_dtype=None must be a str"):
        _metadata(kv_cache_dtype=None)
    with pytest.raises(ValueError, match="use_mla=True needs head_size_v=0"):
        _metadata(use_mla=True)
