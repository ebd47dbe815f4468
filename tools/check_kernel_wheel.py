# SPDX-License-Identifier: Apache-2.0
"""Checks of lmcache-core's binary wheel that need no GPU (``nox -s install`` and ``sglang``).

    python tools/check_kernel_wheel.py archs WHEEL CUOBJDUMP
        The library holds machine code for every architecture its build_info.json lists, and
        PTX where listed (read with cuobjdump), and nothing that the file does not say.
    python tools/check_kernel_wheel.py load WHEEL
        Installs the wheel (--no-deps) into a temporary folder and, with this interpreter's torch,
        imports lmcache.gpu_ops from there, loads the library and checks that every op's schema
        and its CUDA kernel are registered; runs ``python -m lmcache.gpu_ops``.

Exits non-zero with the reason on any mismatch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

LIBRARY = "lmcache/lib/liblmcache_kernels.so"
INFO = "lmcache/lib/build_info.json"
BINDINGS = Path(__file__).resolve().parents[1] / "csrc" / "torch_bindings.cpp"


def _schemas() -> dict[str, str]:
    """``{op: schema}`` as ``csrc/torch_bindings.cpp`` defines them (what torch must report)."""
    found = re.findall(r'm\.def\("([^"]+)"\);', BINDINGS.read_text(encoding="utf-8"))
    return {d.split("(")[0]: f"lmcache::{d}" for d in found}


def _fail(message: str) -> None:
    print(f"check_kernel_wheel: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def archs(wheel: Path, cuobjdump: str) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        if LIBRARY not in names or INFO not in names:
            _fail(f"{wheel.name} holds no {LIBRARY} (built without LMCACHE_BUILD_KERNELS=1?)")
        info = json.loads(zf.read(INFO))
        with tempfile.TemporaryDirectory() as tmp:
            zf.extract(LIBRARY, tmp)
            listing = subprocess.run(
                [cuobjdump, "--list-elf", "--list-ptx", str(Path(tmp) / LIBRARY)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
    found = {f"sm_{m}" for m in re.findall(r"\.sm_(\d+a?)\.cubin", listing)}
    found |= {f"compute_{m}" for m in re.findall(r"\.sm_(\d+a?)\.ptx", listing)}
    listed = set(info["archs"])
    if found != listed:
        _fail(f"cuobjdump finds {sorted(found)} but build_info.json lists {sorted(listed)}")
    for needed in ("sm_80", "sm_89", "sm_90", "sm_100", "sm_120"):
        if needed not in found:
            _fail(f"no {needed} machine code in {wheel.name} (found {sorted(found)})")
    ptx = sorted(a for a in found if a.startswith("compute_"))
    newest = max(int(a[3:].rstrip("a")) for a in found if a.startswith("sm_"))
    if f"compute_{newest}" not in found:
        _fail(f"no PTX of the newest architecture sm_{newest} (PTX found: {ptx})")
    print(
        f"{wheel.name}: machine code for {', '.join(sorted(found - set(ptx)))}; PTX {', '.join(ptx)}"
    )


_LOAD = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import lmcache, lmcache.gpu_ops
from lmcache.gpu_ops import _cext
assert lmcache.__file__.startswith(sys.argv[1]), lmcache.__file__
torch.ops.load_library(str(_cext.WHEEL_LIBRARY))
schemas = {n: str(getattr(torch.ops.lmcache, n).default._schema) for n in json.loads(sys.argv[2])}
cuda = {n: torch._C._dispatch_has_kernel_for_dispatch_key(f"lmcache::{n}", "CUDA") for n in schemas}
print(json.dumps({"torch": torch.__version__, "schemas": schemas, "cuda": cuda}))
"""


def load(wheel: Path) -> None:
    schemas = _schemas()
    if set(schemas) != {"gather_kv", "scatter_kv", "checksum_chunks"}:
        _fail(f"{BINDINGS} defines {sorted(schemas)}, expected the three lmcache ops")
    with tempfile.TemporaryDirectory() as target:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--no-index",
                "--target",
                target,
                str(wheel),
            ],
            check=True,
        )
        out = subprocess.run(
            [sys.executable, "-c", _LOAD, target, json.dumps(list(schemas))],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            _fail(f"loading the wheel's library failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        for name, schema in schemas.items():
            if result["schemas"][name] != schema:
                _fail(f"{name}: schema {result['schemas'][name]!r}, expected {schema!r}")
            if not result["cuda"][name]:
                _fail(f"{name}: no CUDA kernel registered")
        env = {**os.environ, "PYTHONPATH": target}
        report = subprocess.run(
            [sys.executable, "-m", "lmcache.gpu_ops"], env=env, capture_output=True, text=True
        )
        if report.returncode != 0:
            _fail(f"python -m lmcache.gpu_ops failed:\n{report.stderr[-3000:]}")
    print(f"{wheel.name} loads with torch {result['torch']}: {', '.join(schemas)} registered")
    print(report.stdout.strip())


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in ("archs", "load"):
        _fail(__doc__ or "usage")
    wheel = Path(sys.argv[2])
    if sys.argv[1] == "archs":
        archs(wheel, sys.argv[3])
    else:
        load(wheel)


if __name__ == "__main__":
    main()
