"""``twistd nixlproxy --help``: a usage line, examples that run, the options by group,
80 columns; and the docs' option tables grouped as it is."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from nixl_twisted.config import help
from nixl_twisted.config.groups import GROUPS, METAVARS
from nixl_twisted.config.settings import SETTINGS
from nixl_twisted.tap import Options

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "configuration.md"]
#: An option's first line in --help: two spaces, its name and placeholder.
OPTION_LINE = re.compile(r"^  --(?P<name>[a-z-]+)(?: (?P<metavar>\S+))?(?:\s|$)")


def grouped_help(text: str) -> list[tuple[str, list[str]]]:
    """Each heading of ``text`` (``Title:`` alone on a line) and the options listed under it."""
    found: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            found.append((line.removesuffix(":"), []))
        elif (m := OPTION_LINE.match(line)) and found:
            found[-1][1].append(m["name"])
    return [(title, names) for title, names in found if names]


def test_every_option_is_in_one_group_with_one_placeholder() -> None:
    listed = [name for group in GROUPS for name in group.names]
    assert len(listed) == len(set(listed))
    options = Options()
    real = {p[0] for p in options.optParameters} | {
        name.removeprefix("opt_").replace("_", "-") for name in dir(options) if name[:4] == "opt_"
    }
    assert set(listed) == real
    assert {s.name for s in SETTINGS} <= set(listed)


def test_help_starts_with_a_usage_line_then_examples() -> None:
    lines = Options().full_help().splitlines()
    assert lines[0].startswith("Usage: twistd [twistd options] nixlproxy [options]")
    assert lines.index("Examples:") < 12
    assert lines.count("Examples:") == 1


def test_help_lists_the_options_by_group_in_the_groups_order() -> None:
    shown = grouped_help(Options().full_help())
    expected = [
        (g.title, [n for n in g.names if n != "worker"])  # internal: not for people
        for g in GROUPS
    ]
    assert shown == expected


def test_help_spells_each_option_with_its_placeholder() -> None:
    for line in Options().full_help().splitlines():
        if m := OPTION_LINE.match(line):
            assert (m["metavar"] or "") == METAVARS[m["name"]], line


@pytest.mark.parametrize("width", [80, 100])
def test_help_fits_its_width_and_reads_as_sentences(width: int) -> None:
    for line in Options().full_help(width).splitlines():
        assert len(line) <= width, line
        # The help column starts at HELP_COLUMN; within it, single spaces only.
        described = line[help.HELP_COLUMN :] if line.startswith("  --") else line
        assert "  " not in described.strip(), line


def test_each_default_is_shown_once() -> None:
    text = " ".join(Options().full_help().split())
    assert (
        text.count("[default:")
        == text.count("[default: ")
        == sum("[default:" in doc for doc in Options().docs.values())
    )


def example_lines(tmp_path: Path) -> list[list[str]]:
    """Each example of --help as the arguments after ``nixlproxy``, its file made in tmp_path."""
    config = tmp_path / "nixlproxy.toml"
    config.write_text("", encoding="utf-8")
    examples = []
    for _, lines in help.EXAMPLES:
        words = shlex.split(" ".join(lines).replace("/etc/nixlproxy.toml", str(config)))
        examples.append(words[words.index("nixlproxy") + 1 :])
    return examples


def test_the_examples_parse(tmp_path: Path) -> None:
    """A renamed option breaks this test, not a reader's first command."""
    for args in example_lines(tmp_path):
        options = Options()
        if "--config" in args:
            args += ["--prefill", "http://p:8100", "--decode", "http://d:8200"]
        options.parseOptions(args)
        assert options.config is not None


def page_groups(page: Path) -> list[tuple[str, list[str]]]:
    """Each ``###`` heading of ``page``'s options and the options its table rows name."""
    found: list[tuple[str, list[str]]] = []
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("### "):
            found.append((line[4:], []))
        elif (m := re.match(r"^\| `--([a-z-]+)", line)) and found:
            found[-1][1].append(m[1])
    return [(title, names) for title, names in found if names]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_the_docs_tables_are_grouped_and_spelled_as_help(page: Path) -> None:
    groups = page_groups(page)
    documented = {name for _, names in groups for name in names}
    in_order = [(g.title, [n for n in g.names if n in documented]) for g in GROUPS]
    assert groups == [(title, names) for title, names in in_order if names]
    for row in re.finditer(r"^\| `--([a-z-]+)( [^`]*)?`", page.read_text("utf-8"), re.M):
        assert (row[2] or "").strip() == METAVARS[row[1]], row[0]
