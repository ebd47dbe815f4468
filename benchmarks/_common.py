# SPDX-License-Identifier: Apache-2.0
"""What the benchmarks share: timing, and starting and timing real vLLM engines.

Timing: host wall time and CUDA-event device time.
Every figure is a median after warm-up. ``wall_ms`` is what a caller of a blocking call waits
(the device synchronized before and after each call); ``event_ms`` is device time between two
CUDA events around ``inner`` back-to-back launches, divided by ``inner``, so that a copy shorter
than a launch's host overhead is still timed by the device and not by the host. Without CUDA
both fall back to ``time.perf_counter`` (the benchmarks' CPU smoke modes).

vLLM: the random models (built locally, never downloaded), quiet third-party logs, lmcache's
``kv_transfer_config``, one request's TTFT and cache counters (:func:`run_prompt`), the time
spent inside the connector (:class:`ConnectorTimer`), engines on the CPU (:func:`start_engine`)
and on a CUDA GPU (:func:`gpu_engine`). Nothing here imports vLLM until called.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported late: quiet_third_party must run first
    import torch


def sync(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def wall_ms(
    device: torch.device,
    fn: Callable[[], object],
    reps: int,
    warmup: int = 3,
    setup: Callable[[], object] | None = None,
) -> list[float]:
    """Host milliseconds of each of ``reps`` calls of ``fn`` after ``warmup`` untimed ones.

    ``setup`` runs before every call, outside the timed span (e.g. emptying a cache so that
    each store stores again).
    """
    times = []
    for i in range(warmup + reps):
        if setup is not None:
            setup()
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def event_ms(
    device: torch.device,
    fn: Callable[[], object],
    reps: int,
    warmup: int = 3,
    inner: int = 1,
) -> list[float]:
    """Device milliseconds per call of ``fn``: events around ``inner`` back-to-back calls."""
    if device.type != "cuda":
        return [t / inner for t in wall_ms(device, lambda: [fn() for _ in range(inner)], reps)]
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return times


def median(xs: list[float]) -> float:
    """The median, ``nan`` for no samples."""
    return statistics.median(xs) if xs else float("nan")


def gbs(nbytes: int, ms: float) -> float:
    """GB/s (10^9 bytes per second) of ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / ms / 1e6 if ms > 0 else float("nan")


# ---------------------------------------------------------------------- vLLM engines

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

#: The demo model: prefill of 4096 tokens takes ~1.2 s on 2 AMX cores (bf16), ~27 s on 2 AVX2 (fp32).
DEMO_MODEL: dict[str, int] = {
    "hidden_size": 1024,
    "num_layers": 8,
    "num_heads": 8,
    "num_kv_heads": 2,
    "head_dim": 128,
    "intermediate_size": 2816,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "seed": 0,
}
#: The ``--smoke`` model: the package's default tiny Llama, with room for long prompts.
SMOKE_MODEL: dict[str, int] = {
    "hidden_size": 256,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "seed": 0,
}
#: vLLM's own counters (Prometheus) read through ``LLM.get_metrics()``.
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
LOCAL_HITS = "vllm:prefix_cache_hits"


