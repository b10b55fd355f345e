"""``twistd nixlproxy``: the option table, and the service tree it asks for.

``Options`` is generated from ``nixl_twisted.config.settings`` and turns what was
typed into a ``ProxyConfig`` (``nixl_twisted.config.resolve``); it builds
nothing live. ``makeService`` hands that value to the composition root
(``nixl_twisted.run.root.build``) or, for ``--workers``, to the supervisor.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from twisted.application.service import IService
from twisted.python import usage

from nixl_twisted import __version__, identity, logs
from nixl_twisted.config import ConfigError, ProxyConfig, help, resolve
from nixl_twisted.config.settings import BACKEND_API_KEY_ENV, BY_NAME, SETTINGS, default_text
from nixl_twisted.config.spelling import did_you_mean
from nixl_twisted.run import needs, startup
from nixl_twisted.run.root import build
from nixl_twisted.run.tree import Logging
from nixl_twisted.run.workers import supervise


def _help(name: str) -> str:
    """A setting's help with its default, as ``docs/configuration.md`` shows it."""
    setting = BY_NAME[name]
    shown = default_text(setting)
    if shown == "(none)":
        return setting.help
    if shown == "(required)":
        return f"{setting.help} [required]"
    return f"{setting.help} [default: {shown}]"


class Options(usage.Options):
    """Command-line options of ``twistd nixlproxy``."""

    synopsis = "[options] --prefill URL [--prefill URL ...] --decode URL [--decode URL ...]"
    longdesc = (
        "A proxy for vLLM disaggregated serving: each completion is sent, "
        "lowered, to a prefill instance, then with the prefill's "
        "kv_transfer_params to a decode instance whose answer is streamed back. "
        f"Identity: {identity.ID} version {identity.VERSION}. The backend API key "
        f"may also be given in the {BACKEND_API_KEY_ENV} environment variable."
    )

    # No defaults here: an option left out stays None, so that the file's
    # value (or the setting's default) applies; --help shows the default.
    optParameters: list[Any] = [
        [s.name, None, None, _help(s.name)] for s in SETTINGS if not s.many
    ] + [
        [
            "config",
            None,
            None,
            "A TOML file with any of these options by their long names; "
            "the command line overrides it; SIGHUP reloads it (what can change live).",
        ],
        [
            "worker",
            None,
            None,
            "(internal) Run as worker N of --workers; the "
            "configuration arrives as JSON on standard input.",
        ],
    ]

    def __init__(self) -> None:
        super().__init__()
        for setting in SETTINGS:
            if setting.many:
                self[setting.name] = []
        #: The configuration, once the options are parsed.
        self.config: ProxyConfig | None = None

    def opt_listen(self, endpoint: str) -> None:
        self["listen"].append(endpoint)

    def opt_prefill(self, url: str) -> None:
        self["prefill"].append(url)

    def opt_decode(self, url: str) -> None:
        self["decode"].append(url)

    def opt_allowed_backends(self, allowed: str) -> None:
        self["allowed-backends"].append(allowed)

    def opt_api_key(self, key: str) -> None:
        self["api-key"].append(key)

    def opt_forward_header(self, name: str) -> None:
        self["forward-header"].append(name)

    opt_listen.__doc__ = _help("listen")
    opt_prefill.__doc__ = _help("prefill")
    opt_decode.__doc__ = _help("decode")
    opt_allowed_backends.__doc__ = _help("allowed-backends")
    opt_api_key.__doc__ = _help("api-key")
    opt_forward_header.__doc__ = _help("forward-header")

    def opt_version(self) -> None:
        """Print the package's version and the protocol identity, then exit."""
        print(f"nixl-twisted {__version__} (protocol {identity.ID} version {identity.VERSION})")
        raise SystemExit(0)

    def full_help(self, width: int = 80) -> str:
        """Every option, its help and default, by group, with examples: what --help prints."""
        return help.render(self.longdesc, self.docs, width)

    def opt_help(self) -> None:
        """Print this help and exit."""
        try:
            print(self.full_help(), flush=True)
        except BrokenPipeError:  # (--help | head): the reader had enough
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)

    def getUsage(self, width: int | None = None) -> str:
        """What twistd prints before a usage error: the synopsis and a hint, not 80 lines."""
        return f"    nixlproxy {self.synopsis}\nThe options: twistd nixlproxy --help\n"

    def parseOptions(self, options: list[str] | None = None) -> None:
        """As ``usage.Options`` parses, with the option a mistyped one most likely meant."""
        try:
            super().parseOptions(options)
        except usage.UsageError as error:
            unknown = re.fullmatch(r"option --(\S+) not recognized", str(error))
            if unknown is None:
                raise
            names = [name.rstrip("=") for name in self.longOpt]
            hint = did_you_mean(unknown[1], names, lambda name: f"--{name}")
            raise usage.UsageError(f"{error}{hint}") from None

    def postOptions(self) -> None:
        try:
            if self["worker"] is not None:
                self.config = ProxyConfig.from_json(_first_line(0))
                return
            given = {
                s.name: self[s.name]
                for s in SETTINGS
                if self[s.name] is not None and self[s.name] != []
            }
            self.config = resolve(given, self["config"], os.environ)
        except ConfigError as error:
            raise usage.UsageError(str(error)) from None
        lacking = needs.missing(self.config, os.environ)
        if lacking is not None:
            raise usage.UsageError(lacking)


def _first_line(fd: int) -> str:
    """One line from ``fd``, read a byte at a time: what follows it is not ours to buffer.

    (A worker's standard input then carries its supervisor's messages.)
    """
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return line.decode("utf-8")


def makeService(options: Options) -> IService:
    """The service tree ``twistd nixlproxy`` runs, built for the global reactor."""
    from twisted.internet import reactor

    config = options.config
    assert config is not None, "Options.parseOptions makes the configuration"
    startup.preload()  # twistd calls this before it sheds --uid/--gid
    startup.check_discovery(config, os.environ)
    startup.check_keys_file(config)
    startup.check_salt_secret(config)
    twistd_options = getattr(options, "parent", None)
    levels = logs.LogLevels(config.log_level)
    observer = logs.observer(
        config.log_format,
        levels,
        config.worker,
        lambda: logs.log_file(twistd_options),
        reactor,
    )
    # (twistd's own observer, for syslog or an operator's --logger: no filter to change)
    logging = Logging(observer, levels) if observer is not None else None
    if config.workers > 1:
        return supervise(config, reactor, logging=logging)
    return build(config, reactor, logging=logging)
