"""``--allowed-backends``: where discovery and the admin API may point legs.

A poisoned DNS answer, a pod labelled by someone else, or a leaked admin
token must not make the proxy send prompts (and the backend API key) to an
arbitrary host. The instances the configuration names are the operator's
own and are not checked. Whatever the list, the cloud instance-metadata
addresses are refused unless listed exactly: an SSRF's favourite target.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from urllib.parse import urlsplit

#: AWS, GCP and Azure's metadata service, and AWS's IPv6 one.
METADATA = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class AllowedBackends:
    """Networks and host names an added instance may be at (none listed: any but metadata)."""

    def __init__(self, allowed: Sequence[str] = ()) -> None:
        self.networks: list[Network] = []
        self.names: list[str] = []
        for entry in allowed:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.append(entry.lower())

    def refusal(self, url: str) -> str | None:
        """Why an instance at ``url`` may not be added, or None if it may."""
        host = (urlsplit(url.split("#", 1)[0]).hostname or "").lower()
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
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
