"""The options tables (docs/configuration.md, the README) cannot drift from the settings table."""

from __future__ import annotations

import importlib
import itertools
import re
from pathlib import Path

import pytest

from nixl_twisted.config.settings import BY_NAME, SETTINGS, default_text
from nixl_twisted.tap import Options
from nixl_twisted.web.app import ProxyApp

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
ROW = re.compile(r"^\| `--(?P<name>[a-z-]+)(?P<metavar>[^`]*)` \|(?P<default>[^|]*)\|", re.M)
#: The first cell of any row that names options, to catch one shared by several.
FIRST_CELL = re.compile(r"^\| (?P<cell>`--.*?) \|", re.M)
#: Options of the command line that are not settings of the proxy, with the
#: default their rows show.
COMMAND_ONLY = {"config": "(none)", "version": "", "worker": ""}
#: The pages with an options table, and the options each leaves out: the
#: README's is the short one, and ``--worker`` is not for people.
OPTION_TABLES = {DOCS / "configuration.md": set(), ROOT / "README.md": {"worker"}}


def option_rows(page: Path) -> list[tuple[str, str, str]]:
    """Each row of ``page``'s options table: the option, its metavar, its default."""
    table = page.read_text(encoding="utf-8")
    return [
        (m["name"], m["metavar"].strip(), m["default"].strip().strip("`"))
        for m in ROW.finditer(table)
    ]


def shown_defaults() -> dict[str, str]:
    """Every option of ``twistd nixlproxy`` and the default its row must show."""
    return {s.name: default_text(s) for s in SETTINGS} | COMMAND_ONLY


def _cell(default: str) -> str:
    return default if default in ("", "(none)", "(required)") else f"`{default}`"


def suggested_row(name: str) -> str:
    """The row to add for ``--name``, its metavar taken from another table if one has it."""
    metavars = {n: metavar for page in OPTION_TABLES for n, metavar, _ in option_rows(page)}
    metavar = f" {metavars[name]}" if metavars.get(name) else " VALUE" if name in BY_NAME else ""
    setting = BY_NAME.get(name)
    about = f" (--help says: {setting.help})" if setting else ""
    return f"| `--{name}{metavar}` | {_cell(shown_defaults()[name])} | <a few words> |{about}"


def table_problems(page: Path, left_out: set[str]) -> list[str]:
    """What ``page``'s options table gets wrong, each said as the edit that fixes it."""
    text = page.read_text(encoding="utf-8")
    expected = {n: d for n, d in shown_defaults().items() if n not in left_out}
    problems = []
    shared: set[str] = set()
    for cell in FIRST_CELL.finditer(text):
        names = re.findall(r"`--([a-z-]+)", cell["cell"])
        if len(names) > 1:
            shared.update(names)
            split = "; ".join(suggested_row(n) for n in names if n in expected)
            problems.append(f"{page.name} has one row for {cell['cell']}: one row each: {split}")
    rows = option_rows(page)
    for name in expected.keys() - {n for n, _, _ in rows} - shared:
        problems.append(f"{page.name} has no row for --{name}: add {suggested_row(name)}")
    seen: set[str] = set()
    for name, _, default in rows:
        if name in left_out:
            problems.append(f"{page.name} leaves --{name} out on purpose: remove its row")
        elif name not in expected:
            problems.append(
                f"{page.name} has a row for --{name}, which twistd nixlproxy does not have: "
                "remove it"
            )
        elif name in seen:
            problems.append(f"{page.name} has more than one row for --{name}: keep one")
        elif default != expected[name]:
            problems.append(
                f"{page.name} shows --{name}'s default as {default!r}, settings.default_text "
                f"renders {expected[name]!r}: write {_cell(expected[name]) or 'nothing'} "
                "in its default cell"
            )
        seen.add(name)
    return sorted(problems)


@pytest.mark.parametrize("page", OPTION_TABLES, ids=lambda page: str(page.relative_to(ROOT)))
def test_each_options_table_has_one_row_per_option_with_its_default(page: Path) -> None:
    problems = table_problems(page, OPTION_TABLES[page])
    assert not problems, "\n".join(problems)


def test_the_command_only_options_are_the_command_lines() -> None:
    options = Options()
    real = {p[0] for p in options.optParameters} | {
        name.removeprefix("opt_").replace("_", "-")
        for name in dir(options)
        if name.startswith("opt_") and name != "opt_help"
    }
    assert real == {s.name for s in SETTINGS} | set(COMMAND_ONLY)


