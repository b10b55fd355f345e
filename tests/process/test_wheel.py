"""The package as PyPI would get it: ``python -m build``, ``twine check``, and the wheel
installed alone in a fresh virtualenv, serving a completion through ``twistd nixlproxy``
found by its plugin, with the fakes of that install (``python -m nixl_twisted.testing``).

The wheel is built once for the module. Its dependencies are installed with no index
from a wheelhouse kept outside the clone (``~/.cache/nixl-twisted/wheelhouse``), filled
by ``pip download`` the first time a set of requirements is seen: a run then costs a
build, a virtualenv and an unpacking, not a download of Twisted and its friends.
"""

from __future__ import annotations

import email
import hashlib
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from nixl_twisted import __version__
from nixl_twisted.testing.process import Twistd, terminate

ROOT = Path(__file__).resolve().parents[2]
#: Building, the virtualenv, and the first filling of the wheelhouse (a download).
pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class Built:
    wheel: Path
    sdist: Path


@dataclass(frozen=True)
class Installed:
    """A fresh virtualenv holding the wheel and its dependencies, nothing else."""

    bin: Path

    def run(self, *command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / command[0]), *command[1:]],
            capture_output=True,
            text=True,
            timeout=60,
            env=clean_env(),
            cwd=self.bin.parent,
        )


def clean_env() -> dict[str, str]:
    """No PYTHONPATH (the tree must not serve) and no virtualenv of ours."""
    left_out = {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}
    return {k: v for k, v in os.environ.items() if k not in left_out} | {"PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """``python -m build`` of this tree: the sdist, then the wheel built from the sdist.

    Without build isolation: this virtualenv's setuptools (the test extra holds the
    version pyproject.toml asks for), so a run needs no index.
    """
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = out.glob("*.whl")
    (sdist,) = out.glob("*.tar.gz")
    return Built(wheel, sdist)


def requirements(wheel: Path) -> list[str]:
    """The wheel's own dependencies (``Requires-Dist`` with no extra)."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(archive.read(name))
    return sorted(r for r in metadata.get_all("Requires-Dist", []) if "extra ==" not in r)


