"""The door: a client's request read once, into the value that serves it.

Every route that sends a leg comes in here first. The request's id is
settled (``headers.request_id_of``) and set on the answer before anything
can be refused, so that every answer has one; the body is read once
(``protocol.completion``), a 400 if the proxy cannot serve it; the model it
names is resolved against what the decode instances serve
(``backends.models.resolve``), a 404 (or 400) in the route's error shape
when none serves it, before anything is sent. Nothing below the door reads
the client's body again.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import partial

from twisted.web.server import Request

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.models import ModelRequired, UnknownModel, resolve
from nixl_twisted.observe.access import AccessRecord, record_of
from nixl_twisted.protocol import lowering
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.completion import Completion, Relayed, read_completion, read_relayed
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.headers import REQUEST_ID, request_id_of
from nixl_twisted.protocol.targets import TTFT_HEADERS, kept_as, ttft_target


def completion(
    request: Request,
    record: AccessRecord,
    path: str,
    max_batch_prompts: int,
    decode: Iterable[Instance],
    max_n: int = 128,
) -> Completion:
    """A two-leg route's request as a ``Completion``, routed to the model it names, with
    the first-token target its headers name; ``record``: its access record (the request's)."""
    request_id = request_id_of(request.requestHeaders)
    request.setHeader(REQUEST_ID, request_id.encode("ascii"))  # (every answer has one)
    record.request_id = request_id
    served = partial(served_model, decode=decode, record=record)
    body = client_body(request)
    # Looked up in Twisted's own table of the headers, without a call: a request that
    # names no first-token target costs what it did (``python -m bench.calls``).
    sent, target = request.requestHeaders._rawHeaders, None
    if _SLO in sent or _LLM_D in sent or _DYNAMO_META in sent or _DYNAMO in sent:
        target = record.ttft_target = ttft_target(request.requestHeaders)  # (400: a bad one)
    return read_completion(body, path, request_id, max_batch_prompts, served, max_n, target)


#: The headers that name a first-token target (``protocol.targets``), as Twisted keeps them.
_SLO, _LLM_D, _DYNAMO_META, _DYNAMO = map(kept_as, TTFT_HEADERS)


def relayed(
    request: Request, path: str, raw: bytes | None, decode: Iterable[Instance] | None = None
) -> Relayed:
    """A one-leg route's request as ``Relayed``, its JSON body ``raw`` (None: a GET), routed
    to the model that body names when ``decode`` says what is served (else to any: a
    stored response's routes, ``/v1/models`` relayed)."""
    record = record_of(request)
    request_id = request_id_of(request.requestHeaders)
    request.setHeader(REQUEST_ID, request_id.encode("ascii"))  # (every answer has one)
    record.request_id = request_id
    read = read_relayed(raw, path, request_id)
    if decode is None:
        return read
    return read.routed(served_model(read.model, decode, record))


#: A stored response's id as vLLM makes them (``resp_`` and a UUID's hex) and the proxy
#: records them: anything else names no stored response, and is never put in a backend's path.
_RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9_-]{1,128}")


def stored_response(response_id: str) -> None:
    """A 404 for an id that cannot be a stored response's, before any backend is asked."""
    if _RESPONSE_ID.fullmatch(response_id) is None:
        shown = lowering.printable(response_id, 140)
        raise ProxyError(ErrorCode.NOT_FOUND, f"No response found with id '{shown}'.")


def served_model(requested: object, decode: Iterable[Instance], record: AccessRecord) -> str | None:
    """The model to route on (``backends.models.resolve``); a ``ProxyError`` if none serves it.

    The model asked is the record's (its access line's); a model an
    instance is known to serve becomes its metric label.
    """
    if isinstance(requested, str):
        record.model = lowering.printable(requested)
    try:
        resolved = resolve(requested, decode)
    except UnknownModel as error:
        model = lowering.printable(error.model)
        raise ProxyError(
            ErrorCode.MODEL_NOT_FOUND, f"The model `{model}` does not exist."
        ) from None
    except ModelRequired as error:
        raise ProxyError(ErrorCode.MODEL_REQUIRED, str(error)) from None
    if resolved.known and resolved.model is not None:
        record.served_model = resolved.model
    return resolved.model


def client_body(request: Request) -> bytes:
    """The body the client sent (the site read it whole before the route was called)."""
    content = request.content
    if content is None:
        return b""
    content.seek(0)
    return bytes(content.read())
