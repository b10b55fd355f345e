"""``--allowed-backends``: where an added instance, and its KV events, may be."""

from __future__ import annotations

import pytest

from nixl_twisted.backends.allowed import AllowedBackends


@pytest.mark.parametrize(
    ("allowed", "url", "refused"),
    [
        ((), "http://169.254.169.254:80", True),
        ((), "http://[fd00:ec2::254]:80", True),
        ((), "http://[::ffff:169.254.169.254]:80", True),
        ((), "http://2852039166:80", True),
        ((), "http://0251.0376.0251.0376:80", True),
        ((), "http://metadata.google.internal:80", True),
        ((), "http://10.0.0.1:80", False),
        ((), "http://abc:80", False),
        ((), "http://anything.example:80", False),
        (("169.254.0.0/16",), "http://169.254.169.254:80", True),  # only if listed exactly
        (("169.254.169.254/32",), "http://169.254.169.254:80", False),
        (("10.0.0.0/8",), "http://11.0.0.1:80", True),
        (("10.0.0.0/8",), "http://vllm.example:80", True),
        (("*.svc.cluster.local",), "http://p.ns.svc.cluster.local:80", False),
        (("*.svc.cluster.local",), "http://svc.cluster.local.evil:80", True),
        (("vllm.internal",), "http://vllm.internal:80", False),
    ],
)
def test_allowed_backends(allowed: tuple[str, ...], url: str, refused: bool) -> None:
    assert (AllowedBackends(allowed).refusal(url) is not None) is refused


@pytest.mark.parametrize(
    "host",
    [
        "169.254.170.2",  # ECS task metadata and credentials
        "169.254.0.23",  # Tencent
        "169.254.169.253",  # AWS's DNS, beside the metadata service: link-local as a whole
        "100.100.100.200",  # Alibaba
        "192.0.0.192",  # Oracle
        "[fd20:ce::254]",  # GCP over IPv6
        "[FD00:EC2:0::254]",  # AWS over IPv6, written otherwise
        "[64:ff9b::a9fe:a9fe]",  # NAT64 (RFC 6052) of 169.254.169.254
        "[64:ff9b::169.254.170.2]",
        "[64:ff9b:1::6464:64c8]",  # local-use NAT64 (RFC 8215) of 100.100.100.200
        "[::ffff:169.254.169.254]",  # IPv4-mapped
        "[::ffff:0:a9fe:a9fe]",  # IPv4-translated
        "[::169.254.169.254]",  # IPv4-compatible
        "0xa9fea9fe",
        "instance-data",  # EC2's name for it
        "INSTANCE-DATA.ec2.internal.",
        "instance-data.us-west-2.compute.internal",
        "metadata",
        "metadata.tencentyun.com",
    ],
)
def test_every_cloud_metadata_service_is_refused_whatever_else_is_listed(host: str) -> None:
    url = f"http://{host}:80"
    for allowed in ((), ("0.0.0.0/0", "::/0", "*.internal", "*.com")):
        refusal = AllowedBackends(allowed).refusal(url)
        assert refusal is not None and "metadata" in refusal, (allowed, refusal)


def test_a_metadata_address_listed_alone_is_allowed_and_its_other_forms_with_it() -> None:
    allowed = AllowedBackends(["169.254.170.2/32", "instance-data"])
    assert allowed.refusal("http://169.254.170.2:80") is None
    assert allowed.refusal("http://[64:ff9b::a9fe:aa02]:80") is None  # the same, over NAT64
    assert allowed.refusal("http://169.254.169.254:80") is not None
    assert allowed.refusal("http://instance-data:80") is None
    refusal = AllowedBackends().refusal("http://[64:ff9b::a9fe:a9fe]:80")
    assert refusal is not None and "169.254.169.254/32" in refusal  # says what to list


def test_an_address_carrying_an_ipv4_one_is_checked_as_that_ipv4_address() -> None:
    allowed = AllowedBackends(["10.0.0.0/8"])
    assert allowed.refusal("http://[64:ff9b::a00:1]:80") is None  # NAT64 of 10.0.0.1
    assert allowed.refusal("http://[64:ff9b::b00:1]:80") is not None  # of 11.0.0.1
    assert allowed.refusal("http://[2001:db8::a00:1]:80") is not None  # a plain IPv6 address
    assert AllowedBackends().refusal("http://[::1]:80") is None


@pytest.mark.parametrize(
    ("fragment", "refusal"),
    [
        ("#kv-events=5557&kv-replay=5558", None),  # ports on the instance's own host
        ("#kv-events=tcp://10.0.0.9:5557", None),
        ("#kv-events=tcp://192.168.0.9:5557", "kv-events tcp://192.168.0.9:5557: 192.168.0.9"),
        ("#kv-events=5557&kv-replay=tcp://8.8.8.8:5558", "kv-replay tcp://8.8.8.8:5558"),
        ("#dp=2&kv-events=tcp://[fd00:ec2::254]:5557", "metadata"),
        ("#kv-events=tcp://10.0.0.9;169.254.169.254:5557", "metadata"),  # ZeroMQ's SOURCE;HOST
        ("#kv-events=tcp://evil.example:5557", "evil.example is not a host name"),
    ],
)
def test_the_hosts_an_instances_kv_events_name_are_checked_too(
    fragment: str, refusal: str | None
) -> None:
    said = AllowedBackends(["10.0.0.0/8"]).refusal(f"http://10.0.0.5:8100{fragment}")
    if refusal is None:
        assert said is None
    else:
        assert said is not None and refusal in said, said
