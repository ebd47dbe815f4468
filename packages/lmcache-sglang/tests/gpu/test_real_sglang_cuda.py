# SPDX-License-Identifier: Apache-2.0
"""Real SGLang on a CUDA GPU with lmcache: store -> ``flush_cache()`` -> hit, greedy output identical.

Every SGLang hook of lmcache that runs on the installed SGLang is checked with a tiny random Llama
built at test time (written for SGLang 0.5.17, the newest release whose torch pin matches the
H200 image; see ``tools/gpu_engines/``):

- ``--enable-lmcache`` (0.5.17-0.5.19: ``LMCRadixCache`` in its CUDA mode, which calls our
  ``LMCacheMPConnector`` in process): ``lookup_kv`` at match, ``retrieve_kv`` at admission,
  ``store_kv`` at request end. SGLang reports the restored tokens as ``host`` in
  ``cached_tokens_details``.
- HiCache with our storage backend (``--enable-hierarchical-cache --hicache-storage-backend
  dynamic``): SGLang backs its host pages up into lmcache, and after ``flush_cache()`` (which
  empties SGLang's device and host caches) prefetches them back; reported as ``storage``. Three
  host layouts / I/O paths: ``page_first`` with SGLang's kernel I/O and the zero-copy interface,
  ``page_first_direct`` with direct I/O and the zero-copy interface, ``layer_first`` with the
  kernel I/O and the flat-page interface.

Each lmcache engine then checks that a corrupted page or chunk is never used: after the hits,
one byte of one entry of lmcache's CPU tier is flipped in SGLang's scheduler process, and the
same prompt must restore exactly the chunks or pages before the damaged one (``--enable-lmcache``
on CUDA: the entry carries the sum the GPU computed at store and fails on the GPU at load;
HiCache: the entry carries a host checksum, checked when the page is leased). Its greedy output
must equal the engine without lmcache computing the prompt from the same point: a random tiny
model's logits are near ties, and a prefill split at another token may round differently in
bf16, so the reference holds the same prefix in SGLang's own cache (a request for it first). One more engine
runs ``--enable-lmcache`` with default settings (no lmcache keys in its config file) and must
hit every full chunk (512 tokens), its CPU-tier chunks all carrying device sums (verification on
by default), with the output of SGLang computing the prompt from that split.

Each engine runs in its own process (this file run as a script), one at a time: SGLang's
``Engine.shutdown()`` kills every child process of its caller. SGLang's scheduler is spawned, so
it imports this file as ``__mp_main__``: there a thread (``sglang_tier_requests.py``, beside this
file) answers the worker's requests to read or damage lmcache's process tier
(``lmcache.tiers.process_tier``). Outputs are compared token for
token with the same prompts on an engine without lmcache. Each run appends one JSON line per
engine to ``$LMC_GPU_LOG_DIR/summary.jsonl`` and keeps the engine's log beside it
(default: pytest's temporary folder). ``LMC_GPU_BUDGET_S`` (default 900) bounds the
time spent on engines: scenarios started past it are skipped with a reason;
``LMC_GPU_ENGINE_TIMEOUT_S`` (default 240) bounds one engine's run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

PAGE = 16
CHUNK = 64  # lmcache chunk size of the --enable-lmcache engine
MAX_TOKENS = 8
ENGINE_TIMEOUT_S = float(os.environ.get("LMC_GPU_ENGINE_TIMEOUT_S", "240"))
BUDGET_S = float(os.environ.get("LMC_GPU_BUDGET_S", "900"))
BACKEND = {
    "backend_name": "lmcache",
    "module_path": "lmcache_sglang.hicache_backend",
    "class_name": "LMCacheHiCacheStorage",
    "max_local_cpu_size": 0.25,
}
# (mem layout, io backend, zero-copy interface_v1)
HICACHE_VARIANTS = {
    "page_first-kernel-v1": ("page_first", "kernel", 1),
    "page_first_direct-direct-v1": ("page_first_direct", "direct", 1),
    "layer_first-kernel-flat": ("layer_first", "kernel", 0),
}
FLIP_ENTRY = 4  # the CPU-tier entry damaged: chunk 4 of 9 (64 tokens), page 4 of 37 (HiCache)
# tokens restored once entry FLIP_ENTRY is damaged: the chunks or pages before it
SPLITS = {"enable_lmcache": FLIP_ENTRY * CHUNK, "hicache": FLIP_ENTRY * PAGE}
DEFAULT_CHUNK = 256  # lmcache's default chunk size (the engine with no lmcache keys)
DEFAULT_HIT = 600 // DEFAULT_CHUNK * DEFAULT_CHUNK  # its hit of ``a``: every full chunk
# where the reference engine splits ``a``: each damaged run's split, and the default engine's hit
REFERENCE_SPLITS = (*SPLITS.values(), DEFAULT_HIT)


def _skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs torch"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (see tools/gpu_engines/run_sglang_gpu_tests.sh)"
    try:
        import sglang  # noqa: F401
    except Exception as exc:  # a broken install is a skip here: CUDA SGLang is optional
        return f"needs SGLang for CUDA importable ({type(exc).__name__}: {exc})"
    return None


pytestmark = [pytest.mark.gpu]
if __name__ not in ("__main__", "__mp_main__"):  # not in the engine worker or its children
    _REASON = _skip_reason()
    if _REASON is not None:
        pytest.skip(_REASON, allow_module_level=True)


def _prompt(n: int, seed: int) -> list[int]:
    from lmcache_sglang.testing import make_prompt

    return make_prompt(n, seed)


def prompts() -> dict[str, list[int]]:
    a = _prompt(600, 11)  # 37 full pages + 8 tokens; 9 lmcache chunks + 24 tokens
    heads = {f"a[:{n}]": a[:n] for n in REFERENCE_SPLITS}
    return {"a": a, "a_ext": a + _prompt(100, 12), **heads}


# -- the engine worker (this file run as a script) -----------------------------------------


def engine_kwargs(model_dir: str, hook: str, variant: str | None, work: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model_path": model_dir,
        "attention_backend": "triton",
        "sampling_backend": "pytorch",
        "disable_cuda_graph": True,
        "mem_fraction_static": 0.2,
        "max_total_tokens": 8192,
        "page_size": PAGE,
        "dtype": "bfloat16",
        "random_seed": 0,
        "log_level": "info",
    }
    if hook in ("enable_lmcache", "enable_lmcache_defaults"):
        import yaml

        path = Path(work) / f"{hook}.yaml"
        # LMCache's daemon keys (SGLang 0.5.17 needs them in MP mode; we ignore them) and ours
        keys: dict[str, Any] = {"mp_host": "127.0.0.1", "mp_port": 5556}
        if hook == "enable_lmcache":
            keys.update(chunk_size=CHUNK, max_local_cpu_size=0.25)
        path.write_text(yaml.safe_dump(keys))
        kwargs.update(enable_lmcache=True, lmcache_config_file=str(path))
    elif hook == "hicache":
        assert variant is not None
        layout, io, v1 = HICACHE_VARIANTS[variant]
        kwargs.update(
            enable_hierarchical_cache=True,
            hicache_mem_layout=layout,
            hicache_io_backend=io,
            hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps({**BACKEND, "interface_v1": v1}),
            hicache_storage_prefetch_policy="wait_complete",
        )
    # e.g. '{"hicache_ratio": 4}' to try a setting without editing the test
    kwargs.update(json.loads(os.environ.get("LMC_GPU_ENGINE_OVERRIDES") or "{}"))
    return kwargs


# name, then steps: ("gen", prompt) | ("flush",) | ("sleep", seconds) | ("flip", entry) |
# ("probe",); flip and probe are answered in SGLang's scheduler (sglang_tier_requests.py)
STEPS: dict[str, list[tuple[Any, ...]]] = {
    # control: SGLang's own radix hits (no flush) must not change greedy output either
    "plain": [
        ("gen", "a"),
        ("gen", "a"),
        ("flush",),
        ("gen", "a_ext"),
        ("flush",),
        # the prompt computed from each damaged run's split: its head first, then the prompt
        *[
            step
            for n in REFERENCE_SPLITS
            for step in (("gen", f"a[:{n}]"), ("gen", "a"), ("flush",))
        ],
    ],
    "enable_lmcache": [
        ("gen", "a"),
        ("flush",),
        ("gen", "a"),
        ("flush",),
        ("gen", "a_ext"),
        ("flush",),
        ("flip", FLIP_ENTRY),
        ("gen", "a"),
    ],
    # HiCache backs host pages up on its own thread after the request: give it a moment
    "hicache": [
        ("gen", "a"),
        ("sleep", 2.0),
        ("flush",),
        ("gen", "a"),
        ("sleep", 2.0),
        ("flush",),
        ("gen", "a_ext"),
        ("sleep", 2.0),
        ("flush",),
        ("flip", FLIP_ENTRY),
        ("gen", "a"),
    ],
    # no lmcache keys at all: default chunk size (256), budget and checksum setting
    "enable_lmcache_defaults": [
        ("gen", "a"),
        ("flush",),
        ("gen", "a"),
        ("probe",),
    ],
}


def _flush(engine: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        res = engine.flush_cache()
        if getattr(res, "success", res):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("flush_cache() kept failing: SGLang never went idle")
        time.sleep(0.2)


def run_worker(spec_path: str) -> int:
    """Start one engine, run the scenario's steps, write the result JSON after each step."""
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    result: dict[str, Any] = {"scenario": spec["scenario"], "runs": [], "error": None}

    def dump() -> None:
        out.write_text(json.dumps(result))

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t0 = time.monotonic()
    engine = None
    try:
        import sglang_tier_requests as tier_requests  # beside this file (the script's folder)

        requests = Path(spec["work"]) / f"{spec['scenario']}.tier-requests"
        requests.mkdir(parents=True, exist_ok=True)
        os.environ[tier_requests.ENV] = str(requests)  # inherited by SGLang's spawned scheduler
        import sglang as sgl

        result["sglang"] = getattr(sgl, "__version__", "?")
        dump()  # SGLang kills this process (SIGKILL) when its scheduler fails to start
        kwargs = engine_kwargs(spec["model_dir"], spec["hook"], spec.get("variant"), spec["work"])
        engine = sgl.Engine(**kwargs)
        result["start_s"] = round(time.monotonic() - t0, 1)
        dump()
        texts = prompts()
        for step in STEPS[spec["hook"] if spec["hook"] != "none" else "plain"]:
            if step[0] == "gen":
                t = time.monotonic()
                res = engine.generate(
                    input_ids=texts[step[1]],
                    sampling_params={"temperature": 0.0, "max_new_tokens": MAX_TOKENS},
                )
                meta = res["meta_info"]
                result["runs"].append(
                    {
                        "prompt": step[1],
                        "output_ids": res["output_ids"],
                        "cached_tokens": int(meta.get("cached_tokens", 0) or 0),
                        "details": meta.get("cached_tokens_details") or {},
                        "seconds": round(time.monotonic() - t, 3),
                    }
                )
            elif step[0] == "flush":
                _flush(engine)
                result["runs"].append({"flush": True})
            elif step[0] == "sleep":
                time.sleep(float(step[1]))
            elif step[0] in ("flip", "probe"):
                flip = int(step[1]) if step[0] == "flip" else None
                report = tier_requests.ask(requests, len(result["runs"]), flip)
                result["runs"].append({step[0]: report})
            dump()
    except BaseException as exc:
        import traceback

        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-4000:]}"
        dump()
        return 1
    finally:
        if engine is not None:
            t = time.monotonic()
            try:
                engine.shutdown()
            except Exception as exc:
                result["shutdown_error"] = repr(exc)
            result["shutdown_s"] = round(time.monotonic() - t, 1)
        result["total_s"] = round(time.monotonic() - t0, 1)
        dump()
    return 0


