"""``FirstContact``: whether a replica has reached Redis once since it started, and why not.

Until it has, a replica does not know the fleet: alone, it would hold each cap whole
(the cap over the one replica it knows), so that with a wrong URL or password the
engines would get up to twice their cap. It is not ready (``/health`` 503) and takes no
capped slot (its requests wait in its own queue) until Redis answers once. Each cause is
said once: a mistake in the URL (``redis_errors.fix_for``) as an error naming the fix,
anything that may pass by itself as a warning.
"""

from __future__ import annotations

from twisted.logger import Logger

from nixl_twisted.fleet.redis_errors import fix_for
from nixl_twisted.fleet.replies import shown

log = Logger()

#: What a replica that has not reached Redis does meanwhile, as the log says it.
_MEANWHILE = "this replica is not ready, and takes no capped slot, until it reaches Redis"


class FirstContact:
    """Whether Redis has answered this replica once, and the latest reason it has not."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.reached = False
        #: Why Redis has not answered yet, in words (None once it has).
        self.problem: str | None = None
        #: What was said: each fix, or each cause that had none.
        self._said: set[str] = set()
        self._fixes = False

    def failed(self, said: str) -> None:
        """Redis could not be used (``said``: how, in words), before it ever answered."""
        said = said.rstrip(". ")  # (Redis ends its errors with a stop; the line goes on)
        self.problem = said
        fix = fix_for(said, self.url)
        if (fix or said) in self._said or (fix is None and self._fixes):
            return  # (said already; or a mistake in the URL was, and this follows from it)
        self._said.add(fix or said)
        if fix is not None:
            self._fixes = True
            log.error(
                "replicas: Redis {url} {what}: {fix}; {meanwhile}",
                url=shown(self.url),
                what=said,
                fix=fix,
                meanwhile=_MEANWHILE,
            )
            return
        log.warn(
            "replicas: Redis {url} {what}; {meanwhile} (tried again every second)",
            url=shown(self.url),
            what=said,
            meanwhile=_MEANWHILE,
        )

    def made(self) -> None:
        """Redis answered: from now on, a failure is Redis away (the static share)."""
        self.reached = True
        self.problem = None
