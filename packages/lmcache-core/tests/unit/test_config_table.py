# SPDX-License-Identifier: Apache-2.0
"""The README's config table is the one generated from ``LMCacheConfig``, and it is right."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmcache.config import LMCacheConfig, load_config
from lmcache.config.table import (
    BEGIN_MARKER,
    END_MARKER,
    REGENERATE_COMMAND,
    ConfigRow,
    config_rows,
    main,
    markdown_table,
    replace_table,
)

README = Path(__file__).resolve().parents[4] / "README.md"


def _readme_table() -> str:
    text = README.read_text(encoding="utf-8")
    assert text.count(BEGIN_MARKER) == 1 and text.count(END_MARKER) == 1, (
        f"README.md must hold the config table between {BEGIN_MARKER!r} and {END_MARKER!r}"
    )
    return text.split(BEGIN_MARKER, 1)[1].split(END_MARKER, 1)[0].strip("\n")


def test_readme_table_is_generated_from_the_config() -> None:
    assert _readme_table() == markdown_table(), (
        "README.md's config table differs from lmcache.config.LMCacheConfig; from the repository "
        f"root run: {REGENERATE_COMMAND}"
    )


def test_one_row_per_field_in_declaration_order() -> None:
    assert [row.key for row in config_rows()] == [f.name for f in dataclasses.fields(LMCacheConfig)]


def test_a_row_as_written_by_hand() -> None:
    assert markdown_table().splitlines()[2] == (
        "| `chunk_size` | `LMCACHE_CHUNK_SIZE` | int | `256` | "
        "Tokens per chunk: the unit of hashing, storage and transfer. Must be > 0. |"
    )


@pytest.mark.parametrize("row", config_rows(), ids=lambda row: row.key)
def test_default_cell_is_the_fields_default(row: ConfigRow) -> None:
    # The cell is YAML: reading it back gives the dataclass default.
    assert yaml.safe_load(row.default) == getattr(LMCacheConfig(), row.key)


@pytest.mark.parametrize("row", config_rows(), ids=lambda row: row.key)
def test_env_cell_names_the_variable_load_config_reads(row: ConfigRow) -> None:
    # An LMCACHE_* name load_config does not know is an error, so acceptance proves the name.
    default = getattr(LMCacheConfig(), row.key)
    text = "none" if default is None else str(default).lower()
    assert load_config(env={row.env: text}) == LMCacheConfig()
    with pytest.raises(ValueError, match="Unknown lmcache config key"):
        load_config(env={row.env + "X": text})


def test_meaning_is_the_field_docstring_in_markdown() -> None:
    rows = {row.key: row for row in config_rows()}
    # reST ``literal`` and :meth:`role` become Markdown `code`; lines are joined.
    assert "`checksum_for` resolves it" in rows["checksum"].doc
    assert "``" not in markdown_table() and ":meth:" not in markdown_table()
    assert "\n" not in rows["tier_timeout"].doc


def test_replace_table_rewrites_only_between_markers() -> None:
    text = f"# T\n\nbefore\n{BEGIN_MARKER}\nold table\n{END_MARKER}\nafter\n"
    assert (
        replace_table(text, "NEW") == f"# T\n\nbefore\n{BEGIN_MARKER}\nNEW\n{END_MARKER}\nafter\n"
    )
    with pytest.raises(ValueError, match="found 0 and 1"):
        replace_table(f"x\n{END_MARKER}\n")
    with pytest.raises(ValueError, match="found 1 and 1"):
        replace_table(f"{END_MARKER}\n{BEGIN_MARKER}\n")


def test_write_and_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "README.md"
    doc.write_text(f"a\n{BEGIN_MARKER}\nstale\n{END_MARKER}\nb\n", encoding="utf-8")
    assert main(["--check", str(doc)]) == 1
    assert REGENERATE_COMMAND in capsys.readouterr().out
    assert main(["--write", str(doc)]) == 0
    assert (
        doc.read_text(encoding="utf-8")
        == f"a\n{BEGIN_MARKER}\n{markdown_table()}\n{END_MARKER}\nb\n"
    )
    assert main(["--check", str(doc)]) == 0
    doc.write_text("no markers\n", encoding="utf-8")
    assert main(["--write", str(doc)]) == 2
    assert doc.read_text(encoding="utf-8") == "no markers\n"


def test_runs_as_a_module() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lmcache.config.table"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == markdown_table()
