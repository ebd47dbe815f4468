# SPDX-License-Identifier: Apache-2.0
"""Several vLLM engines in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

vLLM keeps one worker-side KV connector per process (``kv_transfer_state._KV_CONNECTOR_AGENT``):
a second engine created while the first is alive does not build its own, it calls
``register_kv_caches`` on the first engine's connector with its own tensors, whether or not its
own config names a connector. Accepting that would move KV between one engine's pages and the
other's; the connector must refuse it with an error that names the fix, and the first engine must
keep answering correctly. Engines one after the other share the process CPU tier (see
``test_e2e.test_store_then_hit_in_fresh_engine``); resetting one model's lmcache must not drop
another model's chunks.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from lmcache_vllm.testing import build_tiny_llama

from .conftest import MAX_TOKENS, PROMPTS, engine_kwargs, ktc, shutdown_engine


def _engine(model_dir: Path, **overrides: Any) -> Any:
    from vllm import LLM

    return LLM(**engine_kwargs(model_dir, **overrides))


def _gen(llm: Any, name: str) -> tuple[list[int], int]:
    """``(greedy tokens, num_cached_tokens)`` of ``PROMPTS[name]``, vLLM's own cache emptied
    first (so a cached token can only come from lmcache)."""
    from vllm import SamplingParams

    assert llm.reset_prefix_cache()
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (o,) = llm.generate([{"prompt_token_ids": PROMPTS[name]}], sp, use_tqdm=False)
    return list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)


def _messages(exc: BaseException) -> str:
    """The messages of ``exc`` and of the exceptions it was raised from."""
    out, seen = [], set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or cur.__context__
    return " <- ".join(out)


@pytest.mark.parametrize(
    "second_has_connector", [True, False], ids=["second-with-lmcache", "second-without-lmcache"]
)
def test_second_live_engine_is_refused_first_keeps_answering(
    model_dir, baseline, second_has_connector
):
    first = _engine(model_dir, kv_transfer_config=ktc())
    second = None
    try:
        assert _gen(first, "p300") == (baseline["p300"], 0)  # stores 4 chunks

        error: Exception | None = None
        try:
            second = _engine(model_dir, kv_transfer_config=ktc() if second_has_connector else None)
        except Exception as exc:
            error = exc
        assert error is not None, (
            "a second engine was created in this process while the first was alive; its "
            "register_kv_caches landed on the first engine's lmcache connector"
        )
        text = _messages(error)
        del error  # its traceback holds the half-built engine
        # The error names the fix: one engine per process, or vLLM's multiprocess mode.
        low = text.lower()
        assert "one engine per process" in low or "vllm_enable_v1_multiprocessing" in low, text

        # The first engine is untouched: it hits what it stored and answers as without lmcache.
        assert _gen(first, "p300") == (baseline["p300"], 256)
        assert _gen(first, "c200") == (baseline["c200"], 0)
        assert _gen(first, "c200") == (baseline["c200"], 192)
    finally:
        if second is not None:
            shutdown_engine(second)
            second = None
        shutdown_engine(first)

    # The refusal does not stick: once the first engine is gone, a new one works and hits.
    third = _engine(model_dir, kv_transfer_config=ktc())
    try:
        assert _gen(third, "p300") == (baseline["p300"], 256)
    finally:
        shutdown_engine(third)


@pytest.fixture(scope="module")
def model_y() -> Path:
    """A second tiny Llama: 3 layers instead of 2, other weights (seed 1)."""
    folder = Path(tempfile.gettempdir()) / f"lmcache-vllm-tests-{os.getuid()}" / "tiny-llama-y"
    return build_tiny_llama(
        folder,
        hidden_size=256,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=1000,
        max_position_embeddings=2048,
        seed=1,
    )


def test_reset_connector_keeps_other_models_chunks(model_dir, model_y, baseline, run):
    """``reset_prefix_cache(reset_connector=True)`` on model X empties X's lmcache only."""
    y_baseline = run([PROMPTS["p300"]], None, model=str(model_y), enable_prefix_caching=False)
    y_expected = y_baseline.tokens[0]
    assert y_expected != baseline["p300"]  # control: the two models answer differently

    y_cold = run([PROMPTS["p300"]], ktc(), model=str(model_y))
    assert (y_cold.tokens[0], y_cold.cached) == (y_expected, [0])  # stores 4 chunks of Y

    x = _engine(model_dir, kv_transfer_config=ktc())
    try:
        assert _gen(x, "p300") == (baseline["p300"], 0)  # stores X's 4 chunks
        assert _gen(x, "p300") == (baseline["p300"], 256)
        assert x.reset_prefix_cache(reset_connector=True)
        assert _gen(x, "p300") == (baseline["p300"], 0)  # X's chunks are gone
    finally:
        shutdown_engine(x)

    y_warm = run([PROMPTS["p300"]], ktc(), model=str(model_y))
    assert y_warm.tokens[0] == y_expected
    assert y_warm.cached == [256], "resetting model X's lmcache dropped model Y's chunks"
