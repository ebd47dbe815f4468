# SPDX-License-Identifier: Apache-2.0
"""The disk and Redis tiers under real vLLM (CPU): restarts, sharing, faults, corruption, salts.

Every check compares greedy output with the same prompt run without any connector. The Redis
tests start a real ``redis-server`` on 127.0.0.1 (skipped, with the reason, when none is
installed; ``.ci/run`` installs it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from lmcache.testing.redis_server import RedisServer, redis_server_path

from .conftest import BLOCK, CHUNK, MAX_TOKENS, PROMPTS, ktc, live_engine

pytestmark = pytest.mark.slow

needs_redis = pytest.mark.skipif(
    redis_server_path() is None,
    reason="no redis-server or valkey-server on PATH (apt-get install redis-server)",
)


def _disk(folder: Path, **more: Any) -> dict[str, Any]:
    return ktc(local_disk=str(folder), max_local_disk_size=0.5, **more)


def _lower_metric(name: str) -> float:
    return live_engine().metrics.value(name)


def _reset_process_tiers() -> None:
    """What a restart does to this process's tiers: CPU emptied, disk/Redis clients rebuilt."""
    from lmcache.tiers import reset_process_cpu_tiers

    reset_process_cpu_tiers()


# ------------------------------------------------------------------ disk, in this process


def test_disk_survives_losing_the_cpu_tier(run, baseline, tmp_path):
    folder = tmp_path / "kv"
    cold = run([PROMPTS["p300"]], _disk(folder))
    assert cold.tokens == [baseline["p300"]] and cold.cached == [0]
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    assert len(files) == 4, files  # 4 full chunks of 64 tokens (the 44-token tail is not saved)
    assert oct(folder.stat().st_mode & 0o777) == "0o700"
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o600"}
    _reset_process_tiers()  # the CPU tier is gone; the disk index is rebuilt from the folder
    warm = run([PROMPTS["p300"], PROMPTS["p300_ext"]], _disk(folder))
    assert warm.tokens == [baseline["p300"], baseline["p300_ext"]]
    # Both prompts start with the 4 stored chunks. Lookups with a disk tier run concurrently, so
    # either request may be admitted first: it loads the chunks from disk (verified, promoted),
    # and the other may then take them, plus a block, from vLLM's own prefix cache.
    assert all(c >= 256 for c in warm.cached), warm.cached
    assert warm.metrics["vllm:external_prefix_cache_hits"] >= 256, warm.metrics


class _Engine:
    """One in-process vLLM engine; ``gen`` resets vLLM's own prefix cache after each request,
    so every hit comes from lmcache."""

    def __init__(self, model_dir: Path, cfg: dict[str, Any]) -> None:
        from vllm import LLM, SamplingParams

        from .conftest import engine_kwargs

        self.llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=cfg))
        self.sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def gen(self, name: str, salt: str | None = None) -> tuple[list[int], int]:
        req: dict[str, Any] = {"prompt_token_ids": PROMPTS[name]}
        if salt is not None:
            req["cache_salt"] = salt
        (o,) = self.llm.generate([req], self.sp, use_tqdm=False)
        assert self.llm.reset_prefix_cache()
        return list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)

    def flush(self) -> None:
        for lower in live_engine().lower_tiers:
            assert lower.flush(30)

    def __enter__(self) -> _Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        from .conftest import shutdown_engine

        shutdown_engine(self.llm)


@pytest.fixture(params=["disk", pytest.param("redis", marks=needs_redis)])
def lower_cfg(request, tmp_path) -> Any:
    """lmcache extra config of a disk-only or Redis-only cache (``local_cpu: false``)."""
    if request.param == "disk":
        yield {"local_disk": str(tmp_path / "kv"), "max_local_disk_size": 0.5}
        return
    with RedisServer() as server:
        yield {"remote_url": server.url}


def test_lower_tier_only_staging_and_salts(model_dir, baseline, lower_cfg):
    """``local_cpu: false`` + one lower tier: host memory only stages; tenants never share."""
    with _Engine(model_dir, ktc(local_cpu=False, **lower_cfg)) as eng:
        assert eng.gen("p256", "tenant-a") == (baseline["p256"], 0)
        eng.flush()
        engine = live_engine()
        assert len(engine.tier) == 0  # nothing kept in host memory
        assert eng.gen("p256", "tenant-b") == (baseline["p256"], 0)  # other salt: no hit
        assert eng.gen("p256") == (baseline["p256"], 0)  # no salt: no hit either
        eng.flush()
        assert eng.gen("p256", "tenant-a") == (baseline["p256"], 224)  # block-aligned hit
        assert eng.gen("p256", "tenant-b") == (baseline["p256"], 224)
        assert eng.gen("p256") == (baseline["p256"], 224)
        assert len(engine.tier) == 0
        kind = "disk" if "local_disk" in lower_cfg else "remote"
        assert engine.metrics.value(f"{kind}_hit_chunks") >= 12


