"""``make image``'s podman configuration: every container's limits within this machine's
hard ones (read now, as podman's runtime will meet them), every file in its own folder."""

from __future__ import annotations

import importlib.util
import resource
import subprocess
import sys
from pathlib import Path
from types import ModuleType

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "image" / "podman_conf.py"


def podman_conf() -> ModuleType:
    spec = importlib.util.spec_from_file_location("podman_conf", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up there)
    spec.loader.exec_module(module)
    return module


def ulimits(folder: Path) -> dict[str, tuple[int, int]]:
    """containers.conf's default_ulimits, as podman reads them: name -> (soft, hard)."""
    conf = tomllib.loads((folder / "containers.conf").read_text(encoding="utf-8"))
    said = {}
    for entry in conf["containers"]["default_ulimits"]:
        name, _, values = entry.partition("=")
        soft, _, hard = values.partition(":")
        said[name] = (int(soft), int(hard))
    return said


def hard(limit: int) -> float:
    value = resource.getrlimit(limit)[1]
    return float("inf") if value == resource.RLIM_INFINITY else value


def test_no_container_limit_is_over_this_machines_hard_limit(tmp_path: Path) -> None:
    podman_conf().write(tmp_path)
    said = ulimits(tmp_path)
    assert set(said) == {"nofile", "nproc"}
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    for name, limit, ceiling in (
        ("nofile", resource.RLIMIT_NOFILE, hard(resource.RLIMIT_NOFILE)),
        ("nproc", resource.RLIMIT_NPROC, min(hard(resource.RLIMIT_NPROC), pid_max)),
    ):
        soft, most = said[name]
        assert 0 < soft <= most <= ceiling, (name, said[name], ceiling, resource.getrlimit(limit))


def lowered() -> None:
    """In the child alone: a machine whose hard limits are lower than this one's."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    resource.setrlimit(resource.RLIMIT_NPROC, (512, 512))


def test_the_limits_follow_the_machine_they_are_written_on(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        preexec_fn=lowered,
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert ulimits(tmp_path) == {"nofile": (1024, 1024), "nproc": (512, 512)}


def test_podman_is_pointed_at_files_of_its_folder_alone(tmp_path: Path) -> None:
    written = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert written.split() == [
        "export",
        f"CONTAINERS_CONF={tmp_path / 'containers.conf'}",
        f"CONTAINERS_STORAGE_CONF={tmp_path / 'storage.conf'}",
    ]
    storage = tomllib.loads((tmp_path / "storage.conf").read_text(encoding="utf-8"))["storage"]
    engine = tomllib.loads((tmp_path / "containers.conf").read_text(encoding="utf-8"))["engine"]
    paths = [storage["graphroot"], storage["runroot"], engine["tmp_dir"]]
    paths.append(engine["events_logfile_path"])
    assert all(Path(path).is_relative_to(tmp_path) for path in paths), paths


def test_a_machine_without_systemd_gets_cgroupfs_and_events_in_a_file(tmp_path: Path) -> None:
    module = podman_conf()
    limits = module.Limits(nofile=20000, nproc=32768)
    alone = tomllib.loads(module.containers_conf(tmp_path, limits, systemd=False, runc=True))
    assert alone["engine"]["cgroup_manager"] == "cgroupfs"
    assert alone["engine"]["events_logger"] == "file"
    assert alone["engine"]["runtime"] == "runc"
    assert alone["containers"]["netns"] == "host"
    booted = tomllib.loads(module.containers_conf(tmp_path, limits, systemd=True, runc=False))
    assert "cgroup_manager" not in booted["engine"] and "runtime" not in booted["engine"]


def test_storage_on_an_overlay_is_vfs(tmp_path: Path) -> None:
    driver_for = podman_conf().driver_for
    mounts = "overlay / overlay rw 0 0\n/dev/vda /data ext4 rw 0 0\n"
    assert driver_for(Path("/root/.cache/podman"), mounts) == "vfs"
    assert driver_for(Path("/data/podman"), mounts) == "overlay"
