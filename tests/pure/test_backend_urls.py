"""The backend client's URL shortcut sends what treq itself would have sent."""

from __future__ import annotations

from hyperlink import EncodedURL
from hypothesis import given
from hypothesis import strategies as st

from nixl_twisted.backends.upstream import encoded_url

_HOSTS = st.sampled_from(["127.0.0.1", "decode-0.vllm.svc", "bücher.example"])
_PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/health"])
_QUERIES = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="#"), max_size=20)


@given(
    scheme=st.sampled_from(["http", "https"]),
    host=_HOSTS,
    port=st.integers(1, 65535),
    path=_PATHS,
    query=_QUERIES,
)
def test_same_uri_as_treq_would_send(
    scheme: str, host: str, port: int, path: str, query: str
) -> None:
    text = f"{scheme}://{host}:{port}{path}" + (f"?{query}" if query else "")
    expected = EncodedURL.from_text(text).to_uri().to_text()
    ready = encoded_url(text)
    assert ready.to_uri().to_text() == expected
    assert ready.to_text() == expected


def test_an_ipv6_literal_host_is_kept_as_it_is() -> None:
    # hyperlink's to_uri() alone fails on it (python-hyper/hyperlink#68).
    ready = encoded_url("http://[fd00::1]:8000/v1/completions?q=\u00e9")
    assert ready.to_text() == "http://[fd00::1]:8000/v1/completions?q=%C3%A9"


def test_a_derived_url_is_rendered_afresh() -> None:
    derived = encoded_url("http://127.0.0.1:8000/v1/completions").replace(path=("health",))
    assert derived.to_uri().to_text() == "http://127.0.0.1:8000/health"