# -- the tests -----------------------------------------------------------------------------

_STARTED = time.monotonic()
_RESULTS: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("LMC_GPU_LOG_DIR")
    path = Path(folder) if folder else tmp_path_factory.mktemp("sglang-gpu-logs")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmcache_sglang.testing import build_tiny_llama

    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"lmcache-sglang-gpu-{os.getuid()}"
    return build_tiny_llama(folder / "tiny-llama", max_position_embeddings=2048)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def run_scenario(
    name: str, hook: str, variant: str | None, model_dir: Path, log_dir: Path, work: Path
) -> dict[str, Any]:
    """Run one engine in a worker process (its own process group, killed on timeout)."""
    if name in _RESULTS:
        if _RESULTS[name].get("error"):
            pytest.fail(f"{name}: failed before (see its first test)")
        return _RESULTS[name]
    spent = time.monotonic() - _STARTED
    if spent > BUDGET_S:
        pytest.skip(f"engine time budget spent ({spent:.0f} s > LMC_GPU_BUDGET_S)")
    out = work / f"{name}.json"
    spec = work / f"{name}.spec.json"
    spec.write_text(
        json.dumps(
            {
                "scenario": name,
                "hook": hook,
                "variant": variant,
                "model_dir": str(model_dir),
                "work": str(work),
                "out": str(out),
            }
        )
    )
    log = log_dir / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(work),  # spawned SGLang processes put this folder first on sys.path
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            # the worker's process group: the engine's scheduler and detokenizer too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {"scenario": name, "runs": [], "error": "the worker wrote no result"}
    result["rc"] = rc
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if rc is None:
        result["error"] = (result.get("error") or "") + f" [timed out after {ENGINE_TIMEOUT_S} s]"
    elif rc != 0 and not result.get("error"):
        result["error"] = f"the worker exited with {rc} (see the engine log)"
    summary = {k: v for k, v in result.items() if k != "runs"}
    summary["runs"] = [{k: v for k, v in r.items() if k != "output_ids"} for r in result["runs"]]
    with open(log_dir / "summary.jsonl", "a") as f:
        f.write(json.dumps(summary) + "\n")
    _RESULTS[name] = result
    if result.get("error"):
        pytest.fail(f"{name}: {result['error']}\n--- engine log tail ---\n{_tail(log)}")
    return result


