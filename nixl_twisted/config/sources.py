"""Where settings come from before they are a configuration: the TOML file, the environment.

Each raw value, whatever its source, goes through its setting's parser
(:func:`parse`); an error is a ``ConfigError`` that names the source and the
key. ``nixl_twisted.config`` puts the parsed values together.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

from nixl_twisted.config.settings import BY_NAME, SETTINGS
from nixl_twisted.config.spelling import SpelledTwice, dashed, did_you_mean
from nixl_twisted.config.values import InvalidValue

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration that cannot be used: ``key`` is the setting at fault."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def parse(
    raw: Mapping[str, object],
    where: Callable[[str], str],
    unknown: Callable[[str], str] | None = None,
) -> dict[str, object]:
    """Parse raw values by long name; ``where(key)`` starts each error message, and
    ``unknown(key)`` says what a key that is no setting may have meant."""
    parsed: dict[str, object] = {}
    for key, value in raw.items():
        setting = BY_NAME.get(key)
        if setting is None:
            hint = (unknown or _meant)(key)
            raise ConfigError(key, f"{where(key)}unknown key{hint or _LISTED}")
        try:
            if setting.many:
                if not isinstance(value, list | tuple):
                    raise InvalidValue("must be a list of strings")
                parsed[key] = tuple(setting.parse(item) for item in value)
            else:
                parsed[key] = setting.parse(value)
        except InvalidValue as error:
            raise ConfigError(key, f"{where(key)}{error}") from None
    return parsed


#: What an unknown key's error says when no setting's name is close to it.
_LISTED = " (the keys are the options' long names: twistd nixlproxy --help, docs/configuration.md)"


def _meant(key: str) -> str:
    return did_you_mean(key, BY_NAME)


def from_environment(given: Mapping[str, object], environ: Mapping[str, str]) -> dict[str, object]:
    """The settings the environment gives (each setting's ``env``) that ``given`` lacks, parsed."""
    found: dict[str, object] = {}
    for setting in SETTINGS:
        if given.get(setting.name) is not None:
            continue
        name = next((name for name in setting.env if environ.get(name)), None)
        if name is not None:
            value: object = environ[name]
            if setting.many:  # (a list in one variable: comma-separated)
                value = [item.strip() for item in environ[name].split(",") if item.strip()]
            found.update(parse({setting.name: value}, _from_variable(name)))
    return found


def _from_variable(name: str) -> Callable[[str], str]:
    """Where a value read from the environment came from, for its error."""
    return lambda key: f"{name} (for --{key}) "


def read_file(path: str) -> dict[str, object]:
    """The settings a TOML file holds (keys with dashes or underscores), parsed."""
    try:
        with open(path, "rb") as file:
            table = tomllib.load(file)
    except OSError as error:
        raise ConfigError("config", f"--config {path}: cannot read it: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError("config", f"--config {path}: not valid TOML: {error}") from None
    except UnicodeDecodeError as error:  # (tomllib reads bytes as UTF-8, and says it so)
        raise ConfigError(
            "config", f"--config {path}: not UTF-8 text (byte {error.start}), as TOML must be"
        ) from None
    table, written = _flattened(table)
    try:
        named = dashed(table, f"--config {path}: ")
    except SpelledTwice as error:
        raise ConfigError(error.name, str(error)) from None
    raw = {name: value for name, (_, value) in named.items()}

    def as_written(name: str) -> str:
        key = named[name][0]
        return repr(written.get(key, key))

    def unknown(name: str) -> str:
        table = next((t for t in TABLES if named[name][0] in _inside(written, t)), None)
        if table is None:
            return did_you_mean(name, BY_NAME)
        # A key of [replicas]: what that table takes, as it is written there.
        inner = [key[len(table) + 1 :] for key in BY_NAME if key.startswith(f"{table}-")]
        hint = did_you_mean(name[len(table) + 1 :], inner, lambda key: repr(f"[{table}] {key}"))
        return hint or f" ([{table}] takes {', '.join(inner)})"

    return parse(raw, lambda name: f"--config {path}: {as_written(name)} ", unknown)


#: The TOML tables whose keys are settings of their own: ``[replicas] redis = URL`` is
#: ``replicas-redis`` (a table other settings take whole, ``[tenants.NAME]``, stays one).
TABLES = ("replicas",)


def _flattened(table: dict[str, object]) -> tuple[dict[str, object], dict[str, str]]:
    """``[replicas] redis = ...`` as ``replicas-redis = ...``: one key per setting; and
    how each key of a table was written (``'[replicas] url'``), for its errors."""
    flat: dict[str, object] = {}
    written: dict[str, str] = {}
    for key, value in table.items():
        if key in TABLES and isinstance(value, dict):
            for inner, given in value.items():
                flat[f"{key}-{inner}"] = given
                written[f"{key}-{inner}"] = f"[{key}] {inner}"
        else:
            flat[key] = value
    return flat, written


def _inside(written: Mapping[str, str], table: str) -> set[str]:
    """The flat keys that were written inside ``[table]``."""
    return {key for key, shown in written.items() if shown.startswith(f"[{table}] ")}
