# SPDX-License-Identifier: Apache-2.0
"""Real vLLM (CPU build) with the XPU backend's stand-in forced in.

vLLM runs on the CPU as usual; lmcache's adapter builds its connector under ``vllm.xpu``
(:func:`lmcache_xpu.testing.force_engine_device`) and reaches the KV caches only through the
:class:`~lmcache_xpu.device.XpuBackend` over the recording ``torch.xpu`` stand-in
(:func:`lmcache_xpu.testing.fake_xpu`): streams, events, copies, synchronisation. A store, then a
hit in a fresh engine, must give output identical to vLLM without lmcache, and no CUDA function
may be called: the engine path does not depend on CUDA names.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import vllm  # noqa: F401  - in `nox -s xpu` a missing or broken vLLM must fail, not skip

from lmcache_vllm.testing import build_tiny_llama, make_prompt
from lmcache_xpu.testing import FakeXpu, force_engine_device

CHUNK, BLOCK, MAX_TOKENS = 64, 32, 12
PROMPT = make_prompt(300, 1)  # 4 full chunks + a 44-token tail
KTC = {
    "kv_connector": "LMCacheConnectorV1",
    "kv_connector_module_path": "lmcache_vllm.connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"lmcache.chunk_size": CHUNK, "lmcache.max_local_cpu_size": 0.25},
}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    folder = Path(tempfile.gettempdir()) / f"lmcache-vllm-tests-{os.getuid()}" / "tiny-llama"
    return build_tiny_llama(
        folder,
        hidden_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=1000,
        max_position_embeddings=2048,
    )


def _generate(model_dir: Path, kv_transfer_config: dict[str, Any] | None) -> tuple[list[int], int]:
    from vllm import LLM, SamplingParams

    from lmcache_vllm.testing import shutdown_llm, vllm_engine_kwargs

    kw = vllm_engine_kwargs(
        model_dir,
        block_size=BLOCK,
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory_bytes=64 << 20,
    )
    if kv_transfer_config is None:
        kw["enable_prefix_caching"] = False
    llm = LLM(**kw, kv_transfer_config=kv_transfer_config)
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        (out,) = llm.generate([{"prompt_token_ids": PROMPT}], sp, use_tqdm=False)
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)
    finally:
        shutdown_llm(llm)


@pytest.fixture
def fresh_tier() -> Iterator[None]:
    from lmcache.tiers import reset_process_cpu_tiers

    reset_process_cpu_tiers()
    yield
    reset_process_cpu_tiers()


def test_store_then_hit_through_vllm_xpu_matches_vllm_alone(
    model_dir: Path, fresh_tier: None, xpu: FakeXpu
) -> None:
    with force_engine_device("xpu") as keys:
        cold_tokens, cold_cached = _generate(model_dir, KTC)
        stored_calls = list(xpu.calls)
        xpu.clear()
        warm_tokens, warm_cached = _generate(model_dir, KTC)
    assert keys == ["vllm.xpu", "vllm.xpu"]  # one connector per engine, under the XPU key
    # vLLM without lmcache, after the lmcache runs (the stand-in is still in, and unused)
    baseline, _ = _generate(model_dir, None)
    assert cold_cached == 0 and warm_cached == 256  # 4 chunks stored, then hit
    assert cold_tokens == baseline and warm_tokens == baseline
    for calls in (stored_calls, xpu.calls):
        names = {c.name for c in calls}
        assert {"Stream", "stream"} <= names, names  # the backend's own streams, used
        assert {c.device for c in calls} <= {"xpu:0", ""}
    # the store: events recorded on the backend's streams and waited for
    assert {"Event.record", "Event.synchronize"} <= {c.name for c in stored_calls}
    # the load: ordered after the engine's stream, run on a stream of the backend's, and
    # waited for before it returns. (vLLM's CPU block format moves its bytes host to host,
    # so the copies themselves are no backend calls here; the unit tests record them.)
    created = {id(c.detail[0]) for c in xpu.of("Stream")}
    loaded_on = {id(c.detail[0]) for c in xpu.of("stream")}
    assert loaded_on and loaded_on <= created
    assert xpu.of("Stream.wait_stream")
    calls = xpu.calls
    last_enqueue = max(i for i, c in enumerate(calls) if c.name == "stream")
    load = calls[last_enqueue].detail[0]
    assert any(
        c.name == "Stream.synchronize" and c.detail[0] is load for c in calls[last_enqueue:]
    ), [c.name for c in calls[last_enqueue:]]
