"""``--api-key`` and ``--api-keys-file``: the keys clients must send, and whose each is.

A key travels as ``Authorization: Bearer KEY`` (the scheme in any case, as
RFC 9110 has it), or as ``x-api-key`` on the Messages routes (Anthropic's
header). Keys are held as SHA-256 digests and a presented key is looked up
by its digest, so the time a refusal takes says nothing of how close a guess
was (what a constant-time comparison is for), and no key stays in the clear. The file holds one
key per line, optionally followed by its tenant's name (blank lines and
``#`` comments skipped); it is read again on SIGHUP and whenever its
modification time or size changes (looked at every 2 s), and a file that
cannot be read keeps the keys it last gave. At start, one that cannot be
read stops the proxy (``run.startup.check_keys_file``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.web.http_headers import Headers

from nixl_twisted.config import ProxyConfig
from nixl_twisted.config.tenants import client_key
from nixl_twisted.config.values import InvalidValue
from nixl_twisted.protocol import routes
from nixl_twisted.protocol.routes import speaks_anthropic
from nixl_twisted.web.admin import bearer_token

log = Logger()

#: Seconds between two looks at the keys file.
FILE_CHECK = 2.0


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def read_keys(path: str) -> dict[str, str | None]:
    """The keys of a keys file, each with its tenant's name (or None).

    Raises ``InvalidValue`` saying why the file cannot be used, naming it
    (and the line): one kind of error for the poll, a reload and the start.
    """
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.readlines()
    except OSError as error:
        raise InvalidValue(f"{path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise InvalidValue(f"{path}: not UTF-8 text") from None
    keys: dict[str, str | None] = {}
    for number, line in enumerate(lines, 1):
        words = line.split()
        # A comment is a word that starts with "#": a "#" inside a key is the key's.
        words = next((words[:at] for at, word in enumerate(words) if word.startswith("#")), words)
        if not words:
            continue
        if len(words) > 2:
            raise InvalidValue(f"{path}:{number}: a key, then at most a tenant's name")
        try:
            keys[client_key(words[0])] = words[1] if len(words) == 2 else None
        except InvalidValue as error:
            raise InvalidValue(f"{path}:{number}: the key {error}") from None
    return keys


class ClientKeys:
    """The keys clients must send now; none: every client is served.

    While the keys file cannot be read, the keys it last gave stay in effect
    and it is tried again at each look; what is wrong is logged when it
    changes (and on each reload), not at every look, and an info line says
    when the file is read again.
    """

    def __init__(self, clock: IReactorTime) -> None:
        self.clock = clock
        self._given: Sequence[str] = ()
        self._path: str | None = None
        #: The file's modification time and size when last read.
        self._seen: tuple[int, int] | None = None
        #: What the file gave when last read, as digests and tenants.
        self._from_file: dict[bytes, str] = {}
        #: Why the file could not be read, as last logged; None: it was read.
        self._problem: str | None = None
        self._digests: dict[bytes, str] = {}
        self._watch: LoopingCall | None = None

    @property
    def required(self) -> bool:
        return bool(self._digests) or self._path is not None

    def configure(self, config: ProxyConfig) -> None:
        """The keys ``config`` gives (the file read now: a reload reads it again,
        and says again what is wrong with it)."""
        self._given, self._path = config.api_keys, config.api_keys_file
        self._seen, self._problem = None, None
        self._load()
        if self._path is not None and self._watch is None:
            self._watch = LoopingCall(self._look)
            self._watch.clock = self.clock
            self._watch.start(FILE_CHECK, now=False)
        elif self._path is None and self._watch is not None:
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
        try:
            stat = os.stat(self._path) if self._path is not None else None
        except OSError:
            stat = None
        seen = (stat.st_mtime_ns, stat.st_size) if stat is not None else None
        # One that could not be read is tried at every look: a chmod that mends
        # it changes neither its modification time nor its size.
        if seen != self._seen or self._problem is not None:
            self._load()

    def _load(self) -> None:
        before, was_broken = len(self._digests), self._problem is not None
        if self._path is None:
            self._from_file = {}
        read = self._path is not None and self._read(self._path)
        given = {_digest(key.encode("utf-8")): _fingerprint(key) for key in self._given}
        self._digests = given | self._from_file
        if not read:
            return  # (no file, or one that cannot be read: logged when that is news)
        if was_broken:
            log.info(
                "--api-keys-file {path} read again: {count} client keys in effect",
                path=self._path,
                count=len(self._digests),
            )
        elif before != len(self._digests):
            log.info("client keys: {count} in effect", count=len(self._digests))

    def _read(self, path: str) -> bool:
        """The file read into ``_from_file``; False if it cannot be (logged when news)."""
        try:
            stat = os.stat(path)  # (before reading: a change meanwhile is read at the next look)
            keys = read_keys(path)
        except OSError as error:
            problem = f"{path}: {error.strerror or error}"
        except InvalidValue as error:
            problem = str(error)
        else:
            self._seen, self._problem = (stat.st_mtime_ns, stat.st_size), None
            self._from_file = {
                _digest(key.encode("utf-8")): tenant or _fingerprint(key)
                for key, tenant in keys.items()
            }
            return True
        if problem != self._problem:
            self._problem = problem
            log.error(
                "--api-keys-file cannot be used: {error}; {kept} in effect until it can be read",
                path=path,
                error=problem,
                kept=f"the {len(self._from_file)} keys it gave"
                if self._from_file
                else "none of its keys",
            )
        return False


def _fingerprint(key: str) -> str:
    """A keyed client's tenant when the file names none: never the key itself."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]


def needs_key(path: bytes) -> bool:
    """Every client route does; health, metrics and the admin API (its own token) do not."""
    return path.split(b"?", 1)[0].decode("utf-8", "replace") not in routes.UNKEYED
