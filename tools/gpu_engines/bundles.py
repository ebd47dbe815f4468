# SPDX-License-Identifier: Apache-2.0
"""Engine bundles for ``nox -s gpu`` on an offline CUDA machine.

``build_bundle.sh`` writes each bundle as a folder of ``*.tar.xz`` site-packages trees. They are
looked for in ``.eng`` and ``.eng-sgl``, or in the folders ``LMC_GPU_BUNDLES`` lists
(``os.pathsep``-separated). Each is unpacked once into its own site folder, which goes first on
``PYTHONPATH`` for that engine's tests.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tarfile
from collections.abc import Callable

GPU_BUNDLE_DIRS = (".eng", ".eng-sgl")
GPU_SITE = "/tmp/lmcache-{engine}-site"  # benchmarks/vllm_gpu.py reads vLLM from the same place


def gpu_bundles(root: pathlib.Path = pathlib.Path(".")) -> dict[str, pathlib.Path]:
    """``{"vllm": folder, "sglang": folder}`` for every engine bundle present.

    A bundle is a folder holding ``vllm-*.tar.xz`` (or ``vllm-nofa-*``) or ``sglang-*.tar.xz``
    beside its ``deps.tar.xz``, as ``build_bundle.sh`` writes it.
    """
    listed = os.environ.get("LMC_GPU_BUNDLES")
    folders = listed.split(os.pathsep) if listed else GPU_BUNDLE_DIRS
    found: dict[str, pathlib.Path] = {}
    for folder in filter(None, folders):
        path = root / folder
        for engine in ("vllm", "sglang"):
            if engine not in found and any(path.glob(f"{engine}-*.tar.xz")):
                found[engine] = path
    return found


def unpack_bundle(engine: str, bundle: pathlib.Path, log: Callable[[str], object] = print) -> str:
    """Unpack ``bundle``'s ``*.tar.xz`` into the engine's site folder, once per bundle."""
    site = pathlib.Path(GPU_SITE.format(engine=engine))
    tars = sorted(bundle.glob("*.tar.xz"))
    stamp = "\n".join(f"{t.name} {t.stat().st_size} {t.stat().st_mtime_ns}" for t in tars)
    marker = site / ".lmcache-bundle"
    if marker.is_file() and marker.read_text() == stamp:
        log(f"{engine}: bundle {bundle} already unpacked in {site}")
        return str(site)
    log(f"{engine}: unpacking {bundle} into {site}")
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    for tar in tars:
        with tarfile.open(tar) as archive:
            archive.extractall(site, filter="tar")
    marker.write_text(stamp)
    return str(site)
