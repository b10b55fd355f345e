"""nixl-twisted: a Twisted proxy for vLLM prefill/decode serving over NIXL.

Importing the package does no work: the reactor, sockets and pools are built
only by :func:`nixl_twisted.run.root.build`, from a ``ProxyConfig``.
"""

from nixl_twisted.identity import ID, VERSION, ProxyMeta, meta

#: The package's version, its one place (pyproject.toml reads it here); ``VERSION`` is
#: the protocol's.
__version__ = "0.1.0"

__all__ = ["ID", "VERSION", "ProxyMeta", "__version__", "meta"]
