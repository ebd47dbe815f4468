# SPDX-License-Identifier: Apache-2.0
"""Hybrid KV caches on real vLLM (CPU) with its hybrid KV cache manager on.

A tiny random Gemma-3 text model (5 sliding-window layers of window 64, then a full-attention
one) gets one KV cache group per layer. lmcache keeps one stream per group: the full-attention
group's chunks hold every hit token, the sliding groups' chunks are loaded only inside the window
before the hit's end. A tiny Nemotron-H (Mamba-2, attention, MLP) starts and serves with lmcache.
With vLLM's prefix cache off, lmcache stores and loads nothing for it (vLLM keeps no state at a
chunk boundary). In vLLM's Mamba prefix-caching mode lmcache stores the attention chunks and the
Mamba states vLLM offers, and hits load both.

Every test compares greedy tokens with vLLM without lmcache and counts the hit.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import LLM, SamplingParams

from lmcache_vllm.testing import build_tiny_gemma3, build_tiny_nemotron_h
from lmcache_vllm.vllm_v1_adapter import LMCacheConnectorV1Impl, live_engines

from .conftest import (
    MAX_TOKENS,
    MODULE_PATH_KTC,
    PROMPTS,
    engine_kwargs,
    ktc,
    metrics_of,
    process_tier,
    shutdown_engine,
)

WINDOW, BLOCK, CHUNK = 64, 32, 64
PLUGIN_KTC: dict[str, Any] = {"kv_connector": "LMCacheConnector", "kv_role": "kv_both"}
IN_TREE_KTC: dict[str, Any] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


def _folder(name: str) -> Path:
    return Path(tempfile.gettempdir()) / f"lmcache-vllm-tests-{os.getuid()}" / name


@pytest.fixture(scope="module")
def gemma3() -> Path:
    return build_tiny_gemma3(_folder("tiny-gemma3"), sliding_window=WINDOW)


@pytest.fixture(scope="module")
def nemotron_h() -> Path:
    return build_tiny_nemotron_h(_folder("tiny-nemotron-h"))


def _generate(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def _reference(model: Path, prompt: list[int], **engine: Any) -> list[int]:
    llm = LLM(**engine_kwargs(model, enable_prefix_caching=False, **engine))
    try:
        return _generate(llm, prompt)[0]
    finally:
        shutdown_engine(llm)


@pytest.fixture(scope="module")
def gemma3_want(gemma3: Path) -> dict[str, list[int]]:
    return {name: _reference(gemma3, PROMPTS[name]) for name in ("p300", "p300_ext")}


@pytest.fixture
def finished_blocks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], ...]]:
    """The per-group block ids vLLM hands ``request_finished_all_groups``."""
    seen: list[tuple[list[int], ...]] = []
    original = LMCacheConnectorV1Impl.request_finished_all_groups

    def record(self: Any, request: Any, block_ids: tuple[list[int], ...]) -> Any:
        seen.append(tuple(list(b) for b in block_ids))
        return original(self, request, block_ids)

    monkeypatch.setattr(LMCacheConnectorV1Impl, "request_finished_all_groups", record)
    return seen


def _group_engines() -> dict[str, Any]:
    """This engine's lmcache engines by kind (``full``/``sliding``), one per KV cache group."""
    out: dict[str, Any] = {"full": [], "sliding": []}
    for engine in live_engines():
        digest = engine.metadata.model_digest
        out["sliding" if " sliding window=" in digest else "full"].append(engine)
    return out


CHUNKED = {"max_num_batched_tokens": 64, "enable_chunked_prefill": True}