def test_model_rebuilt_in_place_never_meets_its_old_kv(tmp_path):
    """A model folder rebuilt with other weights at the same path, then a restart over the
    same disk folder: the old chunks are never loaded (the keys cover the weights' digest), and
    a restart of the unchanged model still hits."""
    from vllm import LLM, SamplingParams

    from lmcache_vllm.testing import build_tiny_llama

    from .conftest import engine_kwargs, shutdown_engine

    geometry = {
        "hidden_size": 256,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 64,
        "vocab_size": 1000,
        "max_position_embeddings": 2048,
    }
    model = tmp_path / "model"
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPTS["p300"]}

    def gen(cfg: dict[str, Any] | None, **kw: Any) -> tuple[list[int], int]:
        llm = LLM(**engine_kwargs(model, kv_transfer_config=cfg, **kw))
        try:
            (o,) = llm.generate([prompt], sp, use_tqdm=False)
            return list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0)
        finally:
            shutdown_engine(llm)

    cfg = _disk(tmp_path / "kv")
    build_tiny_llama(model, seed=11, **geometry)
    old, cached = gen(cfg)
    assert cached == 0
    _reset_process_tiers()
    assert gen(cfg) == (old, 256)  # the same weights after a restart: a disk hit
    build_tiny_llama(model, seed=12, **geometry)  # same path, other weights
    _reset_process_tiers()
    new, _ = gen(None, enable_prefix_caching=False)
    assert new != old  # else a wrong hit could not show
    assert gen(cfg) == (new, 0)


def test_disk_corruption_is_a_recompute(run, baseline, tmp_path):
    folder = tmp_path / "kv"
    run([PROMPTS["p256"]], _disk(folder))
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    assert len(files) == 4
    # Flip one payload bit of one chunk's file (any of the 4: the hit must end at it).
    victim = files[1]
    original = victim.read_bytes()
    data = bytearray(original)
    data[-2] ^= 0x01
    victim.write_bytes(bytes(data))
    _reset_process_tiers()
    out = run([PROMPTS["p256"]], _disk(folder))
    assert out.tokens == [baseline["p256"]]  # never the corrupted bytes
    assert out.cached[0] < 224  # the hit ends at the corrupted chunk
    # The bad entry was deleted, and the recomputed chunk written back in its place.
    assert victim.read_bytes() == original