def test_a_table_that_drifts_is_told_what_to_write(tmp_path: Path) -> None:
    """The failure says which row to add, remove or correct, not only that one is wrong."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    drifted = tmp_path / "README.md"
    rows = readme.splitlines(keepends=True)
    drifted.write_text(
        "".join(
            row.replace("| `3` |", "| `5` |") if row.startswith("| `--health-interval") else row
            for row in rows
            if not row.startswith("| `--shutdown-delay")
        )
        + "| `--bogus N` | `1` | not an option |\n",
        encoding="utf-8",
    )
    assert table_problems(drifted, {"worker"}) == [
        "README.md has a row for --bogus, which twistd nixlproxy does not have: remove it",
        "README.md has no row for --shutdown-delay: add | `--shutdown-delay SECONDS` | `0` | "
        f"<a few words> | (--help says: {BY_NAME['shutdown-delay'].help})",
        "README.md shows --health-interval's default as '5', settings.default_text renders "
        "'3': write `3` in its default cell",
    ]


def test_a_row_shared_by_two_options_is_split_and_an_internal_one_removed(
    tmp_path: Path,
) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    drifted = tmp_path / "README.md"
    drifted.write_text(
        "".join(
            row
            for row in readme.splitlines(keepends=True)
            if not row.startswith(("| `--health-interval", "| `--health-timeout"))
        )
        + "| `--health-interval S`, `--health-timeout S` | `3`, `2` | checks |\n"
        + "| `--worker N` | | internal |\n",
        encoding="utf-8",
    )
    assert table_problems(drifted, {"worker"}) == [
        "README.md has one row for `--health-interval S`, `--health-timeout S`: one row each: "
        f"{suggested_row('health-interval')}; {suggested_row('health-timeout')}",
        "README.md leaves --worker out on purpose: remove its row",
    ]


def test_help_shows_each_default() -> None:
    help_text = " ".join(Options().full_help().split())
    for setting in SETTINGS:
        shown = default_text(setting)
        if shown == "(none)":
            assert f"[default: {shown}]" not in help_text
        elif shown == "(required)":
            assert f"{setting.help} [required]" in help_text, setting.name
        else:
            assert f"[default: {shown}]" in help_text, setting.name


def test_a_usage_error_gets_a_hint_not_the_whole_help() -> None:
    short = Options().getUsage()
    assert len(short.splitlines()) == 2 and "twistd nixlproxy --help" in short


#: What a user cannot see: the team's protocol notes, its issues, the reference proxy.
UNSEEN = ("PROTOCOL.md", "the seed", "Rust proxy", "performance issue", "the issue")


def test_the_user_docs_stand_on_their_own() -> None:
    pages = [DOCS.parent / "README.md", *DOCS.glob("*.md")]
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for unseen in UNSEEN:
            assert unseen not in text, f"{page.name} mentions {unseen!r}"


def test_the_code_points_to_nothing_a_reader_cannot_open() -> None:
    """Docstrings and comments are docs too: a reader of the package has the same pages."""
    for module in sorted((ROOT / "nixl_twisted").rglob("*.py")):
        text = module.read_text(encoding="utf-8")
        for unseen in UNSEEN:
            assert unseen not in text, f"{module.relative_to(ROOT)} mentions {unseen!r}"


#: A dotted name of the package, as the docs cite modules and what they define.
DOTTED = re.compile(r"\bnixl_twisted(?:\.[A-Za-z_]\w*)+")


def _resolves(dotted: str) -> bool:
    """An importable module, or a name defined along the way (``module.Class.method``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(found, name):
                return False
            found = getattr(found, name)
        return True
    return False


def test_every_module_the_docs_name_exists() -> None:
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    named = {(page.name, m) for page in pages for m in DOTTED.findall(page.read_text("utf-8"))}
    assert named, "the docs name no module at all: the pattern is wrong"
    assert sorted((page, name) for page, name in named if not _resolves(name)) == []


#: A routes table's header, and a route as a table names it: `POST /v1/responses/{id}`.
ROUTES_HEADER = "| route | behaviour |"
DOC_ROUTE = re.compile(r"`(?P<method>[A-Z]+) (?P<path>/[^`\s]*)`")


def _variables_as_braces(path: str) -> str:
    """``/v1/responses/<string:response_id>`` and ``/v1/responses/{id}`` alike: ``{}``."""
    return re.sub(r"<[^>]+>|{[^}]*}", "{}", path)


def served_routes() -> dict[str, str]:
    """Each route of the Klein app, ``METHOD /path`` with variables as ``{}``, and as docs write it.

    Werkzeug adds HEAD to every GET rule by itself; the docs name the GET.
    """
    routes = {}
    for rule in ProxyApp.app.url_map.iter_rules():
        methods = set(rule.methods or ())
        if "GET" in methods:
            methods.discard("HEAD")
        written = re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule)
        for method in methods:
            routes[f"{method} {_variables_as_braces(rule.rule)}"] = f"{method} {written}"
    return routes


def routes_tables() -> dict[Path, set[str]]:
    """Each page with a routes table, and the routes its rows name (variables as ``{}``)."""
    tables = {}
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        lines = page.read_text(encoding="utf-8").splitlines()
        if ROUTES_HEADER not in lines:
            continue
        rows = itertools.takewhile(
            lambda line: line.startswith("|"), lines[lines.index(ROUTES_HEADER) :]
        )
        tables[page] = {
            f"{m['method']} {_variables_as_braces(m['path'])}"
            for row in rows
            for m in DOC_ROUTE.finditer(row.split(" | ", 1)[0])
        }
    return tables


def test_the_routes_tables_name_every_route_served_and_no_other() -> None:
    served = served_routes()
    tables = routes_tables()
    assert {ROOT / "README.md", DOCS / "protocol.md"} <= set(tables)
    problems = [
        f"{page.name}'s routes table lacks `{served[route]}`: add it"
        for page, named in tables.items()
        for route in sorted(served.keys() - named)
    ] + [
        f"{page.name}'s routes table names `{route}`, which the app does not serve: remove it"
        for page, named in tables.items()
        for route in sorted(named - served.keys())
    ]
    assert not problems, "\n".join(problems)


def test_the_app_routes_are_read_as_the_docs_write_them() -> None:
    """Else the test above would compare two different spellings and prove nothing."""
    served = served_routes()
    assert served["GET /v1/responses/{}"] == "GET /v1/responses/{response_id}"
    assert "POST /v1/messages/count_tokens" in served
    assert "HEAD /v1/models" not in served
