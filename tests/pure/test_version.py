"""The package's version is written once, in ``nixl_twisted.__version__``: the build reads
it there, and the CHANGELOG names no other."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

from nixl_twisted import VERSION, __version__

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
#: A release number as the CHANGELOG's opening writes one: `0.1.0`.
SAID = re.compile(r"`(\d+\.\d+\.\d+)`")
#: A release's heading: ## [0.1.0] - 2027-01-04.
RELEASED = re.compile(r"^## \[(\d+\.\d+\.\d+)\]", re.M)


def test_the_build_reads_the_version_from_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "nixl_twisted.__version__"}
    assert "version" not in (ROOT / "setup.py").read_text("utf-8")
    assert importlib.metadata.version("nixl-twisted") == __version__  # (as installed)


def test_the_changelog_names_the_packages_version_only() -> None:
    """Its opening says what the package says it is; its newest release heading, if any,
    is the version (entries may name other projects' versions, vLLM's)."""
    changelog = (ROOT / "CHANGELOG.md").read_text("utf-8")
    opening = changelog.split("\n## ", 1)[0]
    assert set(SAID.findall(opening)) == {__version__}
    released = RELEASED.findall(changelog)
    assert released[:1] in ([], [__version__])


def test_the_protocol_version_is_another_number() -> None:
    """``VERSION`` is the protocol's (the prefill lowering's), not the package's."""
    assert isinstance(VERSION, int) and str(VERSION) != __version__
