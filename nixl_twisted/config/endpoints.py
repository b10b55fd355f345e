"""The TCP ports in Twisted endpoint strings, which ``--workers`` shares between processes.

Twisted's TCP endpoints keep no public accessor for their interface and
port, so the strings are read here; the settings check they parse at all.
"""

from __future__ import annotations


def _fields(description: str) -> list[str]:
    """An endpoint string's fields: split on ':' unless escaped as '\\:'."""
    fields, current, escaped = [], "", False
    for char in description:
        if escaped:
            current, escaped = current + char, False
        elif char == "\\":
            escaped = True
        elif char == ":":
            fields.append(current)
            current = ""
        else:
            current += char
    return [*fields, current]


def tcp_address(description: str) -> tuple[str, int] | None:
    """The (interface, port) of a ``tcp:`` or ``tcp6:`` endpoint string, else None.

    ``--workers`` shares these ports between processes; it reads the string
    itself because Twisted's TCP endpoints keep no public accessor for them.
    """
    kind, *fields = _fields(description)
    if kind not in ("tcp", "tcp6"):
        return None
    arguments = dict(f.split("=", 1) for f in fields if "=" in f)
    positional = [f for f in fields if "=" not in f]
    port = arguments.get("port", positional[0] if positional else None)
    if port is None or not port.isdigit():
        return None
    default = "::" if kind == "tcp6" else ""
    return arguments.get("interface", default), int(port)


def tcp_endpoint(host: str, port: int) -> str:
    """The endpoint string for a TCP port on ``host`` (every interface when empty)."""
    if not host or host in ("0.0.0.0", "::"):
        return f"tcp:{port}" if ":" not in host else f"tcp6:{port}"
    kind = "tcp6" if ":" in host else "tcp"
    return f"{kind}:{port}:interface={host.replace(':', chr(92) + ':')}"
