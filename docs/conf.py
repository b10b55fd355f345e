"""Sphinx configuration for the nixl-twisted docs (``make docs``)."""

from __future__ import annotations

project = "nixl-twisted"
author = "the nixl-twisted developers"
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
exclude_patterns = ["_build"]
html_theme = "alabaster"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# The docs describe the package as installed; no import-time side effects.
autodoc_mock_imports: list[str] = []
# The sequence diagram is a ```mermaid block, drawn where the Markdown is read
# (GitHub, editors); Sphinx shows its source, which needs no lexer.
suppress_warnings = ["misc.highlighting_failure"]
