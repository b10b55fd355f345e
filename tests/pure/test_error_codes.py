"""Every error code is in the catalog and in docs/failures.md, alike; the catalog holds together."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nixl_twisted.protocol import codes
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError

FAILURES = Path(__file__).resolve().parents[2] / "docs" / "failures.md"
HEADING = "## Every error code"
HEADER = "| code | status | type | meaning |"
ROW = re.compile(
    r"^\| `(?P<code>[^`]+)` \| (?P<status>[^|]+) \| `(?P<type>[^`]+)` \| (?P<meaning>.+) \|$"
)


def row_of(code: ErrorCode) -> str:
    """The table row ``code`` has in docs/failures.md."""
    status = "-" if code.status is None else str(code.status)
    return f"| `{code.value}` | {status} | `{code.error_type}` | {code.meaning} |"


def documented(text: str) -> list[str]:
    """The rows of the table under *Every error code*, as written."""
    lines = text.splitlines()
    assert HEADING in lines, f"failures.md has no {HEADING!r} section"
    section = lines[lines.index(HEADING) :]
    assert HEADER in section, f"the {HEADING!r} section has no table headed {HEADER!r}"
    start = section.index(HEADER) + 2  # past the header and its |---| line
    rows = []
    for line in section[start:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def table_problems(text: str) -> list[str]:
    """What the table gets wrong against the catalog, each said as the edit that fixes it."""
    catalog = {code.value: code for code in ErrorCode}
    problems = []
    seen: set[str] = set()
    for line in documented(text):
        match = ROW.match(line)
        if match is None:
            problems.append(f"a row not of the form {HEADER!r}: {line}")
            continue
        name = match["code"]
        if name not in catalog:
            problems.append(f"`{name}` is documented but not in ErrorCode: remove its row")
        elif name in seen:
            problems.append(f"`{name}` has more than one row: keep one")
        elif line != row_of(catalog[name]):
            problems.append(
                f"`{name}`'s row differs from the catalog: write {row_of(catalog[name])}"
            )
        seen.add(name)
    for name in catalog.keys() - seen:
        problems.append(f"`{name}` is not documented: add {row_of(catalog[name])}")
    return sorted(problems)


def test_failures_md_documents_every_code_and_no_other() -> None:
    problems = table_problems(FAILURES.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


def test_a_table_that_drifts_is_told_what_to_write() -> None:
    """The test above can fail: a code missing, one unknown, a status wrong."""
    text = FAILURES.read_text(encoding="utf-8")
    drifted = (
        text.replace(row_of(ErrorCode.DRAINING) + "\n", "")
        .replace("| `request_too_large` | 413 |", "| `request_too_large` | 400 |")
        .replace(
            HEADER + "\n|---|---|---|---|\n",
            HEADER + "\n|---|---|---|---|\n| `bogus` | 418 | `proxy_error` | not a code |\n",
        )
    )
    assert table_problems(drifted) == [
        "`bogus` is documented but not in ErrorCode: remove its row",
        f"`draining` is not documented: add {row_of(ErrorCode.DRAINING)}",
        f"`request_too_large`'s row differs from the catalog: write "
        f"{row_of(ErrorCode.REQUEST_TOO_LARGE)}",
    ]


def test_every_code_is_one_line_in_a_body() -> None:
    for code in ErrorCode:
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", code.value), code
        assert code.meaning and "\n" not in code.meaning and "|" not in code.meaning, code


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_role_picks_its_own_code(role: str) -> None:
    assert codes.unreachable(role).value == f"{role}_unreachable"
    assert codes.timed_out(role).value == f"{role}_timeout"
    assert codes.no_healthy(role).value == f"no_healthy_{role}"


def test_an_unknown_role_has_no_code() -> None:
    with pytest.raises(ValueError, match="router"):
        codes.unreachable("router")


def test_a_proxy_error_takes_its_status_from_its_code() -> None:
    error = ProxyError(ErrorCode.PREFILL_TIMEOUT, "slow")
    assert (error.status, error.code.error_type, error.message) == (504, "upstream_error", "slow")
    assert ProxyError(ErrorCode.BATCH_PART_FAILED, "part", status=422).status == 422
    with pytest.raises(ValueError, match="has no status of its own"):
        ProxyError(ErrorCode.BATCH_PART_FAILED, "part")
    with pytest.raises(ValueError, match="is always a 504"):
        ProxyError(ErrorCode.PREFILL_TIMEOUT, "slow", status=502)
