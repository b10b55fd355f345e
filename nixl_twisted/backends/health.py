"""What an instance's outcomes make of it: the health rules, as Envoy has them.

- a new instance is ``PENDING`` until its first health check (or leg)
  answers, which decides at once; with health checks off it starts ``UP``;
- ``UP`` turns ``DOWN`` after ``unhealthy`` failures in a row (a refused
  connection, a timeout, a failed check): one slow request ejects nothing;
- ``DOWN`` turns ``UP`` after ``healthy`` successes in a row; past a backoff
  that doubles with each further failure, a down instance may get a trial
  leg, so that it can come back even with health checks off.

These functions only move an instance's state; ``BackendPool`` decides
whose outcomes they judge, logs the turns and tells whoever listens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from nixl_twisted.backends.outliers import OutlierRule
from nixl_twisted.config import Health
from nixl_twisted.config.settings import BY_NAME

BACKOFF_BASE = 1.0
BACKOFF_MAX = 30.0


class State(enum.Enum):
    PENDING = "pending"
    UP = "up"
    DOWN = "down"


@dataclass(frozen=True)
class Thresholds:
    """Outcomes in a row that turn an instance down, and back up; failed legs that eject it."""

    unhealthy: int
    healthy: int
    outliers: OutlierRule = field(default_factory=OutlierRule)

    @classmethod
    def of(cls, health: Health) -> Thresholds:
        outliers = OutlierRule(health.outlier_failures, health.outlier_seconds)
        return cls(health.unhealthy_threshold, health.healthy_threshold, outliers)


#: ``--unhealthy-threshold`` and ``--healthy-threshold`` as the settings table has them.
DEFAULT_THRESHOLDS = Thresholds(
    BY_NAME["unhealthy-threshold"].default, BY_NAME["healthy-threshold"].default
)


class Judged(Protocol):
    state: State
    failures: int
    successes: int
    retry_at: float
    last_error: str | None
    load: dict[str, float]
    models: dict[str, dict[str, Any]] | None
    recompute: float | None
    recompute_episodes: int


def failed(instance: Judged, reason: str, thresholds: Thresholds, now: float) -> bool:
    """Count a failure; True if the instance has just turned down."""
    instance.failures += 1
    instance.successes = 0
    instance.last_error = reason
    exponent = max(0, instance.failures - thresholds.unhealthy)
    instance.retry_at = now + min(BACKOFF_MAX, BACKOFF_BASE * 2**exponent)
    if instance.state is State.PENDING or (
        instance.state is State.UP and instance.failures >= thresholds.unhealthy
    ):
        instance.state = State.DOWN
        return True
    return False


def worth_judging(instance: Judged) -> bool:
    """A success says something only after failures, or before the instance is up."""
    return instance.state is not State.UP or instance.failures > 0


def succeeded(instance: Judged, thresholds: Thresholds) -> bool:
    """Count a success; True if the instance has just come back from down."""
    instance.failures = 0
    instance.successes += 1
    back = instance.state is State.DOWN and instance.successes >= thresholds.healthy
    if instance.state is State.PENDING or back:
        instance.state = State.UP
        instance.retry_at = 0.0
        instance.last_error = None
    return back


def adopt(instance: Judged, health: dict[str, Any]) -> bool:
    """Take the health a supervisor decided (``Instance.health``); True if the state changed."""
    was = instance.state
    instance.state = State(health["state"])
    instance.failures = int(health["failures"])
    instance.successes = int(health["successes"])
    instance.retry_at = float(health["retry_at"])
    instance.last_error = health["last_error"]
    instance.load = dict(health.get("load") or {})
    instance.recompute, instance.recompute_episodes = health.get("recompute") or (None, 0)
    models = health.get("models")
    instance.models = None if models is None else dict(models)
    return was is not instance.state
