"""``ReceivedRequest``: one request as a ``FakeVLLM`` saw it, for tests to assert on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twisted.web.http_headers import Headers

JSONObject = dict[str, Any]


@dataclass
class ReceivedRequest:
    """One request as the fake saw it (``carried_kv_transfer_params``: the body had the key)."""

    method: str
    path: str
    headers: Headers
    body: JSONObject | None
    role: str  # "prefill", "decode", "plain" or "other"
    query: bytes = b""

    @property
    def request_id(self) -> str | None:
        """The ``X-Request-Id`` header, as vLLM would use it."""
        values = self.headers.getRawHeaders(b"x-request-id")
        return values[0].decode("ascii") if values else None

    @property
    def authorization(self) -> str | None:
        values = self.headers.getRawHeaders(b"authorization")
        return values[0].decode("utf-8") if values else None

    @property
    def carried_kv_transfer_params(self) -> bool:
        """Whether the body had a ``kv_transfer_params`` key, whatever its value (``null`` too).

        A decode-only request must carry none: vLLM then computes the prompt itself.
        """
        return isinstance(self.body, dict) and "kv_transfer_params" in self.body

    @property
    def handed_token_ids(self) -> object:
        """``kv_transfer_params.prompt_token_ids`` as sent (None: none were handed)."""
        kv = self.body.get("kv_transfer_params") if isinstance(self.body, dict) else None
        return kv.get("prompt_token_ids") if isinstance(kv, dict) else None

    @property
    def connector_params(self) -> object:
        """``kv_transfer_params`` as vLLM's NIXL connector sees them: without the prompt's
        token ids, which vLLM takes out first (what the ledger redeems)."""
        kv = self.body.get("kv_transfer_params") if isinstance(self.body, dict) else None
        if not isinstance(kv, dict):
            return kv
        return {key: value for key, value in kv.items() if key != "prompt_token_ids"}
