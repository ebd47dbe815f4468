# SPDX-License-Identifier: Apache-2.0
"""Chunk keys cover every request feature that changes the KV, on vLLM's own ``Request`` objects.

A multimodal model cannot run here, so multimodal keying is checked on real ``vllm.v1.request``
objects carrying real ``MultiModalFeatureSpec`` / ``PlaceholderRange`` values, through the key
material the connector derives (``RequestKeyer``) and the chunk keys core builds from it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.request import Request

from lmcache.keys import chunk_keys
from lmcache_vllm.scheduler.request_keys import RequestKeyer

CHUNK = 64
FP = b"fingerprint"


def make_request(
    tokens: list[int],
    *,
    rid: str = "r",
    salt: str | None = None,
    lora: LoRARequest | None = None,
    mm: list[tuple[str, int, int]] = (),
    embeds: torch.Tensor | None = None,
) -> Request:
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=ident,
            mm_position=PlaceholderRange(offset=offset, length=length),
        )
        for ident, offset, length in mm
    ]
    return Request(
        request_id=rid,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=4),
        pooling_params=None,
        mm_features=features,
        lora_request=lora,
        cache_salt=salt,
        prompt_embeds=embeds,
    )


def keys_of(request: Request) -> list[bytes]:
    key = RequestKeyer(CHUNK).key(request)
    assert key.skip_reason is None
    return chunk_keys(
        request.prompt_token_ids, FP, CHUNK, salt=key.salt, extra_keys=key.extra_keys or None
    )


TOKENS = list(range(1, 301))  # 5 chunks: 4 full + a 44-token tail


def test_plain_request_has_no_key_material():
    key = RequestKeyer(CHUNK).key(make_request(TOKENS))
    assert (key.salt, key.extra_keys, key.skip_reason) == ("", {}, None)
    assert keys_of(make_request(TOKENS)) == chunk_keys(TOKENS, FP, CHUNK)


def test_image_changes_its_chunk_and_every_later_one_only():
    base = keys_of(make_request(TOKENS))
    cat = keys_of(make_request(TOKENS, mm=[("cat-image-hash", 140, 20)]))  # chunk 2
    dog = keys_of(make_request(TOKENS, mm=[("dog-image-hash", 140, 20)]))
    assert cat[:2] == base[:2] == dog[:2]  # text before the image is shared
    assert all(c != b and c != d for c, b, d in zip(cat[2:], base[2:], dog[2:], strict=True))


def test_same_image_at_another_position_is_another_key():
    at_140 = keys_of(make_request(TOKENS, mm=[("img", 140, 20)]))
    at_150 = keys_of(make_request(TOKENS, mm=[("img", 150, 20)]))
    assert at_140[:2] == at_150[:2] and at_140[2] != at_150[2]


def test_two_images_order_independent_within_a_chunk_and_both_count():
    ab = keys_of(make_request(TOKENS, mm=[("a", 10, 5), ("b", 30, 5)]))
    ba = keys_of(make_request(TOKENS, mm=[("b", 30, 5), ("a", 10, 5)]))
    only_a = keys_of(make_request(TOKENS, mm=[("a", 10, 5)]))
    assert ab == ba and ab[0] != only_a[0]


def test_image_spanning_chunks_keys_from_its_first_chunk():
    span = keys_of(make_request(TOKENS, mm=[("wide", 100, 100)]))  # chunks 1..3
    base = keys_of(make_request(TOKENS))
    assert span[0] == base[0] and all(s != b for s, b in zip(span[1:], base[1:], strict=True))


def test_cache_salt_seeds_every_chunk_and_long_salts_are_bounded():
    plain = keys_of(make_request(TOKENS))
    huge = "x" * 100_000
    a = keys_of(make_request(TOKENS, salt="tenant-a"))
    b = keys_of(make_request(TOKENS, salt="tenant-b"))
    h = keys_of(make_request(TOKENS, salt=huge))
    assert len({plain[0], a[0], b[0], h[0]}) == 4
    assert len(RequestKeyer(CHUNK).key(make_request(TOKENS, salt=huge)).salt) == 32
    assert h == keys_of(make_request(TOKENS, salt=huge))  # deterministic


def _adapter(folder: Path, payload: bytes) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (folder / "adapter_model.safetensors").write_bytes(payload)
    return str(folder)


def test_lora_identity_name_path_and_content(tmp_path):
    path_a = _adapter(tmp_path / "a", b"weights-a")
    path_b = _adapter(tmp_path / "b", b"weights-b")
    base = keys_of(make_request(TOKENS))
    a = keys_of(make_request(TOKENS, lora=LoRARequest("a", 1, path_a)))
    a_other_id = keys_of(make_request(TOKENS, lora=LoRARequest("a", 7, path_a)))
    b = keys_of(make_request(TOKENS, lora=LoRARequest("b", 2, path_b)))
    renamed = keys_of(make_request(TOKENS, lora=LoRARequest("a2", 1, path_a)))
    assert a == a_other_id  # vLLM's int id is a slot number, not an identity
    assert len({base[0], a[0], b[0], renamed[0]}) == 4
    # the same name and path with other weights (adapter replaced in place) is another key
    keyer = RequestKeyer(CHUNK)
    before = keyer.key(make_request(TOKENS, lora=LoRARequest("a", 1, path_a))).salt
    (Path(path_a) / "adapter_model.safetensors").write_bytes(b"weights-a, retrained!")
    after = keyer.key(make_request(TOKENS, lora=LoRARequest("a", 1, path_a))).salt
    assert before != after


def test_lora_and_salt_combine(tmp_path):
    lora = LoRARequest("a", 1, _adapter(tmp_path / "a", b"weights-a"))
    with_both = keys_of(make_request(TOKENS, salt="t", lora=lora))
    assert with_both[0] not in {
        keys_of(make_request(TOKENS, salt="t"))[0],
        keys_of(make_request(TOKENS, lora=lora))[0],
    }


def _hub_adapter(cache: Path, repo: str, commit: str, payload: bytes) -> Path:
    """``repo``'s snapshot ``commit`` in a Hugging Face cache folder, ``main`` pointing at it."""
    root = cache / ("models--" + repo.replace("/", "--"))
    _adapter(root / "snapshots" / commit, payload)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return root / "snapshots" / commit


