"""The configuration reference in docs/ cannot drift from the settings table."""

from __future__ import annotations

import re
from pathlib import Path

from nixl_twisted.settings import SETTINGS, default_text
from nixl_twisted.tap import Options

DOCS = Path(__file__).resolve().parents[2] / "docs"
ROW = re.compile(r"^\| `--(?P<name>[a-z-]+)[^`]*` \|(?P<default>[^|]*)\|", re.M)
#: Options of the command line that are not settings of the proxy.
COMMAND_ONLY = {"config", "version", "worker"}


def documented() -> dict[str, str]:
    table = (DOCS / "configuration.md").read_text(encoding="utf-8")
    return {m["name"]: m["default"].strip().strip("`") for m in ROW.finditer(table)}


def test_every_option_is_documented_and_every_documented_option_exists() -> None:
    options = Options()
    real = {p[0] for p in options.optParameters} | {
        name.removeprefix("opt_").replace("_", "-")
        for name in dir(options)
        if name.startswith("opt_") and name != "opt_help"
    }
    assert set(documented()) == real
    assert real == {s.name for s in SETTINGS} | COMMAND_ONLY


def test_documented_defaults_are_the_settings_defaults() -> None:
    docs = documented()
    for setting in SETTINGS:
        assert docs[setting.name] == default_text(setting), setting.name


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


def test_help_text_has_no_runs_of_spaces_mid_sentence() -> None:
    for line in Options().full_help(width=100).splitlines():
        described = line[31:] if line.startswith("      --") or line.startswith(" " * 31) else line
        assert "  " not in described.strip(), line


def test_a_usage_error_gets_a_hint_not_the_whole_help() -> None:
    short = Options().getUsage()
    assert len(short.splitlines()) == 2 and "twistd nixlproxy --help" in short


def test_the_user_docs_stand_on_their_own() -> None:
    """Nothing a user cannot see: the team's protocol notes, its issues, the reference proxy."""
    pages = [DOCS.parent / "README.md", *DOCS.glob("*.md")]
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for unseen in ("PROTOCOL.md", "the seed", "Rust proxy", "performance issue", "the issue"):
            assert unseen not in text, f"{page.name} mentions {unseen!r}"
