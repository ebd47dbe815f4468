# SPDX-License-Identifier: Apache-2.0
"""The CUDA benchmarks' ``--smoke`` runs on the CPU: the scripts behind the README's GPU table
keep running where CI can check them (a 2-layer geometry, the ``vllm.cpu`` connector).

``gpu_transfer.py`` reloads every request it stored bit for bit or exits non-zero.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(*argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=300, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return proc.stdout


@pytest.mark.timeout(330)
def test_gpu_transfer_smoke_prints_every_row_and_reloads_bit_exact() -> None:
    out = _run(str(BENCH / "gpu_transfer.py"), "--smoke")
    for row in ("store", "load", "storing one", "checksum on", "lookup", "first warm", "GEMM"):
        assert row in out, f"no {row!r} row in:\n{out[-3000:]}"
    assert "bit-exact reload: 1k-token yes, 256-token yes" in out, out[-3000:]


@pytest.mark.timeout(330)
def test_gpu_transfer_profile_smoke_profiles_both_directions() -> None:
    out = _run(str(BENCH / "gpu_transfer_profile.py"), "--smoke", "--reps", "5", "--top", "5")
    for what in ("=== store: host", "=== load: host"):
        assert what in out, out[-3000:]
    assert "cache_engine.py" in out, "the profile names no lmcache frame:\n" + out[-3000:]


def test_sglang_gpu_help_and_table_without_sglang(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sglang_gpu.py`` parses its arguments without SGLang, and its table and trace report
    print every row from an engine result (the engines themselves need SGLang: ``--device cpu``
    runs them on its CPU engine, a few minutes)."""
    assert "--engines" in _run(str(BENCH / "sglang_gpu.py"), "--help")
    sys.path.insert(0, str(BENCH))
    try:
        import json

        from sglang_gpu_table import print_table, print_trace
    finally:
        sys.path.remove(str(BENCH))
    t = 1000.0
    samples = {"cold": [2.0, 2.2], "floor": [0.3, 0.3], "l2": [0.35], "backup": [0.05]}
    samples |= {"flush": [0.4], "warm": [0.36, 0.38], "tput": [1200.0]}
    lmc = {"samples": samples, "start_s": 20, "phases": [["warm", 1, t, t + 0.4]]}
    lmc["hits"] = {"warm": [{"device": 0, "host": 0, "storage": 2032, "cached": 2032}]}
    base = {"samples": {"cold": [2.0], "floor": [0.3], "warm": [2.1], "tput": [1000.0]}}
    results = {"base": base, "lmc-pf": lmc}
    info = {"title": "t", "kv_bytes": 32 << 20, "copy_s": 0.004, "bw_what": "host memcpy"}
    print_table(results, info)
    trace = tmp_path / "lmc-pf" / "trace"
    trace.mkdir(parents=True)
    event = {"n": "lmc.batch_get_v1", "t0": t + 0.01, "t1": t + 0.05, "pages": 127, "sub": {}}
    (trace / "trace-1.jsonl").write_text(json.dumps(event) + "\n")
    print_trace(results, tmp_path, detail=False)
    out = capsys.readouterr().out
    for row in ("cold TTFT", "host-tier hit", "backup into storage", "after flush_cache()"):
        assert row in out, out
    assert "s2032" in out and "127 pages/call" in out and "in hooks     40.0 ms" in out, out
