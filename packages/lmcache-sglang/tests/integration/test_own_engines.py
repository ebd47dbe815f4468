# SPDX-License-Identifier: Apache-2.0
"""End-to-end tests that start engines of their own, one at a time (a separate module, so the
module-scoped engines of ``test_linker_e2e.py`` are shut down first: SGLang's
``Engine.shutdown()`` kills every child process of the test process).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .conftest import (
    PAGE,
    PROMPTS,
    enable_lmcache_kwargs,
    external_hit,
    flush,
    generate,
    linker_kwargs,
    min_hit,
    start_engine,
    write_lmcache_yaml,
)


def test_corrupted_load_changes_the_output(model_dir: Path, reference: dict[str, Any]) -> None:
    """Control: a linker that loads noise into the restored slots changes greedy output, so the
    identical outputs of test_linker_e2e.py come from the KV lmcache loaded (both hooks move KV
    with the same connector)."""
    engine = start_engine(
        model_dir,
        **linker_kwargs("CorruptingLinker", "lmcache_sglang.testing.corrupt_linker"),
    )
    try:
        assert generate(engine, "a")["output_ids"] == reference["a"]
        flush(engine)
        out = generate(engine, "a")
        assert external_hit(out) > 0, out["meta_info"]
        assert out["output_ids"] != reference["a"]
    finally:
        engine.shutdown()


def test_two_engines_in_sequence_share_the_disk_tier(
    model_dir: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    """SGLang runs each engine's scheduler in its own process, so what one engine leaves for the
    next lives in lmcache's disk tier (``local_disk``): the second engine starts cold and loads
    the first one's KV from the folder."""
    config = write_lmcache_yaml(
        tmp_path, local_disk=str(tmp_path / "disk"), max_local_disk_size=0.25
    )
    first = start_engine(model_dir, **enable_lmcache_kwargs(config))
    try:
        assert generate(first, "b")["output_ids"] == reference["b"]
        flush(first)  # waits for the store (and its write-through to the folder)
    finally:
        first.shutdown()
    second = start_engine(model_dir, **enable_lmcache_kwargs(config))
    try:
        out = generate(second, "b")
        assert external_hit(out) >= min_hit("enable_lmcache", "b") > 0, out["meta_info"]
        assert out["output_ids"] == reference["b"]
    finally:
        second.shutdown()


def test_linker_engines_in_sequence_load_pages_from_the_disk_tier(
    model_dir: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    """The linker cascades over lmcache's tiers: the first engine's offloads are written through
    to the disk tier (``local_disk``), and a second engine, whose CPU tier starts empty (its
    scheduler is a new process), restores the prompt's pages from the folder."""
    disk = tmp_path / "disk"
    kwargs = linker_kwargs(local_disk=str(disk), max_local_disk_size=0.25)
    first = start_engine(model_dir, **kwargs)
    try:
        assert generate(first, "c")["output_ids"] == reference["c"]
        flush(first)  # waits for the offloads (and their writes to the folder)
    finally:
        first.shutdown()
    pages = len(PROMPTS["c"]) // PAGE
    assert len(list(disk.rglob("*.lmc"))) >= pages - 1
    second = start_engine(model_dir, **kwargs)
    try:
        out = generate(second, "c")
        assert external_hit(out) >= min_hit("linker", "c") > 0, out["meta_info"]
        assert out["output_ids"] == reference["c"]
    finally:
        second.shutdown()
