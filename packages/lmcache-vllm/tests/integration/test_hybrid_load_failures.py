# SPDX-License-Identifier: Apache-2.0
"""Failed loads of a hybrid model on real vLLM 0.32 (CPU): reported per request, recomputed.

With several KV cache groups vLLM raises on block-level load errors, so lmcache loads every hit
asynchronously and reports a request whose load failed in any group in ``failed_recving``
(:mod:`lmcache_vllm.scheduler.async_loads`, :mod:`lmcache_vllm.worker.async_loads`).

The tiny Gemma-3 (5 sliding-window layers of window 64, one full-attention layer: 6 groups)
stores a prompt, then a hit of 256 tokens is loaded. The fault: one sliding group's load loses
its lease (as after the lease timeout) while that group's chunk inside the window is damaged in
lmcache's CPU tier, so the load reads the tier, the chunk fails its checksum and the group's load
comes up short. The other five groups load in full. vLLM must never compute with that KV:

- ``kv_load_failure_policy="recompute"``: the request (a longer prompt, 6 chunks) is
  recomputed, its tokens are vLLM's without lmcache, the failure is counted
  (``failed_load_tokens``, ``checksum_failures``), the recompute stores the good chunk back, and
  the next request hits every chunk with vLLM's tokens (no chunk was computed over the failed
  KV: the loading step computes nothing for the request);
- ``"fail"`` (vLLM's default): the request ends with an error and no token, and the engine goes
  on serving: the next request hits what is left (192 tokens) with the right tokens.

A clean hit through the asynchronous path is counted as a hit, tokens identical. Without
``failed_recving`` (vLLM 0.26, played here by hiding it from our class) a hybrid model is stored
and never loaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import LLM, SamplingParams

from lmcache.keys import chunk_keys
from lmcache_vllm.connector import LMCacheConnectorV1
from lmcache_vllm.scheduler.async_loads import AsyncLoadsSchedulerSide
from lmcache_vllm.worker.grouped import GroupedWorkerSide

from .conftest import MAX_TOKENS, PROMPTS, engine_kwargs, ktc, metrics_of, process_tier
from .conftest import shutdown_engine as _shutdown
from .test_hybrid_models import PLUGIN_KTC, gemma3, gemma3_want  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow

CHUNK = 64
BAD = 3  # the damaged chunk: tokens [192, 256), inside the sliding window of a 256-token hit


def _engine(model: Path, policy: str) -> LLM:
    cfg = {**ktc(PLUGIN_KTC, checksum=True), "kv_load_failure_policy": policy}
    return LLM(**engine_kwargs(model, kv_transfer_config=cfg))


def _gen(llm: LLM, prompt: list[int]) -> tuple[list[int], int, str | None]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    done = out.outputs[0]
    return list(done.token_ids), int(out.num_cached_tokens or 0), done.finish_reason


def _worker() -> GroupedWorkerSide:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group()._impl.worker
    assert isinstance(worker, GroupedWorkerSide) and worker.async_loads is not None
    return worker


def _eventually(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


@pytest.fixture
def async_hits(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int | None, bool]]:
    """What our connector answered vLLM's ``get_num_new_matched_tokens`` with."""
    seen: list[tuple[int | None, bool]] = []
    original = LMCacheConnectorV1.get_num_new_matched_tokens

    def record(self: Any, request: Any, num_computed_tokens: int) -> Any:
        out = original(self, request, num_computed_tokens)
        seen.append(out)
        return out

    monkeypatch.setattr(LMCacheConnectorV1, "get_num_new_matched_tokens", record)
    return seen


class _Fault:
    """The first sliding group's stream: its next load loses its lease while the group's chunk
    ``BAD`` of the prompt is damaged in the CPU tier (once)."""

    def __init__(self, worker: GroupedWorkerSide, prompt: list[int]) -> None:
        index = next(i for i, g in enumerate(worker.groups) if g.kind == "sliding")
        self.stream = worker.streams[index]
        engine = self.stream.lmcache_engine
        assert engine is not None
        self.key = chunk_keys(prompt, engine.metadata.fingerprint(), CHUNK, salt="\0")[BAD]
        self.tier = process_tier()
        _eventually(lambda: self.tier.contains(self.key), "the group's chunk is stored")
        self.entry = self.tier._entries[self.key]
        self.good = self.entry.lease.tensor.clone()
        self.fired = 0
        leases = self.stream._leases
        take = leases.take

        def faulty(req_id: str) -> tuple[Any, Any]:
            held, looked = take(req_id)
            if self.fired or held is None:
                return held, looked
            self.fired += 1
            held.release()  # the lease is lost: the load reads the tier, verified
            with torch.inference_mode():  # the pool's slabs were made in vLLM's inference mode
                self.entry.lease.tensor.view(-1).view(torch.uint8)[4321] ^= 0x20
            return None, None

        leases.take = faulty  # type: ignore[method-assign]

    def stored_back(self) -> None:
        """The recompute stored the chunk again: a new entry with the good bytes."""

        def back() -> bool:
            entry = self.tier._entries.get(self.key)
            return entry is not None and entry is not self.entry

        _eventually(back, "the recompute stores the chunk again")
        got = self.tier._entries[self.key].lease.tensor
        torch.testing.assert_close(got, self.good, rtol=0, atol=0)