@pytest.mark.parametrize(
    ("connector", "engine", "lmcache"),
    [
        pytest.param(PLUGIN_KTC, {}, {}, id="plugin-one-step-prefill"),
        pytest.param(MODULE_PATH_KTC, {}, {}, id="module-one-step-prefill"),
        pytest.param(PLUGIN_KTC, CHUNKED, {}, id="plugin-chunked-prefill"),
        pytest.param(MODULE_PATH_KTC, CHUNKED, {}, id="module-chunked-prefill"),
        pytest.param(PLUGIN_KTC, {}, {"use_layerwise": True}, id="plugin-layerwise"),
    ],
)
def test_sliding_window_model_hits_with_hybrid_manager_on(
    gemma3, gemma3_want, finished_blocks, connector, engine, lmcache
):
    """Store, reset vLLM's prefix cache, hit: identical tokens, the hit counted, vLLM's hybrid
    manager on (sliding groups hold only the window's blocks) and each group keyed apart."""
    llm = LLM(**engine_kwargs(gemma3, kv_transfer_config=ktc(connector, **lmcache), **engine))
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        groups = _group_engines()
        assert len(groups["full"]) == 1 and len(groups["sliding"]) == 5
        prompt = PROMPTS["p300"]
        assert _generate(llm, prompt) == (gemma3_want["p300"], 0)
        assert llm.reset_prefix_cache()
        assert _generate(llm, prompt) == (gemma3_want["p300"], 256)
        m = metrics_of(llm)
        assert m.get("vllm:lmcache_loaded_tokens", 0) == 256, m
        assert m.get("vllm:lmcache_failed_load_tokens", 0) == 0, m
        # a longer prompt with the same 300 first tokens: the 4 stored chunks hit again
        assert llm.reset_prefix_cache()
        assert _generate(llm, PROMPTS["p300_ext"]) == (gemma3_want["p300_ext"], 256)
    finally:
        shutdown_engine(llm)
    assert len(finished_blocks) == 3
    for per_group in finished_blocks:
        assert len(per_group) == 6  # one group per layer: 5 sliding, then the full one
        *sliding, full = per_group
        assert 0 not in full and len(full) * BLOCK >= len(PROMPTS["p300"])
        for blocks in sliding:  # the window's blocks (and one being filled), the rest null
            assert len([b for b in blocks if b != 0]) <= WINDOW // BLOCK + 1, per_group


def test_only_the_window_of_sliding_chunks_is_loaded(gemma3, gemma3_want):
    """Control: corrupting the sliding groups' chunks outside the window before the hit's end
    changes nothing; corrupting the one inside it changes the output (it is loaded and used)."""
    cfg = ktc(PLUGIN_KTC, checksum=False)
    llm = LLM(**engine_kwargs(gemma3, kv_transfer_config=cfg))
    prompt = PROMPTS["p300"]
    try:
        assert _generate(llm, prompt) == (gemma3_want["p300"], 0)
        tier = process_tier()
        sliding = [e.metadata.fingerprint() for e in _group_engines()["sliding"]]
        from lmcache.keys import chunk_keys

        keys = [chunk_keys(prompt, fp, CHUNK, salt="\0") for fp in sliding]
        assert all(k[i] in tier._entries for k in keys for i in range(4))  # every chunk stored
        gen = torch.Generator().manual_seed(0)

        def corrupt(chunks: range) -> None:
            with torch.inference_mode():
                for group_keys in keys:
                    for i in chunks:
                        t = tier._entries[group_keys[i]].lease.tensor
                        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype) * 5)

        corrupt(range(3))  # tokens [0, 192): a hit at 256 attends to [193, 256) only
        assert llm.reset_prefix_cache()
        assert _generate(llm, prompt) == (gemma3_want["p300"], 256)
        corrupt(range(3, 4))  # tokens [192, 256): inside the window
        assert llm.reset_prefix_cache()
        tokens, cached = _generate(llm, prompt)
        assert cached == 256 and tokens != gemma3_want["p300"]
    finally:
        shutdown_engine(llm)


def test_in_tree_name_runs_with_the_hybrid_manager_off(gemma3, gemma3_want):
    """vLLM's in-tree wrapper (which we cannot change) is no SupportsHMA connector: vLLM turns
    its hybrid manager off, every layer is in one group, and lmcache works as for a dense
    model."""
    llm = LLM(**engine_kwargs(gemma3, kv_transfer_config=ktc(IN_TREE_KTC)))
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is True
        assert _generate(llm, PROMPTS["p300"]) == (gemma3_want["p300"], 0)
        assert llm.reset_prefix_cache()
        assert _generate(llm, PROMPTS["p300"]) == (gemma3_want["p300"], 256)
    finally:
        shutdown_engine(llm)


