"""Per-tenant limits: requests in flight, requests and tokens per minute.

A request's tenant is its client key's (``--api-keys-file``'s name, or a
fingerprint of the key), else the ``--tenant-header``'s value; a request
with neither has no tenant and only ``--max-in-flight`` holds it. Past a
limit the answer is 429 ``rate_limit_exceeded`` with ``Retry-After`` (503
means the fleet, not the client). Minutes are 60 s sliding windows. Tokens
are prompt plus completion as vLLM reports them in the usage of its answer
(streams included); until a request ends it counts its estimate (its
prompts and the most its completions may generate, ``protocol.charges``),
and a tenant with nothing in its window is let through whatever the
estimate, so that one large request is slow, not impossible.

Counted in each process: under ``--workers N`` each worker holds every
tenant to the limits, so a tenant may get up to N times them, unless
``--limits-redis`` counts the requests and tokens per minute of every
process (``windows``), and ``--replicas-redis`` its requests in flight over every
replica (``shared_tenants``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from nixl_twisted.config import NO_RULE, ProxyConfig, TenantRule, TenantsConfig, words
from nixl_twisted.config.values import InvalidValue
from nixl_twisted.protocol import salts
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError

log = Logger()

WINDOW = 60.0
#: The bytes a salt secret may hold: at least 16 (128 bits, not guessed), at most 4 KiB.
MIN_SECRET = 16
MAX_SECRET = 4096
#: The longest tenant name kept (a header's value is the client's to choose).
MAX_NAME = 128


@dataclass
class _Usage:
    in_flight: int = 0
    started: deque[float] = field(default_factory=deque)
    #: (when, tokens) of requests that ended, and the estimates of those in flight.
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    estimated: int = 0
    #: The tokens in ``tokens``, kept as entries come and go (not summed at each admission).
    charged: int = 0
    #: When its requests were refused (429), for the status page.
    refused: deque[float] = field(default_factory=deque)

    def charge(self, when: float, tokens: int) -> None:
        self.tokens.append((when, tokens))
        self.charged += tokens

    def forget_before(self, when: float) -> None:
        while self.started and self.started[0] <= when:
            self.started.popleft()
        while self.tokens and self.tokens[0][0] <= when:
            self.charged -= self.tokens.popleft()[1]
        while self.refused and self.refused[0] <= when:
            self.refused.popleft()

    @property
    def idle(self) -> bool:
        return not (self.in_flight or self.started or self.tokens or self.refused)


class TenantHold:
    """A request admitted for a tenant: given back once, with the tokens it used."""

    def __init__(self, release: Callable[[int | None], None]) -> None:
        self._release: Callable[[int | None], None] | None = release

    def release(self, tokens: int | None) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release(tokens)


NO_HOLD = TenantHold(lambda tokens: None)


class TenantLimits:
    """Each tenant's use now, held to its rule."""

    def __init__(self, clock: IReactorTime, config: ProxyConfig | None = None) -> None:
        """``config``: configured at once, as a reload configures it (``configure``)."""
        self.clock = clock
        self.header: bytes | None = None
        self.default = NO_RULE
        self.rules: dict[str, TenantRule] = {}
        #: The secret each tenant's ``cache_salt`` is derived from (None: none).
        self.salt_secret: bytes | None = None
        self._use: dict[str, _Usage] = {}
        self._swept = 0.0
        if config is not None:
            self.configure(config)

    def configure(self, config: ProxyConfig) -> None:
        tenants: TenantsConfig = config.tenants
        self.header = tenants.header.encode("ascii") if tenants.header else None
        default = self.default = TenantRule(
            tenants.max_in_flight,
            tenants.requests_per_minute,
            tenants.tokens_per_minute,
            tenants.priority,
        )
        self.rules = {row.name: default.under(row) for row in tenants.table}
        path = tenants.salt_secret_file
        if path is None:
            self.salt_secret = None
        else:
            try:
                self.salt_secret = read_secret(path)
            except InvalidValue as error:  # (checked at start: a reload keeps the one it had)
                log.warn("--tenant-salt-secret-file: {error}; kept the last", error=error)

    def rule(self, tenant: str) -> TenantRule:
        """``tenant``'s rule, with its ``cache_salt``: its own, else derived from its name."""
        name = tenant[:MAX_NAME]
        rule = self.rules.get(name, self.default)
        if rule.cache_salt is None and self.salt_secret is not None:
            return replace(rule, cache_salt=salts.derived(self.salt_secret, name))
        return rule

    def limits(self, tenant: str) -> bool:
        """Whether ``tenant`` has any limit to be held to."""
        return self.rule(tenant).counted

    def admit(
        self,
        tenant: str | None,
        estimate: int | None,
        windows: bool = True,
        in_flight: bool = True,
    ) -> TenantHold:
        """Count a request for ``tenant``; a ``ProxyError`` (429) past one of its limits.

        ``estimate`` None: a request that generates nothing (models, tokenize, a stored
        response), held to the in-flight and requests limits only, and charged no tokens.
        ``windows`` False: requests and tokens per minute are counted elsewhere (Redis,
        ``windows``), in flight only here. ``in_flight`` False: its requests in
        flight are held to their limit elsewhere (every replica's, ``shared_tenants``),
        counted here all the same.
        """
        if tenant is None:
            return NO_HOLD
        tenant = tenant[:MAX_NAME]
        rule = self.rule(tenant)
        if not rule.counted:
            return NO_HOLD
        now = self.clock.seconds()
        if now - self._swept >= WINDOW:  # (tenants seen once, by header, are not kept)
            self._sweep(now)
        use = self._use.setdefault(tenant, _Usage())
        use.forget_before(now - WINDOW)
        rpm = rule.requests_per_minute if windows else 0
        if in_flight and rule.max_in_flight and use.in_flight >= rule.max_in_flight:
            raise self.refused(
                tenant, f"{words.counted(rule.max_in_flight, 'request')} in flight", 1.0
            )
        if rpm and len(use.started) >= rpm:
            wait = use.started[0] + WINDOW - now
            raise self.refused(tenant, f"{words.counted(rpm, 'request')} per minute", wait)
        counted = windows and rule.tokens_per_minute and estimate is not None
        used = use.charged + use.estimated
        if counted and used and used + (estimate or 0) > rule.tokens_per_minute:
            wait = (use.tokens[0][0] + WINDOW - now) if use.tokens else 1.0
            raise self.refused(
                tenant, f"{words.counted(rule.tokens_per_minute, 'token')} per minute", wait
            )
        held = estimate if counted and estimate is not None else 0
        use.in_flight += 1
        use.estimated += held
        if rpm:
            use.started.append(now)

        def release(tokens: int | None) -> None:
            use.in_flight -= 1
            use.estimated -= held
            if counted:
                use.charge(self.clock.seconds(), held if tokens is None else tokens)
            if use.idle:
                self._use.pop(tenant, None)

        return TenantHold(release)

    def in_flight(self, tenant: str) -> int:
        """``tenant``'s requests in flight in this process now."""
        use = self._use.get(tenant[:MAX_NAME])
        return use.in_flight if use is not None else 0

    def refused(self, tenant: str, limit: str, wait: float) -> ProxyError:
        """The 429 of ``tenant`` at ``limit`` (``refusal``), its time kept for the status page."""
        use = self._use.setdefault(tenant[:MAX_NAME], _Usage())
        use.refused.append(self.clock.seconds())
        return refusal(tenant, limit, wait)

    def usage(self, windows: bool = True, most: int = 100) -> list[dict[str, Any]]:
        """Each tenant with a limit that was seen in the last minute, and each one named in
        ``[tenants.NAME]``, against its limits (0: none); at most ``most``, the busiest.

        ``windows`` False: requests and tokens per minute are counted in Redis
        (``--limits-redis``), not here: they are None.
        """
        now = self.clock.seconds()
        said: list[dict[str, Any]] = []
        for tenant in set(self._use) | set(self.rules):
            use = self._use.get(tenant) or _Usage()
            use.forget_before(now - WINDOW)
            if use.idle and tenant not in self.rules:
                self._use.pop(tenant, None)  # (seen, then nothing for a minute: gone)
                continue
            rule = self.rule(tenant)
            said.append(
                {
                    "tenant": tenant,
                    "in_flight": use.in_flight,
                    "max_in_flight": rule.max_in_flight,
                    "requests_last_minute": (
                        len(use.started) if windows and rule.requests_per_minute else None
                    ),
                    "requests_per_minute": rule.requests_per_minute,
                    "tokens_last_minute": (
                        use.charged + use.estimated if windows and rule.tokens_per_minute else None
                    ),
                    "tokens_per_minute": rule.tokens_per_minute,
                    "refused_last_minute": len(use.refused),
                }
            )
        said.sort(key=lambda t: (-t["in_flight"], -t["refused_last_minute"], t["tenant"]))
        return said[:most]

    def _sweep(self, now: float) -> None:
        self._swept = now
        for tenant, use in list(self._use.items()):
            use.forget_before(now - WINDOW)
            if use.idle:
                del self._use[tenant]


def read_secret(path: str) -> bytes:
    """``--tenant-salt-secret-file``'s secret: the file's bytes, surrounding whitespace
    left out; an ``InvalidValue`` for a file that cannot be read or holds under 16 bytes."""
    try:
        with open(path, "rb") as file:
            secret = file.read(MAX_SECRET + 1).strip()
    except OSError as error:
        raise InvalidValue(f"{path} cannot be read: {error.strerror or error}") from None
    if not MIN_SECRET <= len(secret) <= MAX_SECRET:
        raise InvalidValue(
            f"{path} must hold a secret of {MIN_SECRET} to {MAX_SECRET} bytes, not {len(secret)}"
        )
    return secret


def refusal(tenant: str, limit: str, wait: float) -> ProxyError:
    """The 429 of a tenant at ``limit``, to try again in ``wait`` seconds."""
    return ProxyError(
        ErrorCode.TENANT_LIMIT,
        f"tenant {tenant!r} is at its limit of {limit}; try again in {math.ceil(wait)} s",
        retry_after=max(1.0, wait),
    )