def wheelhouse(wheel: Path) -> Path:
    """Wheels of the dependencies for this interpreter, downloaded once per requirements."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    tag = f"{sys.implementation.cache_tag}-{sysconfig.get_platform()}"
    house = cache / "nixl-twisted" / "wheelhouse" / tag
    wanted = "\n".join(requirements(wheel)).encode()
    filled = house / f"{hashlib.sha256(wanted).hexdigest()[:16]}.filled"
    if not filled.exists():
        house.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--dest", str(house), str(wheel)],
            check=True,
            timeout=240,
        )
        for ours in house.glob("nixl_twisted-*"):  # the wheel under test comes from dist
            ours.unlink()
        filled.write_bytes(wanted)
    return house


@pytest.fixture(scope="module")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """``pip install nixl_twisted-*.whl`` into a new virtualenv, no extras, no index."""
    venv = tmp_path_factory.mktemp("venv") / "plain"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    house = wheelhouse(built.wheel)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    install = ["install", "-q", "--no-compile", "--no-index", "--find-links", str(house)]
    subprocess.run([*pip, *install, str(built.wheel)], check=True, timeout=120)
    checked = subprocess.run([*pip, "check"], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout
    return Installed(venv / "bin")


def test_twine_passes_the_wheel_and_the_sdist(built: Built) -> None:
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(built.wheel), str(built.sdist)],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("PASSED") == 2


def test_the_wheel_holds_the_package_and_its_plugin_only(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as archive:
        names = archive.namelist()
        metadata = email.message_from_bytes(
            archive.read(f"nixl_twisted-{__version__}.dist-info/METADATA")
        )
    dist_info = f"nixl_twisted-{__version__}.dist-info/"
    assert "twisted/plugins/nixlproxy.py" in names
    assert "nixl_twisted/testing/fake.py" in names  # public: users' own tests start it
    static = {"nixl_twisted/web/static/status.js", "nixl_twisted/web/static/status.css"}
    assert static <= set(names)  # the status page's script and style, served from the package
    strays = [
        n
        for n in names
        if not (n.startswith("nixl_twisted/") and n.endswith((".py", "/py.typed")))
        and n not in static
        and n not in ("twisted/plugins/nixlproxy.py", "twisted/plugins/__init__.py")
        and not n.startswith(dist_info)
    ]
    assert strays == []
    assert "twisted/plugins/__init__.py" not in names  # Twisted's package, not ours
    assert metadata["Name"] == "nixl-twisted" and metadata["Version"] == __version__
    assert metadata["License-Expression"] == "MIT"
    assert f"{dist_info}licenses/LICENSE" in names
    assert metadata["Requires-Python"] == ">=3.10"
    assert "Framework :: Twisted" in metadata.get_all("Classifier", [])
    assert metadata["Description-Content-Type"] == "text/markdown"
    described = str(metadata.get_payload())
    assert described.strip() == (ROOT / "README.md").read_text("utf-8").strip()


def test_the_sdist_holds_the_source_and_no_leftovers(built: Built) -> None:
    with tarfile.open(built.sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    for needed in ("twisted/plugins/nixlproxy.py", "LICENSE", "CHANGELOG.md", "README.md"):
        assert needed in names
    assert "tests/pure/test_help.py" in names and "docs/configuration.md" in names
    leftovers = [
        n
        for n in names
        if n.endswith((".pyc", "dropin.cache"))
        or n.startswith(("build/", "dist/", ".venv/", "docs/_build/"))
    ]
    assert leftovers == []


def test_twistd_finds_the_plugin_and_says_the_version(installed: Installed) -> None:
    listed = installed.run("twistd", "--help")
    assert re.search(r"^\s+nixlproxy\s", listed.stdout, re.M), listed.stdout
    helped = installed.run("twistd", "nixlproxy", "--help")
    assert helped.returncode == 0
    assert helped.stdout.startswith("Usage: twistd [twistd options] nixlproxy")
    said = installed.run("twistd", "nixlproxy", "--version")
    assert said.stdout.startswith(f"nixl-twisted {__version__} "), said.stdout + said.stderr
    where = installed.run("python", "-c", "import nixl_twisted; print(nixl_twisted.__file__)")
    assert where.stdout.startswith(str(installed.bin.parent)), where.stdout


def test_an_option_needing_an_extra_is_refused_in_one_line_before_listening(
    installed: Installed,
) -> None:
    refused = installed.run(
        "twistd",
        "-n",
        "--pidfile=",
        "nixlproxy",
        "--listen",
        "tcp:0:interface=127.0.0.1",
        "--prefill",
        "http://127.0.0.1:9",
        "--decode",
        "http://127.0.0.1:9",
        "--otlp-traces-endpoint",
        "http://127.0.0.1:9/v1/traces",
        "--otlp-traces-protocol",
        "grpc",
    )
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0
    lines = [line for line in said.splitlines() if "nixl-twisted[otlp-grpc]" in line]
    assert len(lines) == 1, said
    assert "Traceback" not in said and "listening" not in said
    demo = installed.run("nixlproxy-demo")
    assert demo.returncode == 2
    assert demo.stderr.strip().endswith("pip install 'nixl-twisted[demo]'")


@contextmanager
def fakes(installed: Installed) -> Iterator[tuple[str, str]]:
    """``python -m nixl_twisted.testing`` of the fresh install, and its two URLs."""
    command = [str(installed.bin / "python"), "-m", "nixl_twisted.testing"]
    command += ["--prefill-port", "0", "--decode-port", "0", "--interface", "127.0.0.1"]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=clean_env(),
        cwd=installed.bin.parent,
    )
    try:
        urls: dict[str, str] = {}
        assert process.stdout is not None
        for line in process.stdout:
            found = re.search(rb"fake (prefill|decode)-\d+ listening on (\S+)", line)
            if found:
                urls[found[1].decode()] = found[2].decode()
            if len(urls) == 2:
                break
        assert len(urls) == 2, "the fakes exited before they listened"
        yield urls["prefill"], urls["decode"]
    finally:
        terminate(process)


def test_the_installed_wheel_serves_a_completion(installed: Installed) -> None:
    """The README's first steps, on the plain install: its fakes, its twistd, one chat;
    --limits-redis at a closed port, to show a plain install runs it (counted alone)."""
    with fakes(installed) as (prefill, decode):
        args = ["--listen", "tcp:0:interface=127.0.0.1", "--prefill", prefill, "--decode", decode]
        args += ["--tenant-header", "x-tenant", "--tenant-requests-per-minute", "100"]
        args += ["--limits-redis", "redis://127.0.0.1:9/0"]
        twistd = [str(installed.bin / "twistd")]
        proxy = Twistd(args, env=clean_env(), twistd=twistd, cwd=str(installed.bin.parent))
        try:
            address = proxy.address()
            body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
            request = urllib.request.Request(
                f"http://{address}/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "x-tenant": "team-a"},
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200
                answer = json.load(response)
            assert answer["choices"][0]["message"]["content"]
        finally:
            code = proxy.stop()
    assert code == 0, proxy.text()
    assert "Traceback" not in proxy.text(), proxy.text()
