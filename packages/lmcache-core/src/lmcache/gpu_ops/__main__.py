# SPDX-License-Identifier: Apache-2.0
"""``python -m lmcache.gpu_ops``: which implementation of lmcache's device ops serves this machine.

Prints torch and its CUDA, the GPUs, what the installed wheel compiled in (architectures, CUDA,
torch ABI), which kernels load here (the wheel's, a JIT build, or none and why), and the
implementation each GPU gets. Exits 0 whatever it finds; ``--require`` exits 1 when the
compiled kernels do not load.
"""

from __future__ import annotations

import argparse
import sys

import torch

import lmcache
from lmcache import gpu_ops
from lmcache.gpu_ops import _cext


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lmcache.gpu_ops", description=__doc__)
    parser.add_argument(
        "--require", action="store_true", help="exit 1 unless the compiled kernels load"
    )
    args = parser.parse_args(argv)
    print(
        f"lmcache-core {lmcache.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda})"
    )
    info = _cext.wheel_build_info()
    if info is None:
        print(f"wheel kernels: none ({_cext.WHEEL_LIBRARY} absent)")
    else:
        print(
            f"wheel kernels: {_cext.WHEEL_LIBRARY}: {', '.join(info.get('archs', []))}; CUDA "
            f"{info.get('cuda')}; torch stable ABI {info.get('torch_abi')}+; glibc {info.get('glibc')}+"
        )
    try:
        status = _cext.load()
    except _cext.CextUnavailableError as exc:  # LMCACHE_REQUIRE_CEXT=1
        print(f"kernels not loaded: {exc}")
        return 1
    state = "loaded" if status.loaded else "not loaded"
    print(f"kernels {state} ({status.mode}): {status.detail}")
    if status.archs:
        print(f"  compiled for: {', '.join(status.archs)}")
    from lmcache.devices import get_backend

    backend = get_backend("cuda")
    count = backend.device_count() if backend.is_available() else 0
    if count == 0:
        print("GPUs: none visible (CPU tensors use the torch implementation)")
    else:
        archs = ", ".join(f"sm_{a}{b}" for a, b in sorted(_cext._capabilities()))
        print(f"GPUs: {count} visible ({archs})")
    for index in range(count):
        print(f"cuda:{index}: {gpu_ops.implementation(torch.device('cuda', index))}")
    return 0 if status.loaded or not args.require else 1


if __name__ == "__main__":
    sys.exit(main())