def test_mamba_hybrid_model_serves_with_lmcache(nemotron_h):
    """Nemotron-H (Mamba-2 state groups): the engine starts with the hybrid manager on and
    serves with lmcache, tokens identical to vLLM alone; lmcache stores and loads nothing.
    With vLLM's prefix cache off no state at a chunk boundary is kept: no hit is possible."""
    prompt = PROMPTS["p300"]
    want = _reference(nemotron_h, prompt)
    llm = LLM(
        **engine_kwargs(nemotron_h, kv_transfer_config=ktc(PLUGIN_KTC), enable_prefix_caching=False)
    )
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert _generate(llm, prompt) == (want, 0)
        assert _generate(llm, prompt) == (want, 0)
        m = metrics_of(llm)
        assert m.get("vllm:lmcache_stored_tokens", 0) == 0, m
        assert m.get("vllm:lmcache_loaded_tokens", 0) == 0, m
        assert not live_engines()
    finally:
        shutdown_engine(llm)


MAMBA_ALIGN: dict[str, Any] = {
    "enable_prefix_caching": True,
    "mamba_cache_mode": "align",
    "max_num_batched_tokens": BLOCK,  # longer CPU steps fail (see the test below)
    "prefix_cache_retention_interval": BLOCK,
}


@pytest.fixture
def mamba_states(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The :class:`MambaStates` of the engines built in the test."""
    from lmcache_vllm.worker.mamba_states import MambaStates

    seen: list[Any] = []
    original = MambaStates.__init__

    def record(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        seen.append(self)

    monkeypatch.setattr(MambaStates, "__init__", record)
    return seen


def _logprobs(llm: LLM, prompt: list[int]) -> tuple[list[int], list[float], int]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    tokens = list(out.outputs[0].token_ids)
    lps = [d[t].logprob for d, t in zip(out.outputs[0].logprobs or [], tokens, strict=True)]
    return tokens, lps, int(out.num_cached_tokens or 0)


def _state_entries(states: Any, prompt: list[int], boundary: int) -> list[Any]:
    """The tier's entries of the states after ``boundary`` tokens of ``prompt``, per group."""
    keys = states._group_keys(states._keys(prompt, "", {}, boundary), boundary)
    return [process_tier()._entries.get(k) for k in keys]


def test_mamba_hybrid_hits_from_lmcache(nemotron_h, mamba_states):
    """vLLM's Mamba prefix-caching mode with lmcache: the attention chunks and the Mamba
    states at block boundaries are stored; after vLLM's prefix cache is reset, lmcache loads
    both and the tokens and logprobs are those of the first run (the tokens those of vLLM
    without any cache). A prompt sharing the first 300 tokens hits the same 256."""
    prompt, ext = PROMPTS["p300"], PROMPTS["p300_ext"]
    want, want_ext = _reference(nemotron_h, prompt), _reference(nemotron_h, ext)
    llm = LLM(**engine_kwargs(nemotron_h, kv_transfer_config=ktc(PLUGIN_KTC), **MAMBA_ALIGN))
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        tokens, first, cached = _logprobs(llm, prompt)
        assert (tokens, cached) == (want, 0)
        (states,) = mamba_states
        assert all(e is not None for e in _state_entries(states, prompt, 256))
        assert llm.reset_prefix_cache()
        assert _logprobs(llm, prompt) == (want, first, 256)
        m = metrics_of(llm)
        assert m.get("vllm:lmcache_loaded_tokens", 0) == 256, m
        assert m.get("vllm:lmcache_failed_load_tokens", 0) == 0, m
        assert llm.reset_prefix_cache()
        assert _generate(llm, ext) == (want_ext, 256)
    finally:
        shutdown_engine(llm)


def test_mamba_hit_on_top_of_vllms_own_hit(nemotron_h):
    """vLLM holds the first 128 tokens (its own cache, from a shorter prompt), lmcache the
    first 256: lmcache loads [128, 256) and the state after 256 tokens, tokens identical."""
    prompt = PROMPTS["p300"]
    want = _reference(nemotron_h, prompt)
    llm = LLM(**engine_kwargs(nemotron_h, kv_transfer_config=ktc(PLUGIN_KTC), **MAMBA_ALIGN))
    try:
        assert _generate(llm, prompt) == (want, 0)
        assert llm.reset_prefix_cache()
        assert _generate(llm, prompt[:150])[1] == 128  # lmcache's hit, now in vLLM's cache
        loaded = metrics_of(llm).get("vllm:lmcache_loaded_tokens", 0)
        assert _generate(llm, prompt) == (want, 256)
        assert metrics_of(llm).get("vllm:lmcache_loaded_tokens", 0) - loaded == 128
    finally:
        shutdown_engine(llm)


def test_mamba_state_damaged_or_missing_is_no_hit(nemotron_h, mamba_states):
    """A damaged state fails its checksum and its boundary is no hit: the chunk boundary below
    is. With no state left, no token is loaded. Every request gives vLLM's tokens."""
    prompt = PROMPTS["p300"]
    want = _reference(nemotron_h, prompt)
    llm = LLM(**engine_kwargs(nemotron_h, kv_transfer_config=ktc(PLUGIN_KTC), **MAMBA_ALIGN))
    try:
        tokens, first, _ = _logprobs(llm, prompt)
        assert tokens == want
        (states,) = mamba_states
        at_256 = _state_entries(states, prompt, 256)
        with torch.inference_mode():
            at_256[0].lease.tensor[7] ^= 1  # one bit of group 0's state after 256 tokens
        assert llm.reset_prefix_cache()
        assert _logprobs(llm, prompt) == (want, first, 192)
        for n in range(CHUNK, 257, CHUNK):
            for entry in _state_entries(states, prompt, n):
                if entry is not None:
                    entry.lease.tensor.zero_()
        assert llm.reset_prefix_cache()
        assert _logprobs(llm, prompt) == (want, first, 0)
        m = metrics_of(llm)
        assert m.get("vllm:lmcache_failed_load_tokens", 0) == 0, m
    finally:
        shutdown_engine(llm)


def test_mamba_state_of_another_boundary_changes_the_output(nemotron_h, mamba_states):
    """Control: the state after 192 tokens stored under the key of the state after 256 (with
    its checksum) is loaded, and the logprobs differ from the first run's."""
    from lmcache.tiers import tensor_checksum

    prompt = PROMPTS["p300"]
    llm = LLM(**engine_kwargs(nemotron_h, kv_transfer_config=ktc(PLUGIN_KTC), **MAMBA_ALIGN))
    try:
        _, first, _ = _logprobs(llm, prompt)
        (states,) = mamba_states
        for wrong, right in zip(
            _state_entries(states, prompt, 192), _state_entries(states, prompt, 256), strict=True
        ):
            right.lease.tensor.copy_(wrong.lease.tensor)
            right.checksum = tensor_checksum(right.lease.tensor)
        assert llm.reset_prefix_cache()
        _, lps, cached = _logprobs(llm, prompt)
        assert cached == 256 and lps != first
    finally:
        shutdown_engine(llm)


@pytest.mark.parametrize(
    ("retention", "length", "hit"),
    [(0, 300, 0), (0, 260, 256), (128, 300, 256)],
    ids=["default-p300", "default-p260", "every-128-p300"],
)
def test_mamba_hits_need_a_retained_state(nemotron_h, retention, length, hit, caplog):
    """vLLM keeps states at multiples of its retention interval, and with the default (0) only
    at the last block boundary before the prompt's end. Hits end on chunk boundaries (64): for
    300 tokens that last state (288) is none, and nothing is loaded; for 260 tokens it is
    (256), and the hit loads it. lmcache warns at start-up, naming the interval to set. Every
    128 tokens: a hit at 256, no warning."""
    prompt = PROMPTS["p300"][:length]
    want = _reference(nemotron_h, prompt)
    engine = dict(MAMBA_ALIGN, prefix_cache_retention_interval=retention)
    llm = LLM(**engine_kwargs(nemotron_h, kv_transfer_config=ktc(PLUGIN_KTC), **engine))
    warned = "--prefix-cache-retention-interval set to a multiple of 64" in caplog.text
    assert warned == (retention == 0)
    try:
        assert _generate(llm, prompt) == (want, 0)
        assert llm.reset_prefix_cache()
        assert _generate(llm, prompt) == (want, hit)
    finally:
        shutdown_engine(llm)


def test_in_tree_name_cannot_start_a_mamba_hybrid(nemotron_h):
    """vLLM turns its hybrid manager off for its in-tree wrapper, and a Mamba hybrid cannot run
    without it: vLLM refuses at start-up, before lmcache runs (the README and docs/hybrid.md
    point to ``LMCacheConnector``)."""
    with pytest.raises(ValueError, match="Failed to promote local KV cache specs"):
        LLM(
            **engine_kwargs(
                nemotron_h, kv_transfer_config=ktc(IN_TREE_KTC), enable_prefix_caching=False
            )
        )