def gens(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result["runs"] if "output_ids" in r]


def tier_reports(result: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    """What the scheduler answered to the scenario's ``flip`` / ``probe`` steps."""
    return [r[kind] for r in result["runs"] if kind in r]


def from_lmcache(run: dict[str, Any]) -> int:
    """Tokens restored from outside SGLang's device cache (``host``: ``--enable-lmcache``'s
    ``LMCRadixCache``; ``storage``: HiCache's L3, i.e. lmcache)."""
    d = run["details"]
    return int(d.get("host", 0) or 0) + int(d.get("storage", 0) or 0)


def min_hit(unit: int, prompt: list[int]) -> int:
    """Every lmcache unit of the prompt but the last (the last token is never matched)."""
    return len(prompt) // unit * unit - unit


@pytest.fixture(scope="session")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang-gpu-work")


@pytest.fixture(scope="session")
def plain(model_dir: Path, log_dir: Path, work: Path) -> dict[str, Any]:
    """The engine without lmcache: its greedy outputs are the reference."""
    return run_scenario("plain", "none", None, model_dir, log_dir, work)


@pytest.fixture(scope="session")
def reference(plain: dict[str, Any]) -> dict[str, list[int]]:
    """Greedy outputs without lmcache: ``a``, ``a_ext`` computed whole, and ``a@N``: ``a`` with
    its first N tokens in SGLang's own cache."""
    a_cold, _a_radix, ext, *split_runs = gens(plain)
    out = {"a": a_cold["output_ids"], "a_ext": ext["output_ids"]}
    for head, run in zip(split_runs[::2], split_runs[1::2], strict=True):
        out[f"a@{len(prompts()[head['prompt']])}"] = run["output_ids"]
        out[f"a@{len(prompts()[head['prompt']])}.cached"] = [run["cached_tokens"]]
    return out


def test_adapter_imports_on_this_sglang() -> None:
    """The paths SGLang imports: ``LMCRadixCache``'s module (our shims) and our HiCache backend
    through SGLang's dynamic backend loader."""
    import sglang
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.storage.lmcache import lmc_radix_cache

    cls = StorageBackendFactory._load_backend_class(
        BACKEND["module_path"], BACKEND["class_name"], BACKEND["backend_name"]
    )
    assert cls.__name__ == "LMCacheHiCacheStorage"
    assert lmc_radix_cache.LMCacheMPConnector.__module__ == "lmcache_sglang.legacy_adapter"
    print("sglang", sglang.__version__)


def test_plain_engine(plain: dict[str, Any], reference: dict[str, list[int]]) -> None:
    """Control: SGLang's own radix hit (no flush) gives the cold run's greedy output, so the
    comparisons below would not fail from SGLang's prefix path alone; each split reference holds
    exactly its head in SGLang's cache."""
    a_cold, a_radix, *_ = gens(plain)
    assert len(a_cold["output_ids"]) == MAX_TOKENS
    assert a_radix["cached_tokens"] > 0, a_radix
    assert a_radix["output_ids"] == a_cold["output_ids"]
    for n in REFERENCE_SPLITS:
        assert reference[f"a@{n}.cached"] == [n], (n, reference[f"a@{n}.cached"])


def test_enable_lmcache_store_flush_hit(
    reference: dict[str, list[int]], model_dir: Path, log_dir: Path, work: Path
) -> None:
    """``--enable-lmcache``: cold run stores; after ``flush_cache()`` the same prompt (and a
    longer one starting with it) loads its chunks from lmcache, with identical greedy output."""
    res = run_scenario("enable_lmcache", "enable_lmcache", None, model_dir, log_dir, work)
    cold, hit, ext, _flipped = gens(res)
    p = prompts()
    assert from_lmcache(cold) == 0, cold
    assert cold["output_ids"] == reference["a"]
    assert from_lmcache(hit) >= min_hit(CHUNK, p["a"]) > 0, hit
    assert hit["output_ids"] == reference["a"]
    assert from_lmcache(ext) >= min_hit(CHUNK, p["a"]), ext
    assert ext["output_ids"] == reference["a_ext"]


@pytest.mark.parametrize("variant", list(HICACHE_VARIANTS))
def test_hicache_backend_store_flush_hit(
    variant: str, reference: dict[str, list[int]], model_dir: Path, log_dir: Path, work: Path
) -> None:
    """HiCache with lmcache as its storage backend: pages backed up from SGLang's host pool;
    after ``flush_cache()`` (device and host caches emptied) they are prefetched from lmcache,
    with identical greedy output."""
    res = run_scenario(f"hicache-{variant}", "hicache", variant, model_dir, log_dir, work)
    cold, hit, ext, _flipped = gens(res)
    p = prompts()
    assert from_lmcache(cold) == 0, cold
    assert cold["output_ids"] == reference["a"]
    assert int(hit["details"].get("storage", 0)) >= min_hit(PAGE, p["a"]) > 0, hit
    assert hit["output_ids"] == reference["a"]
    assert int(ext["details"].get("storage", 0)) >= min_hit(PAGE, p["a"]), ext
    assert ext["output_ids"] == reference["a_ext"]


def test_enable_lmcache_flipped_byte_is_recomputed(
    reference: dict[str, list[int]], model_dir: Path, log_dir: Path, work: Path
) -> None:
    """``--enable-lmcache`` on CUDA, default checksum setting: the damaged chunk carries the sum
    the GPU computed at store, fails on the GPU at load and is never written; SGLang computes
    from it on, so fewer tokens come from lmcache and the output is unchanged."""
    res = run_scenario("enable_lmcache", "enable_lmcache", None, model_dir, log_dir, work)
    _cold, hit, _ext, after = gens(res)
    (flip,) = tier_reports(res, "flip")
    assert flip["entries"] > FLIP_ENTRY and flip["flipped"] == FLIP_ENTRY, flip
    assert flip["device_sum"] and not flip["host_sum"], flip  # verified on the GPU
    assert flip["device_sums"] == flip["entries"] and flip["host_sums"] == 0, flip
    # SGLang's ``host`` detail is the lookup's count; ``cached_tokens`` what retrieve_kv loaded
    split = SPLITS["enable_lmcache"]
    assert after["cached_tokens"] == split < hit["cached_tokens"], (after, hit)
    assert after["output_ids"] == reference[f"a@{split}"]


@pytest.mark.parametrize("variant", list(HICACHE_VARIANTS))
def test_hicache_flipped_byte_is_recomputed(
    variant: str, reference: dict[str, list[int]], model_dir: Path, log_dir: Path, work: Path
) -> None:
    """HiCache (host pool, CPU): the damaged page carries a host checksum, fails when it is
    leased and is never copied into the host pool; fewer tokens come from storage and the
    output is unchanged."""
    res = run_scenario(f"hicache-{variant}", "hicache", variant, model_dir, log_dir, work)
    _cold, hit, _ext, after = gens(res)
    (flip,) = tier_reports(res, "flip")
    assert flip["entries"] > FLIP_ENTRY and flip["host_sum"] and not flip["device_sum"], flip
    split = SPLITS["hicache"]
    assert int(after["details"].get("storage", 0)) == split, (after, hit)
    assert after["cached_tokens"] == split < hit["cached_tokens"], (after, hit)
    assert after["output_ids"] == reference[f"a@{split}"]


def test_enable_lmcache_default_settings_hit_verified(
    reference: dict[str, list[int]], model_dir: Path, log_dir: Path, work: Path
) -> None:
    """``--enable-lmcache`` with no lmcache keys (chunk size 256, default budget): the prompt's
    full chunks come back with identical output, and every chunk in the CPU tier carries the
    sum the GPU computed at store (verification is on by default on CUDA)."""
    res = run_scenario(
        "enable_lmcache_defaults", "enable_lmcache_defaults", None, model_dir, log_dir, work
    )
    cold, hit = gens(res)
    (probe,) = tier_reports(res, "probe")
    assert from_lmcache(cold) == 0, cold
    assert cold["output_ids"] == reference["a"]
    # restored: every full chunk (``cached_tokens``: what retrieve_kv loaded); the output is
    # SGLang's own from that split (a split at 512 rounds differently from a whole prefill)
    assert hit["cached_tokens"] == DEFAULT_HIT == from_lmcache(hit), hit
    assert hit["output_ids"] == reference[f"a@{DEFAULT_HIT}"]
    assert probe["entries"] >= 2 and probe["device_sums"] == probe["entries"], probe
    assert probe["host_sums"] == 0, probe


if __name__ == "__mp_main__":  # a process SGLang spawned from the engine worker
    import sglang_tier_requests

    sglang_tier_requests.start_watcher()

if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(run_worker(sys.argv[2]))
    sys.exit(f"usage: {sys.argv[0]} --worker SPEC_JSON (run the tests with pytest)")
