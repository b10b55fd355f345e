"""``--allowed-backends``: where discovery and the admin API may point legs and subscriptions.

A poisoned DNS answer, a pod labelled by someone else, or a leaked admin
token must not make the proxy send prompts (and the backend API key) to an
arbitrary host, nor subscribe to KV events there: an instance's URL and
the hosts its ``#kv-events=tcp://HOST:PORT`` and ``kv-replay=`` name are
all checked. The instances the configuration names are the operator's own
and are not checked. Whatever the list, the cloud instance-metadata
services are refused unless listed exactly: an SSRF's favourite target.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Where clouds answer metadata (and credentials) requests. Link-local IPv4 as a
#: whole: AWS, GCP, Azure, OpenStack, DigitalOcean, Tencent's 169.254.0.23, ECS's
#: task metadata at 169.254.170.2 and the neighbouring DNS and time services;
#: Alibaba's 100.100.100.200, Oracle's older 192.0.0.192, and AWS's and GCP's IPv6
#: services.
METADATA: tuple[Network, ...] = tuple(
    ipaddress.ip_network(net)
    for net in (
        "169.254.0.0/16",
        "100.100.100.200/32",
        "192.0.0.192/32",
        "fd00:ec2::254/128",
        "fd20:ce::254/128",
    )
)

#: Host names that resolve to a metadata service: GCP's, EC2's (and its regional
#: ``instance-data.REGION.compute.internal``), Tencent's.
METADATA_NAMES = frozenset(
    {"metadata", "metadata.google.internal", "instance-data", "metadata.tencentyun.com"}
)

#: IPv6 prefixes whose last 32 bits are an IPv4 address the packets reach: the
#: well-known NAT64 prefix (RFC 6052), the local-use one (RFC 8215) at its /96,
#: IPv4-translated (RFC 2765) and IPv4-compatible (deprecated) addresses.
#: (IPv4-mapped ``::ffff:a.b.c.d`` is ``ipv4_mapped``.)
EMBEDDING = tuple(
    ipaddress.IPv6Network(net) for net in ("64:ff9b::/96", "64:ff9b:1::/96", "::ffff:0:0:0/96")
)
_COMPATIBLE = ipaddress.IPv6Network("::/96")


def _ipv4_inside(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    low = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    if any(address in net for net in EMBEDDING):
        return low
    if address in _COMPATIBLE and int(low) > 1:  # (not :: nor ::1)
        return low
    return None


def _address(host: str) -> Address | None:
    """The address ``host`` is, however written, or None for a name.

    An IPv6 address that carries an IPv4 one (mapped, NAT64, translated,
    compatible) is that IPv4 address; the forms the C resolver also takes
    (``2852039166``, ``0251.0376.0251.0376``, ``0xa9fea9fe``) are read as
    it reads them, so that none slips past as a "name".
    """
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if not host or not all(c in "0123456789abcdefx." for c in host):
            return None
        try:
            address = ipaddress.ip_address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(address, ipaddress.IPv6Address):
        return _ipv4_inside(address) or address
    return address


def _metadata_name(host: str) -> bool:
    return host in METADATA_NAMES or (
        host.startswith("instance-data.") and host.endswith(".internal")
    )


def _hosts(url: str) -> list[tuple[str, str]]:
    """Each host ``url`` makes the proxy reach, with what it is for: the instance, its events."""
    base, _, fragment = url.partition("#")
    hosts = [("", (urlsplit(base).hostname or "").lower().rstrip("."))]
    for part in fragment.split("&") if fragment else ():
        name, _, where = part.partition("=")
        if where.startswith("tcp://"):
            # ZeroMQ's tcp://SOURCE;HOST:PORT connects from SOURCE: HOST is where it goes.
            host = where[len("tcp://") :].rpartition(":")[0].rpartition(";")[2]
            hosts.append((f"{name} {where}: ", host.strip("[]").lower().rstrip(".")))
    return hosts


class AllowedBackends:
    """Networks and host names an added instance may be at (none listed: any but metadata)."""

    def __init__(self, allowed: Sequence[str] = ()) -> None:
        self.entries = tuple(allowed)
        self.networks: list[Network] = []
        self.names: list[str] = []
        for entry in allowed:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.append(entry.lower())

    def refusal(self, url: str) -> str | None:
        """Why an instance at ``url`` may not be added, or None if it may.

        Its host, and the host of each ``tcp://`` endpoint its fragment names
        for KV events (a bare port is on its own host, checked already).
        """
        for what, host in _hosts(url):
            refusal = self._host_refusal(host)
            if refusal is not None:
                return what + refusal
        return None

    def host_refusal(self, host: str) -> str | None:
        """Why the proxy may not point anything at ``host`` (None: it may): prefill's
        handoff ``remote_host``, where decode's NIXL handshake goes."""
        return self._host_refusal(host.strip("[]").lower().rstrip("."))

    def _host_refusal(self, host: str) -> str | None:
        address = _address(host)
        if address is None:
            if _metadata_name(host) and host not in self.names:
                return f"{host} is the cloud metadata service; list it in --allowed-backends"
            return self._name_refusal(host)
        if any(address in net for net in METADATA) and not any(
            n.num_addresses == 1 and address in n for n in self.networks
        ):
            return (
                f"{host} is a cloud metadata address; list it alone "
                f"(as {address}/{address.max_prefixlen}) in --allowed-backends to allow it"
            )
        if (self.networks or self.names) and not any(address in n for n in self.networks):
            return f"{host} is in no network of --allowed-backends"
        return None

    def _name_refusal(self, host: str) -> str | None:
        if not (self.networks or self.names):
            return None
        for name in self.names:
            if host == name or (name.startswith("*.") and host.endswith(name[1:])):
                return None
        return f"{host} is not a host name --allowed-backends lists"