def test_lora_by_hub_id_is_keyed_by_its_cached_files(tmp_path, monkeypatch):
    """A hub id is found in the local Hugging Face cache (as vLLM downloads it there): keyed by
    the snapshot's files, so an update under the same id is another key. Before it is cached
    (vLLM downloads it when it first loads it) the request is neither stored nor loaded."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # "org/adapter" is no folder here
    lora = LoRARequest("ad", 1, "org/adapter")
    keyer = RequestKeyer(CHUNK)
    missing = keyer.key(make_request(TOKENS, lora=lora))
    assert missing.skip_reason is not None and "LoRA" in missing.skip_reason

    snapshot = _hub_adapter(cache, "org/adapter", "a" * 40, b"weights-v1")
    v1 = keys_of(make_request(TOKENS, lora=lora))
    local = keys_of(make_request(TOKENS, lora=LoRARequest("ad", 1, str(snapshot))))
    assert v1[0] != local[0]  # the path is part of the identity, as vLLM's own
    _hub_adapter(cache, "org/adapter", "b" * 40, b"weights-v2")  # main moved on
    v2 = keys_of(make_request(TOKENS, lora=lora))
    assert v1[0] != v2[0]
    assert keys_of(make_request(TOKENS, lora=lora)) == v2  # stable while nothing changes


def test_lora_whose_files_are_missing_is_not_cached(tmp_path):
    for path in ("/nonexistent/adapter", str(tmp_path), "~/no-such-adapter-here", "org/none"):
        key = RequestKeyer(CHUNK).key(make_request(TOKENS, lora=LoRARequest("a", 1, path)))
        assert key.skip_reason is not None and "LoRA" in key.skip_reason, path


def test_lora_path_with_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _adapter(tmp_path / "ad", b"weights")
    tilde = keys_of(make_request(TOKENS, lora=LoRARequest("a", 1, "~/ad")))
    assert tilde[0] != keys_of(make_request(TOKENS))[0]


def test_prompt_embeddings_are_not_cached():
    key = RequestKeyer(CHUNK).key(make_request(TOKENS, embeds=torch.zeros(300, 8)))
    assert key.skip_reason is not None and "embed" in key.skip_reason


def test_model_digest_of_a_hub_id_follows_its_cached_snapshot(tmp_path, monkeypatch):
    """The model digest (in every chunk key) of a hub id is its cached snapshot's commit: a model
    updated on the hub under the same id gets other keys; one not cached has none."""
    import huggingface_hub.constants

    from lmcache.model_identity import model_digest

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    assert model_digest("org/model") == ""
    root = cache / "models--org--model"
    for commit in ("1" * 40, "2" * 40):
        (root / "snapshots" / commit).mkdir(parents=True)
        (root / "snapshots" / commit / "config.json").write_text("{}")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("1" * 40)
    v1 = model_digest("org/model")
    (root / "refs" / "main").write_text("2" * 40)
    v2 = model_digest("org/model")
    assert "" != v1 != v2 and model_digest("org/model") == v2
    assert model_digest("org/model", revision="1" * 40) == v1
