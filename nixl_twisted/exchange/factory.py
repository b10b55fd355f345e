"""Each completion's ``Exchange``, made from the request's own values: ``ExchangeFactory``."""

from __future__ import annotations

from nixl_twisted.config import ProxyConfig
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.request import ExchangeRequest
from nixl_twisted.exchange.responses import ResponseDirectory
from nixl_twisted.exchange.two_legs import Exchange
from nixl_twisted.observe.spans import NO_TRACE, RequestTrace
from nixl_twisted.protocol import lowering, routes


class ExchangeFactory:
    """Makes each completion's exchange; what is the proxy's, not the request's, it holds.

    Made once per proxy. ``config`` is replaced on a reload: an exchange
    takes the timeouts, retries and keys in effect when it is made.
    """

    def __init__(self, config: ProxyConfig, legs: Legs, responses: ResponseDirectory) -> None:
        self.config = config
        self.legs = legs
        #: Where each Responses API answer's decode instance is remembered.
        self.responses = responses

    def make(
        self,
        request: ExchangeRequest,
        path: str,
        body: lowering.JSONObject,
        request_id: str,
        trace: RequestTrace = NO_TRACE,
        model: str | None = None,
        hide_usage: bool = False,
    ) -> Exchange:
        """The exchange serving ``body`` to ``request``: a client's, or one prompt of a batch.

        ``model``: the one its instances must serve (``backends.models.resolve``);
        ``hide_usage``: ``body`` asked for usage the client did not (``Exchange``).
        """
        watch = self.responses.watcher if path == routes.RESPONSES else None
        return Exchange(
            self.legs, self.config, request, path, body, request_id, trace, watch, model, hide_usage
        )
