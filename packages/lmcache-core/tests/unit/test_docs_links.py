# SPDX-License-Identifier: Apache-2.0
"""Every relative link in the README, ``docs/`` and the package READMEs leads somewhere.

A link to a file must name one that exists; a ``#fragment`` into a Markdown file must name one of
its headings, spelled as GitHub spells heading anchors.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
DOCS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "packages").glob("*/README.md")]
)
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {github_anchor(m) for m in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def test_github_anchor_matches_githubs_spelling() -> None:
    assert github_anchor("What a chunk key covers") == "what-a-chunk-key-covers"
    assert github_anchor("Redis / Valkey") == "redis--valkey"
    assert github_anchor("The CUDA kernels and the C extension") == (
        "the-cuda-kernels-and-the-c-extension"
    )


def test_the_documents_exist() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/architecture.md", "docs/tiers.md", "docs/gpu.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc: Path) -> None:
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto: ...: not checked here (no network)
        path_part, _, fragment = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        if not dest.exists():
            broken.append(f"{target} (no file {dest})")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.name})")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links, fix or remove them: {broken}"
