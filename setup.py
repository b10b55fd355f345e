"""Packaging for nixl-twisted: the package, its twistd plugin and extras."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "nixl_twisted/__init__.py").read_text())

setup(
    name="nixl-twisted",
    version=VERSION.group(1) if VERSION else "0",
    description="A Twisted proxy for vLLM disaggregated prefill/decode serving over NIXL",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    # twisted.plugins has no __init__.py of ours: it is Twisted's package.
    packages=[*find_packages(include=["nixl_twisted", "nixl_twisted.*"]), "twisted.plugins"],
    package_data={"nixl_twisted": ["py.typed"], "nixl_twisted.web": ["static/*"]},
    install_requires=[
        # 24.10 sets TCP_NODELAY on HTTP server and client sockets; 25.5 lets
        # a Site skip form parsing (parsePOSTFormSubmission).
        "twisted[tls]>=25.5.0",
        "treq>=24.9.1",
        "klein>=24.8.0",
        "prometheus-client>=0.20",
        # Tracing (off unless an OTLP endpoint is given): the official SDK and
        # its OTLP/HTTP exporter; the SDK's own modules load only when on.
        "opentelemetry-api>=1.27",
        "opentelemetry-sdk>=1.27",
        "opentelemetry-exporter-otlp-proto-http>=1.27",
        'tomli>=2.0; python_version < "3.11"',
        # vLLM's KV cache events: a ZeroMQ PUB socket, msgpack batches (kv-aware).
        "pyzmq>=25",
        "msgpack>=1.0",
        # A kubeconfig file, for Kubernetes discovery from outside a cluster.
        "pyyaml>=6.0",
        # --limits-redis: tenants' limits shared through Redis (small, pure Python;
        # imported only when set, so the reactor is still twistd's to choose).
        "txredisapi>=1.6.0",
    ],
    extras_require={
        "demo": ["openai>=1.0"],
        # OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc: the SDK's gRPC exporter (grpcio).
        "otlp-grpc": ["opentelemetry-exporter-otlp-proto-grpc>=1.27"],
        # Kept so that `pip install 'nixl-twisted[redis]'` still works: txredisapi
        # is installed with the proxy now.
        "redis": [],
        "test": [
            "openai>=1.0",
            "anthropic>=0.40",
            # The tests' OTLP receiver decodes what the exporter sent.
            "opentelemetry-proto>=1.27",
            "pytest>=8",
            "pytest-timeout>=2.3",
            "hypothesis>=6.100",
            "mypy>=1.10",
            "mypy-zope>=1.0.5",
            "types-PyYAML>=6.0",
            "tomli>=2.0",  # lets mypy check the Python 3.10 branch
            "sphinx>=7",
            "myst-parser>=2",
            "ruff>=0.5",
            # The status page's test in a real browser: Debian's chromium and
            # chromedriver (`make chromium`), driven by Selenium's own bindings.
            "selenium>=4.20",
        ],
    },
    entry_points={"console_scripts": ["nixlproxy-demo=nixl_twisted.demo:main"]},
    classifiers=[
        "Framework :: Twisted",
        "Programming Language :: Python :: 3",
    ],
)