RESTART_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams

    def main():
        model, prompt, chunk, block, max_tokens, extra = json.loads(sys.argv[1])
        cfg = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
               "kv_connector_extra_config": {"lmcache.chunk_size": chunk,
                                             "lmcache.max_local_cpu_size": 0.25, **extra}}
        if "module" in sys.argv[2:]:
            cfg["kv_connector_module_path"] = "lmcache_vllm.connector"
        if "plugin" in sys.argv[2:]:  # the name our vllm.general_plugins entry point registers
            cfg["kv_connector"] = "LMCacheConnector"
        llm = LLM(model=model, enforce_eager=True, block_size=block, dtype="float32",
                  max_model_len=1024, kv_cache_memory_bytes=64 << 20, seed=0,
                  kv_transfer_config=cfg)
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        (a,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        print("RESULT " + json.dumps([list(a.outputs[0].token_ids), a.num_cached_tokens]),
              flush=True)

    if __name__ == "__main__":
        main()
    """
)


def _run_process(
    tmp_path: Path, model_dir: Path, prompt: list[int], extra: dict[str, Any], *flags: str, **env
) -> tuple[list[int], int]:
    script = tmp_path / "restart_run.py"
    script.write_text(RESTART_SCRIPT)
    environ = dict(os.environ)
    environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default multiprocess mode
    environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **env)
    args = json.dumps([str(model_dir), prompt, CHUNK, BLOCK, MAX_TOKENS, extra])
    proc = subprocess.run(
        [sys.executable, str(script), args, *flags],
        cwd=tmp_path,
        env=environ,
        capture_output=True,
        text=True,
        timeout=400,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    tokens, cached = json.loads(lines[-1][len("RESULT ") :])
    return tokens, int(cached or 0)


def test_disk_restart_in_new_processes(model_dir, baseline, tmp_path):
    """Process 1 stores (module-path connector, extra config); process 2, a new engine after a
    restart, loads from the folder through our plugin's name with ``LMCACHE_LOCAL_DISK``."""
    folder = tmp_path / "kv"
    extra = {"lmcache.local_disk": f"file://{folder}", "lmcache.max_local_disk_size": 0.5}
    assert _run_process(tmp_path, model_dir, PROMPTS["p300"], extra, "module") == (
        baseline["p300"],
        0,
    )
    env = {"LMCACHE_LOCAL_DISK": str(folder), "LMCACHE_MAX_LOCAL_DISK_SIZE": "0.5"}
    assert _run_process(tmp_path, model_dir, PROMPTS["p300"], {}, "plugin", **env) == (
        baseline["p300"],
        256,
    )


# ------------------------------------------------------------------ Redis


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer() as server:
        yield server


@needs_redis
def test_redis_shared_by_two_engine_processes(model_dir, baseline, tmp_path, redis_server):
    """Two separate engine processes share one server: the second hits the first's prompt.
    The second runs LMCache's ``local_cpu: false`` form with ``LMCACHE_REMOTE_URL``, loaded through
    vLLM's in-tree name."""
    extra = {"lmcache.remote_url": redis_server.url}
    assert _run_process(tmp_path, model_dir, PROMPTS["p300"], extra, "module") == (
        baseline["p300"],
        0,
    )
    env = {"LMCACHE_REMOTE_URL": redis_server.url, "LMCACHE_LOCAL_CPU": "false"}
    assert _run_process(tmp_path, model_dir, PROMPTS["p300"], {}, **env) == (
        baseline["p300"],
        256,
    )


@needs_redis
def test_redis_down_paused_and_back(model_dir, baseline, redis_server):
    """Server stopped: requests succeed as misses; restarted: hits resume in the same engine.
    Paused (SIGSTOP): each request still succeeds, within the configured timeout."""
    from vllm import LLM, SamplingParams

    from .conftest import engine_kwargs, shutdown_engine

    cfg = ktc(remote_url=redis_server.url, local_cpu=False, remote_timeout=0.5)
    llm = LLM(**engine_kwargs(model_dir, kv_transfer_config=cfg))
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

        def gen(name: str) -> tuple[list[int], int, float]:
            started = time.perf_counter()
            (o,) = llm.generate([{"prompt_token_ids": PROMPTS[name]}], sp, use_tqdm=False)
            assert llm.reset_prefix_cache()
            took = time.perf_counter() - started
            return list(o.outputs[0].token_ids), int(o.num_cached_tokens or 0), took

        def flush() -> None:
            assert live_engine().lower_tiers[0].flush(30)

        assert gen("p256")[:2] == (baseline["p256"], 0)
        flush()
        assert gen("p256")[:2] == (baseline["p256"], 224)
        redis_server.stop()
        for name in ("p256", "c200", "p300"):
            assert gen(name)[:2] == (baseline[name], 0)  # misses, never errors
        flush()
        redis_server.start()  # empty again (no persistence); the tier reconnects by itself
        deadline = time.monotonic() + 30
        while True:
            gen("c200")
            flush()
            tokens, cached, _ = gen("c200")
            assert tokens == baseline["c200"]
            if cached == 192 or time.monotonic() > deadline:
                break
            time.sleep(1.0)  # the breaker's cool-down
        assert cached == 192
        redis_server.pause()
        try:
            for name in ("d230", "p300"):
                tokens, cached, took = gen(name)
                assert (tokens, cached) == (baseline[name], 0)
                assert took < 20, took  # bounded by the timeout (a few operations), not hanging
        finally:
            redis_server.resume()
        assert live_engine().metrics.value("tier_errors") > 0
    finally:
        shutdown_engine(llm)


@needs_redis
def test_redis_corruption_is_a_recompute(model_dir, baseline, redis_server):
    import redis

    client = redis.Redis.from_url(redis_server.url)
    with _Engine(model_dir, ktc(remote_url=redis_server.url, local_cpu=False)) as eng:
        assert eng.gen("p256") == (baseline["p256"], 0)
        eng.flush()
        names = sorted(client.scan_iter(match="lmcache:*"))
        assert len(names) == 4, names
        for name in names:  # flip one payload bit of every chunk
            value = bytearray(client.get(name))
            value[-1] ^= 0x80
            client.set(name, bytes(value))
        assert eng.gen("p256") == (baseline["p256"], 0)  # never the flipped bytes
        engine = live_engine()
        assert engine.metrics.value("checksum_failures") == 1  # the first chunk ends the hit
        assert engine.metrics.value("remote_hit_chunks") == 0