def log(msg: str) -> None:
    """Print a progress line at once (``nox`` and pipes buffer stdout otherwise)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def quiet_third_party(verbose: bool) -> None:
    """Silence everything but errors from vLLM, torch, transformers and lmcache (unless ``verbose``).

    Must run before torch, transformers or vLLM is imported: they read these variables at import
    time. The variables also reach vLLM's engine process in multiprocess mode.
    """
    if verbose:
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "INFO")
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        for name in ("lmcache", "lmcache_vllm"):
            logging.getLogger(name).addHandler(handler)
        return
    quiet = {
        "VLLM_LOGGING_LEVEL": "ERROR",  # vLLM's own handler
        "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10 warnings such as "NUMA binding: ..."
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
        "PYTHONWARNINGS": "ignore",  # for child processes; this one is filtered below
        "LMCACHE_LOG_LEVEL": "WARNING",  # applied when lmcache is imported
    }
    for key, value in quiet.items():
        os.environ.setdefault(key, value)
    import warnings

    warnings.simplefilter("ignore")
    _quiet_loggers()


def _quiet_loggers() -> None:
    """With ``VLLM_LOGGING_LEVEL=ERROR``, also drop the warnings vLLM logs while it is imported,
    before it installs its handler (e.g. "Triton is installed, but doesn't include CPU backend"),
    which Python's last-resort handler would print.

    Also runs at import of this module: vLLM's engine process (multiprocess mode) starts by
    importing the main script, before it imports vLLM.
    """
    if os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "ERROR":
        for name in ("vllm", "transformers", "torch"):
            logging.getLogger(name).setLevel(logging.ERROR)


_quiet_loggers()


def model_dir_for(params: dict[str, int], root: pathlib.Path) -> pathlib.Path:
    """A folder name that changes with the model parameters, so a change never reuses a stale model."""
    tag = "l{num_layers}-h{hidden_size}-d{head_dim}-kv{num_kv_heads}-s{seed}".format(**params)
    return root / f"llama-{tag}"


def describe_model(params: dict[str, int]) -> str:
    return (
        f"random Llama, {params['num_layers']} layers, hidden {params['hidden_size']}, "
        f"{params['num_heads']} query / {params['num_kv_heads']} KV heads of {params['head_dim']}, "
        "bf16 weights"
    )


def build_model(params: dict[str, int], root: pathlib.Path) -> pathlib.Path:
    """Build (or reuse) the random Llama for ``params`` under ``root``, logging progress."""
    from lmcache_vllm.testing import build_tiny_llama

    out = model_dir_for(params, root)
    log(f"model: {describe_model(params)} -> {out}")
    t0 = time.perf_counter()
    build_tiny_llama(out, **params)
    log(f"model ready in {time.perf_counter() - t0:.1f} s")
    return out


def lmcache_transfer_config(via: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM ``kv_transfer_config`` for lmcache.

    ``via="in-tree"`` uses vLLM's built-in name ``LMCacheConnectorV1`` (what LMCache users write; vLLM
    imports ``lmcache.integration.vllm.vllm_v1_adapter``); ``via="module"`` loads
    ``lmcache_vllm.connector`` through ``kv_connector_module_path``.
    """
    cfg: dict[str, Any] = {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.chunk_size": 256,
            "lmcache.local_cpu": True,
            "lmcache.max_local_cpu_size": 1.0,
            **(extra or {}),
        },
    }
    if via == "module":
        cfg["kv_connector_module_path"] = "lmcache_vllm.connector"
    elif via != "in-tree":
        raise ValueError(f"via must be 'in-tree' or 'module', got {via!r}")
    return cfg


def counter_total(llm: Any, name: str) -> int:
    """Sum of a vLLM Prometheus counter over all its label sets (0 when absent)."""
    total = 0
    for metric in llm.get_metrics():
        if metric.name == name and hasattr(metric, "value"):
            total += int(metric.value)
    return total


class ConnectorTimer:
    """Time spent inside the worker-side KV connector's load and save calls.

    Wraps the methods of the worker's connector instance (``start_load_kv`` and
    ``wait_for_layer_load`` count as load; ``save_kv_layer`` and ``wait_for_save`` as save). Only
    possible when the worker runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): otherwise
    :meth:`install` returns False and the figures stay ``None``.
    """

    _LOAD = ("start_load_kv", "wait_for_layer_load")
    _SAVE = ("save_kv_layer", "wait_for_save")

    def __init__(self) -> None:
        self.installed = False
        self.load_s = 0.0
        self.save_s = 0.0

    def install(self) -> bool:
        try:
            from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        except ImportError:
            return False
        if not has_kv_transfer_group():
            return False
        conn = get_kv_transfer_group()
        for name in self._LOAD + self._SAVE:
            setattr(
                conn,
                name,
                self._wrap(getattr(conn, name), "load_s" if name in self._LOAD else "save_s"),
            )
        self.installed = True
        return True

    def _wrap(self, fn: Any, bucket: str) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, bucket, getattr(self, bucket) + time.perf_counter() - t0)

        return timed

    def take(self) -> tuple[float | None, float | None]:
        """(load seconds, save seconds) since the last call; (None, None) when not installed."""
        if not self.installed:
            return None, None
        out = (self.load_s, self.save_s)
        self.load_s = self.save_s = 0.0
        return out


