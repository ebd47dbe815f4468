# SPDX-License-Identifier: Apache-2.0
"""Real SGLang (CPU engine) with a tiny random Llama built at test time.

``sgl.Engine`` spawns its scheduler; each fixture starts one engine and shuts it down after its
tests. Greedy outputs are compared token for token with a run of the same prompts on an engine
without lmcache (computed once per session). Run from a folder holding no directory named like
the plug-in (spawned processes put the script's folder first on ``sys.path``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import sglang  # noqa: F401  - in `nox -s sglang` a missing or broken SGLang must fail, not skip

from lmcache_sglang.testing import build_tiny_llama, make_prompt, sglang_engine_kwargs

PAGE = 16
CHUNK = 64  # lmcache chunk size of the --enable-lmcache tests
MAX_TOKENS = 8
SAMPLING = {"temperature": 0.0, "max_new_tokens": MAX_TOKENS}

PROMPTS: dict[str, list[int]] = {
    "a": make_prompt(200, 1),  # 12 full pages + 8 tokens
    "b": make_prompt(150, 3),
    "c": make_prompt(170, 4),
    "d": make_prompt(120, 5),
}
PROMPTS["a_ext"] = PROMPTS["a"] + make_prompt(90, 2)  # extends a: its 12 pages are a hit
BATCH = ("b", "c")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    folder = Path(tempfile.gettempdir()) / f"lmcache-sglang-tests-{os.getuid()}" / "tiny-llama"
    return build_tiny_llama(folder, max_position_embeddings=2048)


def start_engine(model_dir: Path, **overrides: Any) -> Any:
    """An ``sgl.Engine`` on the CPU with the tiny model."""
    import sglang as sgl

    return sgl.Engine(**sglang_engine_kwargs(model_dir, **overrides))


def linker_kwargs(
    linker: str = "LMCacheLinker", module: str = "lmcache_sglang.linker", **extra: Any
) -> dict[str, Any]:
    """Engine arguments loading an lmcache linker (256 MiB CPU tier unless ``extra`` says)."""
    config = {"max_local_cpu_size": 0.25, **extra}
    return {
        "enable_unified_cache_external_linker": True,
        "unified_cache_external_linker_backend": "dynamic",
        "unified_cache_external_linker_config": {
            "linker": linker,
            "linker_module_path": module,
            "linker_extra_config": config,
        },
    }


def write_lmcache_yaml(folder: Path, **extra: Any) -> Path:
    """An ``--lmcache-config-file`` with LMCache's daemon keys (ignored) and ours."""
    import yaml

    path = folder / "lmcache.yaml"
    config = {
        "mp_host": "127.0.0.1",
        "mp_port": 5556,
        "chunk_size": CHUNK,
        "max_local_cpu_size": 0.25,
        **extra,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def enable_lmcache_kwargs(config_file: Path) -> dict[str, Any]:
    """Engine arguments of SGLang's ``--enable-lmcache`` hook with our YAML."""
    return {"enable_lmcache": True, "lmcache_config_file": str(config_file)}


def flush(engine: Any, timeout: float = 60.0) -> None:
    """``flush_cache()`` once SGLang is idle (pending lmcache stores finish first)."""
    import time

    deadline = time.monotonic() + timeout
    while not engine.flush_cache().success:
        assert time.monotonic() < deadline, "flush_cache() kept failing: SGLang never went idle"
        time.sleep(0.2)


def generate(engine: Any, names: str | tuple[str, ...], **kw: Any) -> Any:
    """Greedy outputs of one prompt (a dict) or a batch (a list of dicts)."""
    if isinstance(names, str):
        return engine.generate(input_ids=PROMPTS[names], sampling_params=SAMPLING, **kw)
    return engine.generate(input_ids=[PROMPTS[n] for n in names], sampling_params=SAMPLING, **kw)


def external_hit(out: dict[str, Any]) -> int:
    """Tokens of a request restored from outside SGLang's device cache: lmcache's pages
    (``host`` for the linker, ``storage`` for ``--enable-lmcache``; SGLang has no host or
    storage tier of its own in these tests)."""
    details = out["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("host", 0) or 0) + int(details.get("storage", 0) or 0)


@pytest.fixture(scope="session")
def reference(model_dir: Path) -> dict[str, Any]:
    """Greedy output ids of every prompt (and of the batch) on an engine without lmcache."""
    engine = start_engine(model_dir)
    try:
        out: dict[str, Any] = {}
        for name in PROMPTS:
            out[name] = generate(engine, name)["output_ids"]
            assert engine.flush_cache().success
        out[BATCH] = [o["output_ids"] for o in generate(engine, BATCH)]
    finally:
        engine.shutdown()
    return out


@pytest.fixture(scope="module", params=["linker", "enable_lmcache"])
def hook_engine(
    request: pytest.FixtureRequest,
    model_dir: Path,
    reference: dict[str, Any],
    tmp_path_factory: Any,
) -> Iterator[tuple[str, Any]]:
    """An engine with lmcache through one hook: ``(hook, engine)``."""
    if request.param == "linker":
        engine = start_engine(model_dir, **linker_kwargs())
    else:
        config = write_lmcache_yaml(tmp_path_factory.mktemp("lmcache"))
        engine = start_engine(model_dir, **enable_lmcache_kwargs(config))
    yield request.param, engine
    engine.shutdown()


def min_hit(hook: str, name: str) -> int:
    """Tokens a reload of prompt ``name`` must restore at least: every lmcache unit (SGLang page
    for the linker, lmcache chunk for ``--enable-lmcache``) but the last one."""
    unit = PAGE if hook == "linker" else CHUNK
    return len(PROMPTS[name]) // unit * unit - unit
