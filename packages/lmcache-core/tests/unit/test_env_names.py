# SPDX-License-Identifier: Apache-2.0
"""Every ``LMCACHE_*`` variable the project reads is one the config loader accepts.

The loader refuses an unknown ``LMCACHE_*`` variable (a misspelt key must not pass silently).
So a tool or module that reads a variable of that prefix for itself must be listed in
``NON_CONFIG_ENV_VARS``: otherwise setting it stops every engine started in that environment.
The reference is the source: every read of an ``LMCACHE_*`` name through ``os.environ`` /
``os.getenv`` or a ``*_ENV = "LMCACHE_..."`` constant in Python, or ``${LMCACHE_...}`` / ``LMCACHE_...=`` in a shell script.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmcache.config import NON_CONFIG_ENV_VARS, ConfigError, load_config
from lmcache.config.loader import ENV_PREFIX, LMCacheConfig

ROOT = Path(__file__).resolve().parents[4]
PY_READ = re.compile(
    r"""(?:environ(?:\.get\(|\[)|getenv\(|[A-Z_]*ENV[A-Z_]*\s*=)\s*["'](LMCACHE_[A-Z0-9_]+)["']"""
)
SH_READ = re.compile(r"""\$\{?(LMCACHE_[A-Z0-9_]+)|\b(LMCACHE_[A-Z0-9_]+)=""")


def _read_names() -> dict[str, str]:
    found: dict[str, str] = {}
    sources = [
        *ROOT.glob("packages/*/src/**/*.py"),
        *ROOT.glob("benchmarks/*.py"),
        *ROOT.glob("tools/**/*.py"),
        *ROOT.glob("tools/**/*.sh"),
        ROOT / "noxfile.py",
        ROOT / ".ci" / "run",
    ]
    for path in sources:
        text = path.read_text(encoding="utf-8")
        pattern = PY_READ if path.suffix == ".py" else SH_READ
        for match in pattern.finditer(text):
            name = next(g for g in match.groups() if g)
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_lmcache_variable_read_is_accepted() -> None:
    keys = {ENV_PREFIX + f.upper() for f in LMCacheConfig.__dataclass_fields__}
    names = _read_names()
    assert {"LMCACHE_CONFIG_FILE", "LMCACHE_LOG_LEVEL"} <= set(names), f"the scan missed: {names}"
    stray = {n: where for n, where in names.items() if n not in keys | NON_CONFIG_ENV_VARS}
    assert not stray, (
        f"read as LMCACHE_* but refused by the config loader: {stray}; add each to "
        "NON_CONFIG_ENV_VARS or give it another prefix (tools use LMC_)"
    )


@pytest.mark.parametrize("name", sorted(NON_CONFIG_ENV_VARS - {"LMCACHE_CONFIG_FILE"}))
def test_a_non_config_variable_does_not_stop_the_loader(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, "")
    assert load_config().chunk_size == LMCacheConfig().chunk_size


def test_an_unknown_lmcache_variable_still_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMCACHE_GPU_BUNDLES", ".eng")
    with pytest.raises(ConfigError, match="LMCACHE_GPU_BUNDLES"):
        load_config()