def _clean_hit(llm: LLM, want: list[int], hits: list[tuple[int | None, bool]]) -> None:
    """Store the prompt, reset vLLM's prefix cache, hit 256 tokens through the async path."""
    prompt = PROMPTS["p300"]
    assert _gen(llm, prompt) == (want, 0, "length")
    assert llm.reset_prefix_cache()
    hits.clear()
    assert _gen(llm, prompt) == (want, 256, "length")
    assert (256, True) in hits, hits  # reported as an asynchronous load
    m = metrics_of(llm)
    assert m.get("vllm:lmcache_loaded_tokens", 0) == 256, m
    assert m.get("vllm:lmcache_failed_load_tokens", 0) == 0, m


def test_failed_load_of_one_group_is_recomputed(gemma3, gemma3_want, async_hits):  # noqa: F811
    """``recompute``: a clean async hit; then one group's load of a longer prompt fails: the
    request is recomputed with vLLM's tokens, the failure counted, and nothing computed with the
    failed KV is stored (the failing step computes nothing for it); the good chunk is stored back
    and the longer prompt then hits every chunk it stored, with vLLM's tokens."""
    llm = _engine(gemma3, "recompute")
    want, prompt = gemma3_want["p300_ext"], PROMPTS["p300_ext"]  # p300 + 90 tokens: 6 chunks
    try:
        engine_core = llm.llm_engine.engine_core.engine_core
        assert isinstance(engine_core.scheduler.connector._impl.scheduler, AsyncLoadsSchedulerSide)
        _clean_hit(llm, gemma3_want["p300"], async_hits)
        fault = _Fault(_worker(), prompt)
        checksum_failures = metrics_of(llm).get("vllm:lmcache_checksum_failures", 0)
        assert llm.reset_prefix_cache()
        async_hits.clear()
        tokens, _, reason = _gen(llm, prompt)
        assert fault.fired == 1
        assert (tokens, reason) == (want, "length")  # recomputed: vLLM's own tokens
        assert async_hits[0] == (256, True) and (0, False) in async_hits[1:], async_hits
        m = metrics_of(llm)
        assert m.get("vllm:lmcache_failed_load_tokens", 0) == 256, m  # the whole request
        assert m.get("vllm:lmcache_loaded_tokens", 0) == 256, m  # only the clean hit's
        assert m.get("vllm:lmcache_checksum_failures", 0) == checksum_failures + 1, m
        fault.stored_back()
        assert llm.reset_prefix_cache()
        assert _gen(llm, prompt) == (want, 384, "length")  # chunks 0-5, 4 and 5 from the recompute
        assert metrics_of(llm).get("vllm:lmcache_loaded_tokens", 0) == 256 + 384
    finally:
        _shutdown(llm)


def test_failed_load_with_fail_policy_ends_the_request(gemma3, gemma3_want, async_hits):  # noqa: F811
    """``fail`` (vLLM's default policy): the request whose load failed ends with an error and no
    token; the engine goes on, and the next request hits the 192 tokens left, tokens right."""
    llm = _engine(gemma3, "fail")
    want = gemma3_want["p300"]
    prompt = PROMPTS["p300"]
    try:
        _clean_hit(llm, want, async_hits)
        fault = _Fault(_worker(), prompt)
        assert llm.reset_prefix_cache()
        tokens, _, reason = _gen(llm, prompt)
        assert fault.fired == 1 and reason == "error" and tokens == []
        assert metrics_of(llm).get("vllm:lmcache_failed_load_tokens", 0) == 256
        assert llm.reset_prefix_cache()
        assert _gen(llm, prompt) == (want, 192, "length")  # the damaged chunk left its tier
        fault.stored_back()
    finally:
        _shutdown(llm)


def test_without_failed_recving_a_hybrid_model_is_stored_never_loaded(
    gemma3,  # noqa: F811
    gemma3_want,  # noqa: F811
    async_hits,
    monkeypatch,
    caplog,
):
    """A vLLM without ``failed_recving`` (0.26), played by 0.32 with the feature hidden from
    our class: no hit is reported for several groups (one warning), every prompt is computed
    with vLLM's own tokens, and stored."""
    monkeypatch.setattr(LMCacheConnectorV1, "_lmcache_failed_recving", False)
    with caplog.at_level("WARNING"):
        llm = _engine(gemma3, "recompute")
    want = gemma3_want["p300"]
    try:
        assert sum("failed_recving" in r.getMessage() for r in caplog.records) == 1
        assert _gen(llm, PROMPTS["p300"]) == (want, 0, "length")
        assert llm.reset_prefix_cache()
        assert _gen(llm, PROMPTS["p300"]) == (want, 0, "length")
        assert async_hits and all(hit == (0, False) for hit in async_hits), async_hits
        m = metrics_of(llm)
        assert m.get("vllm:lmcache_stored_tokens", 0) > 0, m
        assert m.get("vllm:lmcache_loaded_tokens", 0) == 0, m
    finally:
        _shutdown(llm)
