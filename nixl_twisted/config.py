"""The TOML config file: every option of ``twistd nixlproxy``, by its long name.

Values from the file come first; the command line overrides them (a list
option given on the command line replaces the file's list). The file is
checked at start, and every error names the file and the key.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from twisted.python import usage

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

#: Options that may be repeated on the command line; lists in the file.
LIST_OPTIONS = ("listen", "prefill", "decode")
#: Not a config key: the file cannot name itself, and the version is not config.
NOT_IN_FILE = ("config", "version", "help")


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as error:
        raise usage.UsageError(f"--config {path}: cannot read it: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise usage.UsageError(f"--config {path}: not valid TOML: {error}") from None


def pools_from_file(path: str) -> dict[str, list[str]]:
    """The ``prefill`` and ``decode`` lists the file has now (for SIGHUP)."""
    table = {key.replace("_", "-"): value for key, value in _load(path).items()}
    pools: dict[str, list[str]] = {}
    for role in ("prefill", "decode"):
        if role in table:
            urls = table[role]
            if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
                raise usage.UsageError(f"--config {path}: {role!r} must be a list of strings")
            pools[role] = urls
    return pools


def config_path(args: Sequence[str]) -> str | None:
    """The ``--config`` value among command-line arguments, if any."""
    for index, arg in enumerate(args):
        if arg == "--config" and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _given(args: Sequence[str], name: str) -> bool:
    flag = f"--{name}"
    return any(arg == flag or arg.startswith(flag + "=") for arg in args)


def file_arguments(
    path: str,
    cli_args: Sequence[str],
    parameters: dict[str, Callable[[str], Any] | None],
) -> list[str]:
    """The file's settings as command-line arguments to put before ``cli_args``.

    ``parameters`` maps each valued option to its coerce function, used here
    to check values so that an error can name the key.
    """
    table = _load(path)
    known = set(parameters) | set(LIST_OPTIONS)
    args: list[str] = []
    for raw_key, value in table.items():
        key = raw_key.replace("_", "-")
        if key not in known or key in NOT_IN_FILE:
            raise usage.UsageError(
                f"--config {path}: unknown key {raw_key!r} "
                f"(keys are the long option names: {', '.join(sorted(known))})"
            )
        if key in LIST_OPTIONS:
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise usage.UsageError(f"--config {path}: {raw_key!r} must be a list of strings")
            if not _given(cli_args, key):
                args += [arg for item in value for arg in (f"--{key}", item)]
            continue
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise usage.UsageError(
                f"--config {path}: {raw_key!r} must be a string or a number, not {value!r}"
            )
        coerce = parameters[key]
        if coerce is not None:
            try:
                coerce(str(value))
            except ValueError as error:
                raise usage.UsageError(f"--config {path}: {raw_key!r}: {error}") from None
        args.append(f"--{key}={value}")
    return args
