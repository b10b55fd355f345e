"""Every option runs on a plain install: what it imports late is a dependency, or it is
refused as the options are parsed, in one line naming the extra (``run.needs``)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from twisted.python import usage

from nixl_twisted import demo
from nixl_twisted.run import needs
from nixl_twisted.run.needs import NEEDS, Need, missing
from nixl_twisted.tap import Options

ROOT = Path(__file__).resolve().parents[2]
POOLS = ["--prefill", "http://p1:8100", "--decode", "http://d1:8200"]
COLLECTOR = ["--otlp-traces-endpoint", "http://127.0.0.1:4318/v1/traces"]
#: The options that make each need's module wanted.
SETS = {
    "txredisapi": ["--limits-redis", "redis://127.0.0.1:6379/0"],
    "opentelemetry.sdk.trace": COLLECTOR,
    "opentelemetry.exporter.otlp.proto.http.trace_exporter": COLLECTOR,
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter": [
        *COLLECTOR,
        "--otlp-traces-protocol",
        "grpc",
    ],
    "yaml": ["--prefill-selector", "app=vllm,role=prefill", "--decode-selector", "role=decode"],
}


def parse(*args: str) -> Options:
    options = Options()
    options.parseOptions([*POOLS, *args])
    return options


def test_each_need_has_the_options_that_want_it() -> None:
    assert set(SETS) == {need.module for need in NEEDS}


@pytest.mark.parametrize("need", NEEDS, ids=lambda need: need.module)
def test_an_option_whose_module_is_missing_is_refused_in_one_line_naming_what_to_install(
    need: Need, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.setitem(sys.modules, need.module, None)  # as if not installed
    with pytest.raises(usage.UsageError) as refused:
        parse(*SETS[need.module])
    said = str(refused.value)
    assert "\n" not in said
    assert said.startswith(need.option.split()[0])
    assert need.distribution in said
    if need.extra is not None:
        assert f"pip install 'nixl-twisted[{need.extra}]'" in said
    else:
        assert "a dependency of nixl-twisted" in said


def test_a_module_that_is_found_is_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # (the gRPC exporter, an extra, may or may not be installed here)
    monkeypatch.setattr(needs, "findable", lambda module: True)
    for args in SETS.values():
        assert parse(*args).config is not None


def test_nothing_is_looked_for_when_no_option_wants_it() -> None:
    config = parse().config
    assert config is not None
    assert missing(config, {}, found=lambda module: False) is None


def test_the_dependencies_named_are_the_packages_and_the_extras_its_own() -> None:
    """What ``NEEDS`` calls a dependency is one, unconditionally; an extra installs its own."""
    required = importlib.metadata.requires("nixl-twisted") or []
    names = set()
    for requirement in required:
        name = re.split(r"[\s\[<>=;!~]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        extra = re.search(r'extra == "([^"]+)"', requirement)
        names.add((name, extra[1] if extra else None))
    for need in NEEDS:
        assert (need.distribution.lower(), need.extra) in names, need


def late_imports() -> set[str]:
    """Every module of another distribution that the package imports inside a function."""
    found: set[str] = set()
    for module in (ROOT / "nixl_twisted").rglob("*.py"):
        tree = ast.parse(module.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Import):
                        found.update(alias.name for alias in inner.names)
                    elif isinstance(inner, ast.ImportFrom) and inner.module and not inner.level:
                        found.add(inner.module)
                    elif (
                        isinstance(inner, ast.Call)
                        and ast.unparse(inner.func) == "importlib.import_module"
                        and isinstance(inner.args[0], ast.Constant)
                    ):
                        found.add(str(inner.args[0].value))
    ours = ("nixl_twisted", "twisted", *sys.stdlib_module_names)
    return {name for name in found if name.split(".")[0] not in ours}


def test_every_late_import_of_a_package_is_a_need() -> None:
    """A new lazy import of another package must say here what an install without it does."""
    covered = {need.module.rsplit(".", 1)[0] for need in NEEDS} | {n.module for n in NEEDS}
    # The demo's client: nixlproxy-demo checks it itself (below); not an option of the proxy.
    covered.add(demo.CLIENT)
    late = late_imports()
    assert {"txredisapi", "yaml", "openai"} <= late  # the scan finds what is there
    assert (
        sorted(n for n in late if not any(n == c or n.startswith(c + ".") for c in covered)) == []
    )


def test_the_demo_without_its_client_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, demo.CLIENT, None)
    assert demo.main([]) == 2
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "pip install 'nixl-twisted[demo]'" in said