@dataclasses.dataclass
class RunResult:
    """One request: its TTFT, the tokens it generated and what the caches served."""

    ttft_s: float
    ttft_source: str
    wall_s: float
    token_ids: list[int]
    num_cached_tokens: int
    external_hits: int
    local_hits: int
    connector_load_s: float | None = None
    connector_save_s: float | None = None


def run_prompt(
    llm: Any, prompt: Sequence[int], max_tokens: int, timer: ConnectorTimer | None = None
) -> RunResult:
    """Run one greedy request; measure TTFT, the cache counters it moved and the connector time."""
    from vllm import SamplingParams

    if timer is not None:
        timer.take()
    ext0, loc0 = counter_total(llm, EXTERNAL_HITS), counter_total(llm, LOCAL_HITS)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": list(prompt)}], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    ext1, loc1 = counter_total(llm, EXTERNAL_HITS), counter_total(llm, LOCAL_HITS)
    metrics = getattr(out, "metrics", None)
    ttft = float(getattr(metrics, "first_token_latency", 0.0) or 0.0)
    source = "engine"
    if ttft <= 0.0:
        ttft, source = wall, "wall"
    load_s, save_s = timer.take() if timer is not None else (None, None)
    return RunResult(
        connector_load_s=load_s,
        connector_save_s=save_s,
        ttft_s=ttft,
        ttft_source=source,
        wall_s=wall,
        token_ids=list(out.outputs[0].token_ids),
        num_cached_tokens=int(out.num_cached_tokens or 0),
        external_hits=ext1 - ext0,
        local_hits=loc1 - loc0,
    )


def start_engine(
    model: pathlib.Path, max_model_len: int, kv_transfer_config: dict[str, Any] | None, **extra: Any
) -> Any:
    """Start a vLLM engine with the known-good CPU settings; the whole prompt prefills in one step."""
    from vllm import LLM

    from lmcache_vllm.testing import vllm_engine_kwargs

    kwargs = vllm_engine_kwargs(
        model,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_model_len,
        disable_log_stats=False,
        use_tqdm_on_load=False,  # no "Loading safetensors checkpoint shards" progress bar
        **extra,
    )
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    return LLM(**kwargs)


def gpu_engine(
    model: pathlib.Path, kv: dict[str, Any] | None, max_len: int, memory: float = 0.1
) -> Any:
    """vLLM on a CUDA GPU, eager, 16-token blocks, the whole prompt in one step, vLLM's own TTFT
    per request (``RequestOutput.metrics``); ``memory`` is ``gpu_memory_utilization`` (engines
    run in turn and one shut down may not free its memory at once: keep it low)."""
    import torch
    from vllm import LLM

    if not torch.cuda.is_available():  # the benchmarks' smoke runs on vLLM's CPU build
        return start_engine(model, max_len, kv)
    return LLM(
        model=str(model),
        enforce_eager=True,
        block_size=16,
        gpu_memory_utilization=memory,
        dtype="bfloat16",
        max_model_len=max_len,
        max_num_batched_tokens=max_len,
        seed=0,
        kv_transfer_config=kv,
        disable_log_stats=False,
    )


def shutdown_engine(llm: Any) -> None:
    """Shut ``llm`` down and free what it holds (:func:`lmcache_vllm.testing.shutdown_llm`)."""
    from lmcache_vllm.testing import shutdown_llm

    shutdown_llm(llm)
