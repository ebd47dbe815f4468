# SPDX-License-Identifier: Apache-2.0
"""No module of ``packages/*/src`` passes :data:`MAX_LINES` lines.

A newcomer reads a module whole. Past a few hundred lines a module usually holds more than one
idea, and each idea is easier to find in a module of its own.
"""

from __future__ import annotations

from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[3]
MAX_LINES = 450

# Modules that other people are splitting right now (paths under packages/). The test fails when
# one of them fits again, so this list can only shrink: remove it then.
KNOWN_LONG: frozenset[str] = frozenset()


def line_counts() -> dict[str, int]:
    """Lines of every module of ``packages/*/src``, by path under ``packages/``."""
    return {
        path.relative_to(PACKAGES).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(PACKAGES.glob("*/src/**/*.py"))
    }


def test_modules_are_short() -> None:
    counts = line_counts()
    long = {p: n for p, n in counts.items() if n > MAX_LINES and p not in KNOWN_LONG}
    assert not long, (
        f"Modules longer than {MAX_LINES} lines: {long}. Expected at most {MAX_LINES}. Fix: split "
        "by responsibility (one idea per module), keeping the old import path as a re-export."
    )
    fits = sorted(p for p in KNOWN_LONG if counts.get(p, 0) <= MAX_LINES)
    assert not fits, (
        f"{fits} now fit in {MAX_LINES} lines (or are gone), but KNOWN_LONG still lists them: "
        f"remove it from the list in {Path(__file__).name}."
    )


def test_line_counts_see_every_package() -> None:
    counts = line_counts()
    packages = {path.split("/", 1)[0] for path in counts}
    expected = {p.name for p in PACKAGES.iterdir() if (p / "src").is_dir()}
    assert packages == expected and len(expected) >= 4, (packages, expected)
    assert counts["lmcache-core/src/lmcache/errors.py"] > 0
