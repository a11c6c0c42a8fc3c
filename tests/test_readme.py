"""The README's options table is the users' reference: it must name every writer option, with
its real default, and nothing that is not one (a user sweep found ``storage_options`` missing
from it while the unknown-option error listed it)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from dcp_datastates.options import WriterOptions

README = Path(__file__).resolve().parent.parent / "README.md"
MiB = 1 << 20


def _options_table() -> dict[str, str]:
    """``option -> default`` as the README's "### Options" table gives them."""
    text = README.read_text()
    section = text.split("\n### Options\n", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `(\w+)` \| ([^|]*) \|", line)
        if match:
            rows[match.group(1)] = match.group(2).strip()
    return rows


def _value(default: str) -> object:
    size = re.fullmatch(r"(\d+) MiB", default)
    if size:
        return int(size.group(1)) * MiB
    return ast.literal_eval(default.strip("`"))


def test_the_options_table_names_every_writer_option_with_its_default() -> None:
    table = _options_table()
    fields = {f.name: f.default for f in dataclasses.fields(WriterOptions)}
    assert set(table) == set(fields), (
        f"missing from the README: {sorted(set(fields) - set(table))}; "
        f"not options: {sorted(set(table) - set(fields))}"
    )
    for name, default in table.items():
        assert _value(default) == fields[name], f"{name}: README {default}, code {fields[name]!r}"


def test_every_error_the_readme_lists_is_importable_from_the_package() -> None:
    """``except dcp_datastates.X`` must work for every error of the "## Errors" table (a user
    sweep found ``SnapshotAbortedError`` only in ``dcp_datastates.errors``)."""
    import dcp_datastates

    section = README.read_text().split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\w+Error)`", section, flags=re.MULTILINE)
    assert len(listed) >= 9, listed
    for name in listed:
        error = getattr(dcp_datastates, name, None)
        assert isinstance(error, type) and issubclass(error, dcp_datastates.DataStatesError), name
        assert name in dcp_datastates.__all__, name


def test_the_automatic_pools_floor_is_the_one_the_readme_gives() -> None:
    from dcp_datastates.save.resources import MIN_AUTO_POOL

    floors = re.findall(r"never under (\d+) MiB", README.read_text())
    assert floors and {int(f) * MiB for f in floors} == {MIN_AUTO_POOL}, floors
