"""How to reach the Kubernetes API: the pod's service account, or a kubeconfig file.

In a pod: ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``, the
service account's token (read again for each request: bound tokens are
rotated) and its CA. Outside: the kubeconfig's current context, with a
bearer token (``token``, ``tokenFile``) or a client certificate; the exec and
auth-provider plugins are not run (they would need a thread or a process
per request): use a token.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twisted.internet import ssl
from twisted.web.client import Agent, BrowserLikePolicyForHTTPS, HTTPConnectionPool
from twisted.web.iweb import IPolicyForHTTPS
from zope.interface import implementer

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class NoApiAccess(Exception):
    """No way to reach the API server: the message says what is missing."""


@dataclass(frozen=True)
class ApiAccess:
    """The API server's URL and how to authenticate to it."""

    server: str
    token: str | None = None
    #: Read for each request (a rotated service account token).
    token_file: str | None = None
    #: PEM text.
    ca: str | None = None
    client_certificate: str | None = None
    client_key: str | None = None
    namespace: str | None = None

    def authorization(self) -> str | None:
        if self.token_file is not None:
            return "Bearer " + Path(self.token_file).read_text().strip()
        return f"Bearer {self.token}" if self.token else None

    def agent(self, reactor: Any, connect_timeout: float = 10.0) -> Agent:
        """An agent for this server: its CA trusted, its client certificate shown."""
        policy: IPolicyForHTTPS = BrowserLikePolicyForHTTPS()
        if self.ca is not None or self.client_certificate is not None:
            policy = _ClusterTls(self)
        pool = HTTPConnectionPool(reactor, persistent=False)
        return Agent(reactor, contextFactory=policy, pool=pool, connectTimeout=connect_timeout)


@implementer(IPolicyForHTTPS)
class _ClusterTls:
    """TLS to the API server: its own CA, and our client certificate if the config has one."""

    def __init__(self, access: ApiAccess) -> None:
        self._trust = ssl.Certificate.loadPEM(access.ca.encode()) if access.ca is not None else None
        self._client = None
        if access.client_certificate is not None and access.client_key is not None:
            pem = access.client_certificate + "\n" + access.client_key
            self._client = ssl.PrivateCertificate.loadPEM(pem.encode())

    def creatorForNetloc(self, hostname: bytes, port: int) -> Any:
        return ssl.optionsForClientTLS(
            hostname.decode("ascii"), trustRoot=self._trust, clientCertificate=self._client
        )


def in_cluster(environ: Mapping[str, str], account: Path = SERVICE_ACCOUNT) -> ApiAccess | None:
    """The pod's own access to the API server, or None outside a cluster."""
    host = environ.get("KUBERNETES_SERVICE_HOST")
    port = environ.get("KUBERNETES_SERVICE_PORT", "443")
    token = account / "token"
    if not host or not token.exists():
        return None
    host = f"[{host}]" if ":" in host else host
    ca = account / "ca.crt"
    namespace = account / "namespace"
    return ApiAccess(
        f"https://{host}:{port}",
        token_file=str(token),
        ca=ca.read_text() if ca.exists() else None,
        namespace=namespace.read_text().strip() if namespace.exists() else None,
    )


def from_kubeconfig(path: str) -> ApiAccess:
    """The current context of a kubeconfig file; ``NoApiAccess`` says what is wrong with it."""
    import yaml  # (only a kubeconfig needs it)

    file = Path(path.split(os.pathsep, 1)[0]).expanduser()
    try:
        config = yaml.safe_load(file.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise NoApiAccess(f"kubeconfig {file}: {error}") from None
    if not isinstance(config, dict):
        raise NoApiAccess(f"kubeconfig {file}: not a kubeconfig")
    current = config.get("current-context")
    context = _named(config, "contexts", current, file).get("context") or {}
    cluster = _named(config, "clusters", context.get("cluster"), file).get("cluster") or {}
    user = _named(config, "users", context.get("user"), file, needed=False).get("user") or {}
    if "exec" in user or "auth-provider" in user:
        raise NoApiAccess(
            f"kubeconfig {file}: user {context.get('user')!r} authenticates by a plugin "
            "(exec or auth-provider), which nixlproxy does not run: give it a token"
        )
    if cluster.get("insecure-skip-tls-verify"):
        raise NoApiAccess(
            f"kubeconfig {file}: insecure-skip-tls-verify is not supported: give the cluster's CA"
        )
    server = cluster.get("server")
    if not isinstance(server, str) or not server.startswith(("http://", "https://")):
        raise NoApiAccess(f"kubeconfig {file}: the cluster has no server URL")
    here = file.parent
    return ApiAccess(
        server.rstrip("/"),
        token=user.get("token"),
        token_file=_path(here, user.get("tokenFile")),
        ca=_pem(here, cluster, "certificate-authority"),
        client_certificate=_pem(here, user, "client-certificate"),
        client_key=_pem(here, user, "client-key"),
        namespace=context.get("namespace"),
    )


def access(kubeconfig: str | None, environ: Mapping[str, str]) -> ApiAccess:
    """The kubeconfig given, else the pod's service account; ``NoApiAccess`` if neither."""
    if kubeconfig is not None:
        return from_kubeconfig(kubeconfig)
    found = in_cluster(environ)
    if found is None:
        raise NoApiAccess(
            "not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST and service account token) "
            "and no --kubeconfig"
        )
    return found


def namespace(configured: str | None, kubeconfig: str | None, environ: Mapping[str, str]) -> str:
    """The selected pods' namespace: as given, else the pod's or the context's, else default."""
    if configured:
        return configured
    try:
        return access(kubeconfig, environ).namespace or "default"
    except NoApiAccess:
        return "default"


def _named(
    config: dict[str, Any], kind: str, name: object, file: Path, needed: bool = True
) -> dict[str, Any]:
    for entry in config.get(kind) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            return entry
    if needed:
        raise NoApiAccess(f"kubeconfig {file}: no {kind[:-1]} named {name!r} (current-context)")
    return {}


def _path(here: Path, value: object) -> str | None:
    return str(here / str(value)) if value else None


def _pem(here: Path, section: dict[str, Any], key: str) -> str | None:
    data = section.get(f"{key}-data")
    if data:
        return base64.b64decode(data).decode("ascii")
    path = _path(here, section.get(key))
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as error:
        raise NoApiAccess(f"kubeconfig {key} {path}: {error}") from None
