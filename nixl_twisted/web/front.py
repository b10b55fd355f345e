"""``FrontDoor``: what is refused before Klein routes a request, as the route's JSON error.

Klein would answer these with a plain-text 400 and a traceback in the log
(a URL that is not UTF-8), or Twisted with an HTML ``500 Processing Failed``
(a Host that Werkzeug cannot bind a URL map to): client garbage is neither
the operator's error nor a 5xx. HTTP/1.1 requires exactly one ``Host``
(RFC 9112 section 3.2): none, or two, is a 400 too; so are two different
values of a header that says who the client is (``headers.conflicting``), and
a path with a dot segment or an encoded ``?`` or ``#`` (a backend would read
another path, or a query, than the one routed). Methods are case-sensitive
(RFC 9110 section 9.1): ``post`` is not ``POST``, which Werkzeug would route
it as; it is a 405 naming the methods the route serves.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from urllib.parse import unquote_to_bytes

from twisted.python.components import Componentized
from twisted.web.iweb import IRequest
from twisted.web.resource import IResource, Resource
from werkzeug.exceptions import BadHost
from zope.interface import Interface, implementer

from nixl_twisted.protocol import routes
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError, json_answer
from nixl_twisted.protocol.headers import IDENTITY, conflicting, said_twice

#: ``uri-host [":" port]`` (RFC 3986 section 3.2.2): an IP literal, or a
#: reg-name (IPv4 included) of unreserved, percent-encoded and sub-delim
#: characters, each dot-separated label 1 to 63 of them.
_HOST = re.compile(
    r"(?:\[[0-9A-Fa-f:.]+\]|(?:[A-Za-z0-9\-_~!$&'()*+,;=]|%[0-9A-Fa-f]{2}){1,63}"
    r"(?:\.(?:[A-Za-z0-9\-_~!$&'()*+,;=]|%[0-9A-Fa-f]{2}){1,63})*\.?)?(?::[0-9]{0,5})?"
)


def host_problem(request: IRequest) -> str | None:
    """Why the request's ``Host`` cannot be served, or None."""
    hosts = request.requestHeaders.getRawHeaders(b"host") or []
    if len(hosts) > 1:
        return "the request has more than one Host header"
    if not hosts:
        if request.clientproto == b"HTTP/1.1":  # type: ignore[attr-defined]
            return "an HTTP/1.1 request must have a Host header"
        return None
    if len(hosts[0]) > 255 or _HOST.fullmatch(hosts[0].decode("latin-1")) is None:
        return "the Host header is not a valid host name"
    return None


def path_problem(path: str) -> str | None:
    """Why a request's decoded path cannot be routed as it is, or None."""
    if any(segment in (".", "..") for segment in path.split("/")):
        return "the request's path has a `.` or `..` segment"
    if "?" in path or "#" in path:
        return "the request's path has an encoded `?` or `#`"
    return None


class IFrontDoor(Interface):
    """The door a request came in through (a component of Twisted's request, as Klein keeps
    its own per-request state: ``FrontDoor.render`` sets it, ``on_admin_port`` reads it)."""


def on_admin_port(request: IRequest) -> bool:
    """Whether ``request`` came in on the ``--admin-listen`` endpoint."""
    if not isinstance(request, Componentized):
        return False
    door = request.getComponent(IFrontDoor)
    return door is not None and bool(door.admin)


@implementer(IFrontDoor)
class FrontDoor(Resource):
    """Refuses a URL that is not UTF-8 or a bad ``Host`` with a JSON 400; the rest to the app.

    With ``--admin-listen`` (``split``), the admin endpoint's door (``admin``)
    lets in only the admin routes, and the client endpoints' door keeps them
    out (404, as for a route that does not exist); ``on_admin_port(request)``
    says which endpoint it came in on (``ProxyApp`` shows the fleet there).
    """

    isLeaf = True

    def __init__(
        self,
        app: IResource,
        admin: bool = False,
        split: bool = False,
        identity: Callable[[], Iterable[bytes]] = lambda: IDENTITY,
        methods: Callable[[str], Iterable[str]] = lambda path: (),
    ) -> None:
        super().__init__()
        self._app = app
        #: The ``--admin-listen`` endpoint's door (``on_admin_port``).
        self.admin = admin
        self._split = split
        #: The headers that say who a client is, as configured now (the tenant header's).
        self._identity = identity
        #: The methods a path is served with (none: no such route).
        self._methods = methods

    def render(self, request: IRequest) -> bytes | int:
        try:
            path = unquote_to_bytes(request.path).decode("utf-8")
        except UnicodeDecodeError:
            return _refuse(request, ErrorCode.INVALID_URL, "the request URL is not valid UTF-8")
        problem = path_problem(path)
        if problem is not None:
            return _refuse(request, ErrorCode.INVALID_URL, problem)
        problem = host_problem(request)
        if problem is not None:
            return _refuse(request, ErrorCode.INVALID_HOST, problem)
        twice = conflicting(request.requestHeaders, self._identity())
        if twice is not None:
            return _refuse(request, ErrorCode.CONFLICTING_HEADERS, said_twice(twice))
        routed = "/" + path.lstrip("/")  # (Werkzeug routes //admin/... as /admin/...)
        if (self.admin and routed not in routes.ADMIN_PORT) or (
            self._split and not self.admin and routed in routes.ADMIN_ONLY
        ):
            method = request.method.decode("ascii", "replace")
            return _refuse(request, ErrorCode.NOT_FOUND, f"{method} {path}: Not Found")
        if request.method != request.method.upper():
            return self._not_a_method(request, routed)
        if isinstance(request, Componentized):  # (Twisted's request is; a test's may not be)
            request.setComponent(IFrontDoor, self)
        try:
            return self._app.render(request)
        except BadHost:  # a name Werkzeug will not bind to (IDNA), past the syntax above
            return _refuse(
                request, ErrorCode.INVALID_HOST, "the Host header is not a valid host name"
            )

    def _not_a_method(self, request: IRequest, path: str) -> bytes:
        """A method not all in capitals: 405 with the route's own (404 where none is served)."""
        method = request.method.decode("ascii", "replace")
        served = sorted(self._methods(path))
        if not served:
            return _refuse(request, ErrorCode.NOT_FOUND, f"{method} {path}: Not Found")
        request.setHeader(b"Allow", ", ".join(served).encode("ascii"))
        message = (
            f"methods are case-sensitive (RFC 9110 section 9.1): {method} is not one of "
            f"{', '.join(served)}"
        )
        return _refuse(request, ErrorCode.METHOD_NOT_ALLOWED, message)


def _refuse(request: IRequest, code: ErrorCode, message: str) -> bytes:
    return json_answer(request, ProxyError(code, message))
