"""Which model a client request is for, as the fleet serves them: 404 and 400 otherwise.

``nixl_twisted.backends.models`` knows what each instance serves; here a
request's ``model`` is checked against it, and refused in the route's error
shape (OpenAI's, or Anthropic's on ``/v1/messages``) before anything is sent.
"""

from __future__ import annotations

import json
from typing import Any

from nixl_twisted.backends.models import ModelRequired, Resolved, UnknownModel, resolve
from nixl_twisted.backends.service import BackendService
from nixl_twisted.observe.access import AccessRecord
from nixl_twisted.protocol import lowering
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError


def routed_model(backends: BackendService, requested: object, record: AccessRecord) -> Resolved:
    """The model to route on (``backends.models.resolve``); a ``ProxyError`` if none serves it.

    A model an instance is known to serve becomes the record's metric label.
    """
    try:
        resolved = resolve(requested, backends.decode.instances)
    except UnknownModel as error:
        model = lowering.printable(error.model)
        raise ProxyError(
            ErrorCode.MODEL_NOT_FOUND, f"The model `{model}` does not exist."
        ) from None
    except ModelRequired as error:
        raise ProxyError(ErrorCode.MODEL_REQUIRED, str(error)) from None
    if resolved.known and resolved.model is not None:
        record.served_model = resolved.model
    return resolved


def requested_model(body: bytes | None) -> Any:
    """A one-leg route's ``model``, when its body is a JSON object (else vLLM's to judge)."""
    if not body:
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed.get("model") if isinstance(parsed, dict) else None
