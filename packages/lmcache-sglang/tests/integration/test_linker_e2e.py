# SPDX-License-Identifier: Apache-2.0
"""lmcache through SGLang's hooks, end to end on the real CPU engine.

Both hooks that run on the CPU: the ``UnifiedCacheLinker`` (``lmcache_sglang.linker``) and
``--enable-lmcache`` (SGLang's ``LMCacheUnifiedRadixCache`` importing
``lmcache.integration.sglang.*``, running in process on our engine). generate ->
``flush_cache()`` (empties SGLang's radix tree) -> generate: the second run restores the
prompt's prefix from lmcache and its greedy output equals a run without lmcache. The tests that
start engines of their own are in ``test_own_engines.py``: SGLang's ``Engine.shutdown()`` kills
every child process of the test process, so no two engines may overlap.
"""

from __future__ import annotations

from typing import Any

from .conftest import BATCH, PROMPTS, external_hit, flush, generate, min_hit


def test_flush_then_reload_is_identical(
    hook_engine: tuple[str, Any], reference: dict[str, Any]
) -> None:
    hook, engine = hook_engine
    first = generate(engine, "a")
    assert first["output_ids"] == reference["a"]
    flush(engine)
    second = generate(engine, "a")
    assert external_hit(second) >= min_hit(hook, "a") > 0, second["meta_info"]
    assert second["output_ids"] == reference["a"]


def test_prompt_extending_a_stored_prefix(
    hook_engine: tuple[str, Any], reference: dict[str, Any]
) -> None:
    hook, engine = hook_engine
    generate(engine, "a")
    flush(engine)
    out = generate(engine, "a_ext")
    assert external_hit(out) >= min_hit(hook, "a"), out["meta_info"]
    assert external_hit(out) < len(PROMPTS["a_ext"])
    assert out["output_ids"] == reference["a_ext"]


def test_two_prompts_in_one_batch(hook_engine: tuple[str, Any], reference: dict[str, Any]) -> None:
    hook, engine = hook_engine
    first = generate(engine, BATCH)
    assert [o["output_ids"] for o in first] == reference[BATCH]
    flush(engine)
    second = generate(engine, BATCH)
    for name, out in zip(BATCH, second, strict=True):
        assert external_hit(out) >= min_hit(hook, name) > 0, (name, out["meta_info"])
    assert [o["output_ids"] for o in second] == reference[BATCH]


def test_cache_salt_isolates_tenants(
    hook_engine: tuple[str, Any], reference: dict[str, Any]
) -> None:
    _, engine = hook_engine
    generate(engine, "d", cache_salt="tenant-1")
    flush(engine)
    other = generate(engine, "d", cache_salt="tenant-2")
    assert external_hit(other) == 0, other["meta_info"]
    assert other["output_ids"] == reference["d"]
    flush(engine)
    same = generate(engine, "d", cache_salt="tenant-1")
    assert external_hit(same) > 0, same["meta_info"]
    assert same["output_ids"] == reference["d"]
