"""What ``twistd nixlproxy --help`` prints: a usage line, examples, the options by group.

Twisted's ``usage.Options`` keeps each option's help (``docs``, from
``optParameters`` and the ``opt_`` methods' docstrings) and prints them in
one alphabetical list; this lays the same help out by ``groups.GROUPS``, in
the order an operator reads them, at most ``width`` columns wide.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping

from nixl_twisted.config.groups import GROUPS

USAGE = "Usage: twistd [twistd options] nixlproxy [options] --prefill URL --decode URL"

#: Each example: what it shows, then its command line, one option or two a line.
EXAMPLES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "One prefill and one decode instance, in the foreground, no pid file:",
        (
            "twistd -n --pidfile= nixlproxy --listen tcp:8000",
            "--prefill http://10.0.0.1:8100 --decode http://10.0.0.2:8200",
        ),
    ),
    (
        "Pods found by label in Kubernetes, prefill chosen by cached prefix,"
        " the admin API on its own port (its token from NIXLPROXY_ADMIN_TOKEN):",
        (
            "twistd -n --pidfile= nixlproxy",
            "--prefill-selector app=vllm,role=prefill",
            "--decode-selector app=vllm,role=decode",
            "--prefill-policy cache-aware --admin-listen tcp:9000",
        ),
    ),
    (
        "Every option from a TOML file by its long name (SIGHUP reloads it),"
        " two worker processes, JSON logs:",
        (
            "twistd -n --pidfile= nixlproxy --config /etc/nixlproxy.toml",
            "--workers 2 --log-format json",
        ),
    ),
)

NOTE = (
    "Options take their value as --name VALUE or --name=VALUE; each is also a key "
    "of the --config file (the command line wins). Defaults are shown once, in "
    "brackets; an option with none is off or unset until given."
)

#: The column the options' help starts at; a longer option has its help on the next line.
HELP_COLUMN = 30


def render(description: str, docs: Mapping[str, str], width: int = 80) -> str:
    """The whole help: ``docs`` maps each option to its help (``usage.Options.docs``).

    An option whose help starts with ``(internal)`` is left out: it is not for people.
    """
    out = [USAGE, "", *_wrap(description, width), "", "Examples:"]
    for said, lines in EXAMPLES:
        out += _wrap(said, width, "  ")
        indented = [f"    {lines[0]}", *(f"        {line}" for line in lines[1:])]
        out += [f"{line} \\" for line in indented[:-1]] + indented[-1:]
        out.append("")
    out += _wrap(NOTE, width)
    for group in GROUPS:
        shown = [(n, m) for n, m in group.options if not docs[n].startswith("(internal)")]
        out += ["", f"{group.title}:"]
        for name, metavar in shown:
            out += _option(f"--{name} {metavar}".rstrip(), docs[name], width)
    return "\n".join(out) + "\n"


def _option(spelled: str, doc: str, width: int) -> list[str]:
    """One option: its spelling, then its help wrapped in the second column."""
    lines = _wrap(doc, width - HELP_COLUMN)
    head = f"  {spelled}"
    if len(head) > HELP_COLUMN - 2:
        return [head, *(" " * HELP_COLUMN + line for line in lines)]
    first = f"{head:<{HELP_COLUMN}}{lines[0]}"
    return [first, *(" " * HELP_COLUMN + line for line in lines[1:])]


def _wrap(text: str, width: int, indent: str = "") -> list[str]:
    """``text`` in lines of at most ``width``, never broken inside a word (a URL, --an-option)."""
    return textwrap.wrap(
        " ".join(text.split()),
        width,
        initial_indent=indent,
        subsequent_indent=indent,
        break_on_hyphens=False,
        break_long_words=False,
    )
