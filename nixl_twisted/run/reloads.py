"""SIGHUP: the ``--config`` file read again (without one, the ``--api-keys-file``), and what
that says.

The proxy and the ``--workers`` supervisor reload alike (:func:`reloaded`)
and say it alike (:func:`said`): what changed, and, in one warning, what
could not; an operator reads the same lines whichever process took the
signal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from twisted.logger import Logger

from nixl_twisted.config import ConfigError, ProxyConfig
from nixl_twisted.config.settings import BY_NAME, SETTINGS
from nixl_twisted.config.sources import from_environment, read_file
from nixl_twisted.exchange import decide
from nixl_twisted.logs import lifecycle

log = Logger()


@dataclass(frozen=True)
class Reload:
    """A SIGHUP's outcome: the configuration that applies now, and what did not change."""

    config: ProxyConfig
    #: Settings whose new value applies now.
    changed: tuple[str, ...]
    #: Settings the file changed that take a restart: they keep their old value.
    need_restart: tuple[str, ...]
    #: Settings the file changed that the command line sets: the command line wins.
    overridden: tuple[str, ...]


def reloaded(config: ProxyConfig, environ: Mapping[str, str]) -> Reload:
    """What SIGHUP makes of ``config``: its ``--config`` file read again.

    Resolved as at startup (the command line over the file over the
    environment); each setting that can change live takes its new value, one
    that takes a restart keeps its old one and is named in
    ``Reload.need_restart``. Raises ``ConfigError`` (naming the file and key)
    when the file cannot be read or a value is not valid: nothing changes then.
    Without a ``--config`` file, ``config`` itself: applied again, it reads
    the ``--api-keys-file`` again (a key taken out of it is refused from then).
    """
    path = config.config_path
    if path is None:
        if config.api_keys_file is not None:
            return Reload(config, (), (), ())
        raise ConfigError("config", "there is no --config file to reload from")
    in_file = read_file(path)
    given = dict(config.command_line)
    values = {**in_file, **given}
    values.update(from_environment(values, environ))
    for role in ("prefill", "decode"):
        if role in in_file and not in_file[role] and not values.get(f"{role}-selector"):
            raise ConfigError(role, f"--config {path}: {role!r} must not be empty")
    now = ProxyConfig.from_settings(values, path, config.worker, given)
    old, new = config.settings(), now.settings()
    differs = [s.name for s in SETTINGS if old[s.name] != new[s.name]]
    restart = tuple(name for name in differs if not BY_NAME[name].live)
    kept = {name: old[name] for name in restart}
    merged = {k: v for k, v in {**new, **kept}.items() if v is not None}
    applied = ProxyConfig.from_settings(merged, path, config.worker, given)
    overridden = tuple(
        sorted(name for name in in_file if name in given and in_file[name] != given[name])
    )
    changed = tuple(name for name in differs if name not in restart)
    return Reload(applied, changed, restart, overridden)


def refused(error: ConfigError) -> None:
    """The file could not be used: nothing changed, and the proxy serves on as it was."""
    log.warn(
        "SIGHUP: nothing reloaded, every setting kept as it was ({key}): {error}",
        key=error.key,
        error=str(error),
    )


def said(reload: Reload, where: str = "") -> None:
    """The reload's outcome: one info line, and one warning for what it did not apply."""
    config = reload.config
    if config.config_path is None:
        lifecycle.info(
            "SIGHUP: no --config file; --api-keys-file {path} read again{where}",
            path=config.api_keys_file,
            where=where,
            reloaded=[],
        )
        return
    lifecycle.info(
        "SIGHUP: reloaded {path}{where}: {changed}",
        path=config.config_path,
        where=where,
        changed=("changed " + ", ".join(reload.changed)) if reload.changed else "nothing changed",
        reloaded=list(reload.changed),
    )
    if reload.need_restart or reload.overridden:
        parts = []
        if reload.need_restart:
            parts.append(
                "take a restart to change, kept as they were: " + ", ".join(reload.need_restart)
            )
        if reload.overridden:
            parts.append(
                "set on the command line, which wins over the file: " + ", ".join(reload.overridden)
            )
        log.warn(
            "SIGHUP: settings not applied: {parts}",
            parts="; ".join(parts),
            need_restart=list(reload.need_restart),
            overridden=list(reload.overridden),
        )
    blind = decide.blind_rules(
        config.disaggregation, config.kv_events.read_for("decode", config.pools.decode)
    )
    if blind is not None and "decode-only-uncached-below" in reload.changed:
        log.warn("SIGHUP: {blind}", blind=blind)
