"""The docs build without warnings, and the configuration reference cannot drift."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from nixl_twisted.tap import Options

DOCS = Path(__file__).resolve().parent.parent / "docs"
ROW = re.compile(r"^\| `--(?P<name>[a-z-]+)[^`]*` \|(?P<default>[^|]*)\|", re.M)


def test_sphinx_builds_the_docs_with_warnings_as_errors(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(DOCS), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "html" / "testing-api.html").exists()


def documented() -> dict[str, str]:
    table = (DOCS / "configuration.md").read_text(encoding="utf-8")
    return {m["name"]: m["default"].strip().strip("`") for m in ROW.finditer(table)}


def test_every_option_is_documented_and_every_documented_option_exists() -> None:
    options = Options()
    real = {p[0] for p in options.optParameters} | {
        name.removeprefix("opt_").replace("_", "-")
        for name in dir(options)
        if name.startswith("opt_") and name not in ("opt_help",)
    }
    assert set(documented()) == real


def test_documented_defaults_are_the_real_ones() -> None:
    docs = documented()
    for name, _, default, *_ in Options.optParameters:
        shown = docs[name]
        if default is None:
            assert shown in ("(none)",) or shown.startswith("$"), (name, shown)
        elif isinstance(default, int | float):
            assert float(shown) == float(default), (name, shown, default)
        else:
            assert shown == default, (name, shown, default)
