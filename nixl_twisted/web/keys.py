"""``--api-key`` and ``--api-keys-file``: the keys clients must send, and whose each is.

A key travels as ``Authorization: Bearer KEY`` (the scheme in any case, as
RFC 9110 has it), or as ``x-api-key`` on the Messages routes (Anthropic's
header). Keys are held as SHA-256 digests and a presented key is looked up
by its digest, so the time a refusal takes says nothing of how close a guess
was (what a constant-time comparison is for), and no key stays in the clear.
The file holds one key per line, optionally followed by its tenant's name
(blank lines and ``#`` comments skipped); it is read again on SIGHUP and
when its bytes change (looked at every 2 s; ``keys_file`` says when a change
is whole enough to apply), and a file that cannot be used keeps the keys it
last gave. At start, one that cannot be used stops the proxy
(``run.startup.check_keys_file``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.web.http_headers import Headers

from nixl_twisted.config import ProxyConfig
from nixl_twisted.config.values import InvalidValue
from nixl_twisted.config.words import counted
from nixl_twisted.protocol import routes
from nixl_twisted.protocol.headers import bearer_token
from nixl_twisted.protocol.routes import speaks_anthropic
from nixl_twisted.web.keys_file import KeysFile

log = Logger()

#: Seconds between two looks at the keys file.
FILE_CHECK = 2.0


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class ClientKeys:
    """The keys clients must send now; none: every client is served.

    While the keys file cannot be used, the keys it last gave stay in effect
    and it is tried again at each look; what is wrong is logged when it
    changes (and on each reload), not at every look, and an info line says
    when the file is read again.
    """

    def __init__(self, clock: IReactorTime, config: ProxyConfig | None = None) -> None:
        """``config``: configured at once, as a reload configures it (``configure``)."""
        self.clock = clock
        self._given: Sequence[str] = ()
        self._file: KeysFile | None = None
        #: What the file gave when last read, as digests and tenants.
        self._from_file: dict[bytes, str] = {}
        #: Why the file could not be used, as last logged; None: it was read.
        self._problem: str | None = None
        self._digests: dict[bytes, str] = {}
        self._watch: LoopingCall | None = None
        if config is not None:
            self.configure(config)

    @property
    def required(self) -> bool:
        return bool(self._digests) or self._file is not None

    def configure(self, config: ProxyConfig) -> None:
        """The keys ``config`` gives, the file read at once (a reload, or SIGHUP without
        ``--config``, reads it again, and says again what is wrong with it)."""
        self._given = config.api_keys
        path = config.api_keys_file
        if path is None:
            self._file, self._from_file = None, {}
        elif self._file is None or self._file.path != path:
            self._file = KeysFile(path)
        self._problem = None
        self._apply(self._file.read_now if self._file is not None else None)
        if self._file is not None and self._watch is None:
            self._watch = LoopingCall(self._look)
            self._watch.clock = self.clock
            self._watch.start(FILE_CHECK, now=False)
        elif self._file is None and self._watch is not None:
            self.stop()

    def stop(self) -> None:
        if self._watch is not None and self._watch.running:
            self._watch.stop()
        self._watch = None

    def tenant(self, headers: Headers, path: bytes) -> str | None:
        """The tenant whose key the request carries, or None (refused)."""
        presented = bearer_token(headers.getRawHeaders(b"authorization", [None])[0])
        if presented is None and speaks_anthropic(path):
            presented = headers.getRawHeaders(b"x-api-key", [None])[0]
        if not presented:
            return None
        # Looked up by its digest: how long it takes says nothing of how much
        # of a key a guess got right (no byte-by-byte comparison of secrets).
        return self._digests.get(_digest(presented))

    def _look(self) -> None:
        if self._file is not None:
            self._apply(self._file.look)

    def _apply(self, read: Callable[[], dict[str, str | None] | None] | None) -> None:
        """The keys in effect, with what ``read`` gives of the file (None: no change)."""
        before, was_broken = self._digests, self._problem is not None
        try:
            keys = read() if read is not None else None
        except InvalidValue as error:
            self._cannot_use(str(error))
            keys = None
        else:
            # Unchanged and readable again (a chmod mended it): said below.
            if keys is None and self._file is not None and not self._file.waiting:
                self._problem = None
        if keys is not None:
            self._problem = None
            self._from_file = {
                _digest(key.encode("utf-8")): tenant or _fingerprint(key)
                for key, tenant in keys.items()
            }
        given = {_digest(key.encode("utf-8")): _fingerprint(key) for key in self._given}
        self._digests = given | self._from_file
        if self._problem is not None:
            return  # (logged when that is news)
        if was_broken and self._file is not None:
            log.info(
                "--api-keys-file {path} read again: {keys} in effect",
                path=self._file.path,
                count=len(self._digests),
                keys=counted(len(self._digests), "client key"),
            )
        elif before != self._digests:
            log.info("client keys: {count} in effect", count=len(self._digests))

    def _cannot_use(self, problem: str) -> None:
        """The file cannot be used: its keys stay; said when that is news."""
        if problem == self._problem:
            return
        self._problem = problem
        log.error(
            "--api-keys-file cannot be used: {error}; keeping {kept} until it can be read",
            path=self._file.path if self._file is not None else None,
            error=problem,
            kept=f"the {counted(len(self._from_file), 'key')} it gave"
            if self._from_file
            else "none of its keys",
        )


def _fingerprint(key: str) -> str:
    """A keyed client's tenant when the file names none: never the key itself."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]


def needs_key(path: bytes) -> bool:
    """Every client route does; health, metrics and the admin API (its own token) do not."""
    return path.split(b"?", 1)[0].decode("utf-8", "replace") not in routes.UNKEYED
