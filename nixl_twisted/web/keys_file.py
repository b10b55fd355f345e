"""``--api-keys-file``: what the file says, and when a change to it is whole enough to apply.

A file is whole when it is empty or its last line ends in a newline: one cut
off mid-line (a writer still writing, or one that died) is never loaded as
it is. A change the 2 s look finds is applied only when the next look reads
the same bytes, so a writer still writing between two lines is not loaded
part-way either. The bytes are compared, not the modification time and size:
a rewrite within the same second, to the same size, is seen. Renaming a
whole new file into place (``mv keys.new keys``) is the way to rewrite it
(``docs/security.md``): nothing reads it half-done.
"""

from __future__ import annotations

from nixl_twisted.config.tenants import client_key
from nixl_twisted.config.values import InvalidValue


def content_of(path: str) -> bytes:
    """The file's bytes; ``InvalidValue`` naming it when it cannot be read."""
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as error:
        raise InvalidValue(f"{path}: {error.strerror or error}") from None


def parse_keys(path: str, content: bytes) -> dict[str, str | None]:
    """The keys of a keys file's ``content``, each with its tenant's name (or None).

    Raises ``InvalidValue`` saying why the file cannot be used, naming it
    (and the line): one kind of error for the look, a reload and the start.
    """
    if content and not content.endswith(b"\n"):
        raise InvalidValue(
            f"{path}: its last line does not end in a newline (a file still being written?); "
            "write it whole, then rename it into place"
        )
    try:
        lines = content.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise InvalidValue(f"{path}: not UTF-8 text") from None
    keys: dict[str, str | None] = {}
    listed: dict[str, int] = {}  # each key's line
    for number, line in enumerate(lines, 1):
        words = line.split()
        # A comment is a word that starts with "#": a "#" inside a key is the key's.
        words = next((words[:at] for at, word in enumerate(words) if word.startswith("#")), words)
        if not words:
            continue
        if len(words) > 2:
            raise InvalidValue(f"{path}:{number}: a key, then at most a tenant's name")
        try:
            key = client_key(words[0])
        except InvalidValue as error:
            raise InvalidValue(f"{path}:{number}: the key {error}") from None
        tenant = words[1] if len(words) == 2 else None
        _check_not_a_slip(path, number, key, tenant, keys, listed)
        keys[key], listed[key] = tenant, number
    return keys


def _check_not_a_slip(
    path: str,
    number: int,
    key: str,
    tenant: str | None,
    keys: dict[str, str | None],
    listed: dict[str, int],
) -> None:
    """Refuse a line that reads as a mistake rather than guess what it meant: a comma
    in a key (``sk-b1,team-b``: a key and its tenant are apart by whitespace; keys in
    ``NIXLPROXY_API_KEYS`` are comma-separated, so none holds one), and a key listed
    again under another tenant (which one would it be charged to?). The key itself is
    never in the message: it goes to the log."""
    if "," in key:
        raise InvalidValue(
            f"{path}:{number}: a comma in the key: write the key, a space, then its "
            "tenant's name (one key a line)"
        )
    if key in keys and keys[key] != tenant:
        first, second = (_tenant(keys[key]), _tenant(tenant))
        raise InvalidValue(
            f"{path}:{number}: this key is on line {listed[key]} already, under {first}; "
            f"here under {second}: give each key once"
        )


def _tenant(name: str | None) -> str:
    return f"tenant {name!r}" if name is not None else "no tenant"


def read_keys(path: str) -> dict[str, str | None]:
    """The keys of the file at ``path`` now (``parse_keys``)."""
    return parse_keys(path, content_of(path))


class KeysFile:
    """One keys file: the bytes whose keys are in effect, and a change waiting to be read again."""

    def __init__(self, path: str) -> None:
        self.path = path
        #: The bytes whose keys are in effect; None: none read yet.
        self._applied: bytes | None = None
        #: Bytes a look found that differ from those applied, to apply if the next look agrees.
        self._seen: bytes | None = None

    @property
    def waiting(self) -> bool:
        """A change was seen once and waits for the next look to agree."""
        return self._seen is not None

    def read_now(self) -> dict[str, str | None]:
        """Its keys at once (at start, on a reload, on SIGHUP: whoever asks knows it is
        written); ``InvalidValue`` if it cannot be used, and nothing changes."""
        content = content_of(self.path)
        keys = parse_keys(self.path, content)
        self._applied, self._seen = content, None
        return keys

    def look(self) -> dict[str, str | None] | None:
        """Its keys, when they changed and two looks in a row read the same bytes; else None.

        ``InvalidValue`` when it cannot be read, or when the bytes two looks
        agree on cannot be used: the keys in effect stay.
        """
        content = content_of(self.path)
        if content == self._applied:
            self._seen = None  # (a change undone before it was applied)
            return None
        if content != self._seen:
            self._seen = content
            return None
        keys = parse_keys(self.path, content)
        self._applied, self._seen = content, None
        return keys
