"""Which models the backends serve, and which instances may serve a request's ``model``.

An instance serves what its ``GET /v1/models`` says (read by the health
checks: base models and LoRA adapters alike). Until it has said, it serves
what ``[models.NAME]`` lists it under, and an instance no table lists
serves anything: with health checks off, or an instance that cannot answer
``/v1/models``, any instance may take any model's request.
An instance listed under a model its answer does not name takes none of
that model's requests (vLLM would refuse them): it is logged, and
``/healthcheck`` shows it (``not_serving``). A model is unknown (404) only
when every decode instance's models are known and none serves it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, NamedTuple

from twisted.logger import Logger

from nixl_twisted.backends.instances import Instance
from nixl_twisted.config.values import backend_url, discovered_by, instance_url, rank_urls

log = Logger()


class UnknownModel(Exception):
    """No decode instance serves the request's ``model``."""

    def __init__(self, model: str) -> None:
        super().__init__(f"the model {model!r} is not served here")
        self.model = model


class ModelRequired(Exception):
    """The request names no ``model`` while several are served."""

    def __init__(self, served: Iterable[str]) -> None:
        names = ", ".join(sorted(served))
        super().__init__(f"the request must name its model: this proxy serves {names}")


def read_models(body: bytes) -> dict[str, dict[str, Any]]:
    """vLLM's ``/v1/models`` answer as each model's card by id (ValueError: not one)."""
    answer = json.loads(body)
    cards = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(cards, list):
        raise ValueError("no list of models in the answer")
    return {
        card["id"]: card
        for card in cards
        if isinstance(card, dict) and isinstance(card.get("id"), str)
    }


def said_models(instance: Instance, models: dict[str, dict[str, Any]]) -> bool:
    """``models`` as the instance's own list; whether that changed its list (logged,
    and so is a model a table lists it under that it does not serve)."""
    said = instance.models
    if said is not None and set(models) == set(said):  # (vLLM's cards say "created": now)
        return False
    if said is not None or len(models) > 1:
        log.info("{url} serves {models}", url=instance.url, models=", ".join(models))
    instance.models = models
    if instance.not_serving:
        log.warn(
            "{url} is listed under [models.{listed}] but serves {models}: "
            "it takes no {listed} requests",
            url=instance.url,
            listed=", ".join(instance.not_serving),
            models=", ".join(models) or "nothing",
        )
    return True


def _known(instance: Instance) -> set[str] | None:
    """The models an instance is known to serve; None: anything (never read, never named)."""
    if instance.models is not None:
        return set(instance.models)
    return set(instance.named) if instance.named else None


class Resolved(NamedTuple):
    """The model a request is routed on (None: any instance will do), and whether an
    instance is known to serve it (its name is then a bounded metric label)."""

    model: str | None
    known: bool


#: A request routed to any instance: no instance has said what it serves.
ANY_MODEL = Resolved(None, False)


def resolve(requested: object, decode: Iterable[Instance]) -> Resolved:
    """The model to route a request on, from its ``model`` and the decode instances'.

    Raises ``UnknownModel`` for a model no decode instance serves, and
    ``ModelRequired`` for a request without one while several are served.
    A ``model`` that is not a string is vLLM's to refuse.
    """
    live = [instance for instance in decode if not instance.draining]
    if requested is None:
        served = {model for instance in live for model in _known(instance) or ()}
        if len(served) > 1:
            raise ModelRequired(served)
        return ANY_MODEL  # (one model, or none known: as vLLM's default model serves it)
    if not isinstance(requested, str):
        return ANY_MODEL
    # (Looked up, not gathered: this runs for every request that names its model.)
    unread = said = False
    for instance in live:
        if instance.models is None and not instance.named:
            unread = True
        elif instance.serves(requested):
            return Resolved(requested, True)
        else:
            said = True
    if not said:
        return ANY_MODEL  # (nothing known: any instance may take it)
    if not unread:
        raise UnknownModel(requested)
    return Resolved(requested, False)  # (only an instance that never said may serve it)


def named(model: str, decode: Iterable[Instance]) -> bool:
    """Whether a decode instance is known to serve ``model``: its ``/v1/models`` says so, or
    a table lists it under it (a name only a client gave is not one: ``--replicas-redis``
    makes no key of it)."""
    return any(
        model in instance.models if instance.models is not None else model in instance.named
        for instance in decode
    )


def context_length(model: object, decode: Iterable[Instance]) -> int | None:
    """The most tokens one sequence of ``model`` may hold (prompt and completion), as the
    decode instances' cards say (vLLM's ``max_model_len``; an adapter's is its
    ``parent``'s); the largest any instance says, for the instance a request
    lands on may be that one.

    A model no card describes (or None, or not a string) gets the largest any
    card says; None when no card says one.
    """
    named: int | None = None
    largest: int | None = None
    for instance in decode:
        cards = instance.models
        if instance.draining or not cards:
            continue
        for card in cards.values():
            said = _max_model_len(card, cards)
            if said is not None and (largest is None or said > largest):
                largest = said
        asked = cards.get(model) if isinstance(model, str) else None
        said = None if asked is None else _max_model_len(asked, cards)
        if said is not None and (named is None or said > named):
            named = said
    return named if named is not None else largest


def _max_model_len(card: dict[str, Any], cards: dict[str, dict[str, Any]]) -> int | None:
    said = card.get("max_model_len")
    if said is None and isinstance(card.get("parent"), str):
        said = cards.get(card["parent"], {}).get("max_model_len")  # (a LoRA adapter's)
    return said if type(said) is int and said > 0 else None


def listing(decode: Iterable[Instance]) -> dict[str, Any] | None:
    """``GET /v1/models``' answer: each model the healthy decode instances serve, once.

    None when none of them has said (the route then asks one of them).
    """
    cards: dict[str, dict[str, Any]] = {}
    named: set[str] = set()
    said = False
    for instance in decode:
        if instance.draining or not instance.healthy:
            continue
        if instance.models is not None:
            said = True
            for model, card in instance.models.items():
                cards.setdefault(model, card)
        elif instance.named:  # (until it says what it serves)
            said = True
            named |= instance.named
    for model in sorted(named):  # (vLLM's own card first, when one said it)
        cards.setdefault(model, {"id": model, "object": "model", "owned_by": "vllm"})
    if not said:
        return None
    return {"object": "list", "data": [cards[model] for model in sorted(cards)]}


def named_by_instance(named: dict[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    """``Pools.named`` keyed as instances are: each rank's URL (and each DNS name as is)."""
    keyed = dict(named)
    for member, models in named.items():
        if discovered_by(member) is None:
            for rank in rank_urls(member):
                keyed[instance_url(backend_url(rank))] = models
    return keyed


def name_instances(instances: Iterable[Instance], named: dict[str, frozenset[str]]) -> None:
    """Each instance's ``named`` models: its URL's and its discovery sources'."""
    for instance in instances:
        names = set(named.get(instance.url, ()))
        for source in instance.sources:
            names |= named.get(source, frozenset())
        instance.named = frozenset(names)
