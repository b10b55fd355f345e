"""The trial example in docs/testing.md, run as written, so the docs cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

_DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"
_EXAMPLE = re.search(
    r"## A trial test of your own\s+```python\n(.*?)```", _DOC.read_text(encoding="utf-8"), re.S
)
assert _EXAMPLE, "docs/testing.md lost its trial example"
exec(compile(_EXAMPLE.group(1), str(_DOC), "exec"))
