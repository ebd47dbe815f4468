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
