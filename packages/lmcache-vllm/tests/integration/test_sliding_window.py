# SPDX-License-Identifier: Apache-2.0
"""A sliding-window model on real vLLM (CPU): a prompt longer than the window is stored, and a
hit after a reset loads it with output identical to vLLM without lmcache.

The tiny Llama's weights are served as a Mistral with ``sliding_window`` (the same weights and
layout; every layer attends to the last 64 tokens only), so vLLM's sliding-window KV cache
manager runs with the connector.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from vllm import LLM, SamplingParams

from .conftest import MAX_TOKENS, PROMPTS, engine_kwargs, ktc, metrics_of, shutdown_engine

WINDOW = 64


@pytest.fixture(scope="module")
def sliding_model(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sliding") / "tiny-mistral"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=WINDOW)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _generate(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


@pytest.mark.parametrize(
    "engine",
    [{}, {"max_num_batched_tokens": 64, "enable_chunked_prefill": True}],
    ids=["one-step-prefill", "chunked-prefill"],
)
def test_sliding_window_model_hits_with_identical_output(sliding_model, baseline, engine):
    """With chunked prefill (64 tokens a step) a chunk is saved steps after its first tokens
    were computed, and vLLM may have dropped those blocks (out of the window) by then; the
    output after the hit stays identical (the KV out of the window is never attended to)."""
    prompt = PROMPTS["p300"]  # 4 full chunks + a tail: far longer than the window
    ref = LLM(**engine_kwargs(sliding_model, enable_prefix_caching=False))
    try:
        want, _ = _generate(ref, prompt)
    finally:
        shutdown_engine(ref)
    assert want != baseline["p300"]  # the window changes the output: it is in effect

    llm = LLM(**engine_kwargs(sliding_model, kv_transfer_config=ktc(), **engine))
    try:
        assert _generate(llm, prompt) == (want, 0)
        assert llm.reset_prefix_cache()
        assert _generate(llm, prompt) == (want, 256)
        m = metrics_of(llm)
        assert m.get("vllm:lmcache_loaded_tokens", 0) >= 256, m
    finally:
        shutdown_engine(llm)
