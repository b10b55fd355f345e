"""``--allowed-backends``: where discovery and the admin API may point legs.

A poisoned DNS answer, a pod labelled by someone else, or a leaked admin
token must not make the proxy send prompts (and the backend API key) to an
arbitrary host. The instances the configuration names are the operator's
own and are not checked. Whatever the list, the cloud instance-metadata
addresses are refused unless listed exactly: an SSRF's favourite target.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

#: AWS, GCP and Azure's metadata service, and AWS's IPv6 one.
METADATA = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)

#: The metadata service's names (GCP's), which resolve to it.
METADATA_NAMES = frozenset({"metadata.google.internal", "metadata"})

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _address(host: str) -> Address | None:
    """The address ``host`` is, however written, or None for a name.

    An IPv4-mapped IPv6 address is its IPv4 one; the forms the C resolver
    also takes (``2852039166``, ``0251.0376.0251.0376``, ``0xa9fea9fe``) are
    read as it reads them, so that none slips past as a "name".
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
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


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
        """Why an instance at ``url`` may not be added, or None if it may."""
        host = (urlsplit(url.split("#", 1)[0]).hostname or "").lower().rstrip(".")
        address = _address(host)
        if address is None:
            if host in METADATA_NAMES and host not in self.names:
                return f"{host} is the cloud metadata service; list it in --allowed-backends"
            return self._name_refusal(host)
        if address in METADATA and not any(
            n.num_addresses == 1 and address in n for n in self.networks
        ):
            return (
                f"{host} is the cloud metadata service; list it in --allowed-backends to allow it"
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
