"""``[models.NAME]``: a model's own pools, and its own routing and decide rules.

Instances serving several models (or a base model and its LoRA adapters on
different instances) lists each model's instances under its name; what a
model's table does not say is the top level's. The keys are the top-level
settings' own names, read by the same parsers, so a table reads as the
options do.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from nixl_twisted.config.spelling import known_keys
from nixl_twisted.config.values import POLICIES, InvalidValue, choice, count, pool_member

#: The keys a model's table may give (its pools, their policies and the decide
#: rules), each parsed as its top-level setting is (a test keeps the two alike).
MODEL_KEYS: dict[str, Callable[[object], Any]] = {
    "prefill": pool_member,
    "decode": pool_member,
    "prefill-policy": choice(*POLICIES),
    "decode-policy": choice(*POLICIES),
    "decode-only-below": count(0),
    "decode-only-uncached-below": count(0),
    "decode-only-busy-below": count(0),
    "prefill-busy-at": count(1),
    "prefill-fallback": choice("none", "decode"),
    "prefill-max-in-flight": count(0),
    "decode-max-in-flight": count(0),
}


class ModelPools(NamedTuple):
    """One ``[models.NAME]`` table: the instances that serve NAME, and its own settings."""

    name: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    #: The other keys it gives, (setting name, parsed value), sorted.
    own: tuple[tuple[str, Any], ...] = ()

    def setting(self, name: str, default: Any) -> Any:
        """This model's value of a top-level setting, else ``default``."""
        return dict(self.own).get(name, default)

    def members(self, role: str) -> tuple[str, ...]:
        return self.prefill if role == "prefill" else self.decode


def model_table(value: object) -> tuple[ModelPools, ...]:
    """``[models.NAME]`` tables (JSON text on the command line, or this parser's output).

    Each model's ``prefill`` and ``decode`` are lists of pool members, as
    ``--prefill`` takes them; the other keys are checked by their settings' parsers.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidValue("must be a table of models (JSON on the command line)") from None
    if isinstance(value, list | tuple):  # (rows: this parser's output, or it read back as JSON)
        try:
            value = {row[0]: _as_table(row) for row in value}
        except (TypeError, IndexError, ValueError):
            raise InvalidValue("must be rows of (model, prefill, decode, own)") from None
    if not isinstance(value, Mapping):
        raise InvalidValue("must be a table of models, e.g. [models.llama-70b]")
    return tuple(sorted(_model(str(name), table) for name, table in value.items()))


def _as_table(row: Any) -> dict[str, Any]:
    name, prefill, decode, own = row
    if not isinstance(name, str):
        raise ValueError(name)
    return {"prefill": list(prefill), "decode": list(decode), **dict(own)}


def _model(name: str, given: object) -> ModelPools:
    where = f"model {name!r}: "
    if not name or any(char.isspace() or not char.isprintable() for char in name):
        raise InvalidValue(f"{where}a name is printable, without whitespace")
    if not isinstance(given, Mapping):
        raise InvalidValue(f"{where}must be a table of {', '.join(MODEL_KEYS)}")
    table = known_keys(given, where, tuple(MODEL_KEYS))
    members: dict[str, tuple[str, ...]] = {}
    for role in ("prefill", "decode"):
        listed = table.get(role, [])
        if isinstance(listed, str) or not isinstance(listed, list | tuple):
            raise InvalidValue(f"{where}{role} must be a list of URLs")
        members[role] = tuple(_parsed(name, role, MODEL_KEYS[role], url) for url in listed)
    own = tuple(
        sorted(
            (key, _parsed(name, key, MODEL_KEYS[key], table[key]))
            for key in MODEL_KEYS
            if key in table and key not in ("prefill", "decode")
        )
    )
    return ModelPools(name, members["prefill"], members["decode"], own)


def _parsed(model: str, key: str, parse: Any, value: object) -> Any:
    try:
        return parse(value)
    except InvalidValue as error:
        raise InvalidValue(f"model {model!r}: {key} {error}") from None
