"""Podman's configuration for this machine, written to a scratch folder, never to ``/etc``.

``deploy/image/runtime.sh`` runs this before it uses podman, and exports what it
prints: ``CONTAINERS_CONF`` and ``CONTAINERS_STORAGE_CONF`` naming the two
files written here, so that podman's images, state and events stay in the
folder, and the machine's own configuration is neither read nor changed.

What a machine like a CI runner needs, and podman's defaults do not give:

- **limits a container may have**: podman gives a root container 1048576
  open files, and raises its own process limit to ``pid_max`` (lowering it
  where the hard limit is higher); a runtime without ``CAP_SYS_RESOURCE``
  cannot set a limit above its own hard one, and no container starts
  (``error setting rlimits``). Each limit here is the machine's hard one,
  read now, and the processes' at most ``pid_max``;
- **no systemd**: cgroups through cgroupfs, events to a file in the folder;
- **no network plugins**: a container without ``--network`` shares the host's
  (the image's build itself runs with none);
- runc, when it is installed (``runtime.sh`` installs it with podman).

    python3 deploy/image/podman_conf.py DIR     # prints: export CONTAINERS_CONF=...
"""

from __future__ import annotations

import resource
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

#: Where Linux says how many processes (and so pids) there can be at all.
PID_MAX = Path("/proc/sys/kernel/pid_max")
#: The most open files a process may be given, past any ``ulimit``.
NR_OPEN = Path("/proc/sys/fs/nr_open")


@dataclass(frozen=True)
class Limits:
    """Open files and processes a container may have (soft and hard alike)."""

    nofile: int
    nproc: int

    @classmethod
    def of_this_machine(cls) -> Limits:
        """The hard limits this process has, as podman's runtime will inherit them."""
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if nofile == resource.RLIM_INFINITY:
            nofile = int(NR_OPEN.read_text())
        nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        pid_max = int(PID_MAX.read_text())
        if nproc == resource.RLIM_INFINITY or nproc > pid_max:
            nproc = pid_max  # (podman lowers its own to pid_max as it starts)
        return cls(nofile, nproc)


def containers_conf(folder: Path, limits: Limits, systemd: bool, runc: bool) -> str:
    """``containers.conf``: the limits, and what a machine without systemd needs."""
    ulimits = [f"nofile={limits.nofile}:{limits.nofile}", f"nproc={limits.nproc}:{limits.nproc}"]
    lines = [
        "# Written by deploy/image/podman_conf.py for this machine: remade at each use.",
        "[containers]",
        f"default_ulimits = {toml_list(ulimits)}",
        'netns = "host"',
        "",
        "[engine]",
        f"tmp_dir = {toml_string(str(folder / 'tmp'))}",
        f"events_logfile_path = {toml_string(str(folder / 'events.log'))}",
    ]
    if runc:
        lines.append('runtime = "runc"')
    if not systemd:
        lines += ['cgroup_manager = "cgroupfs"', 'events_logger = "file"']
    return "\n".join(lines) + "\n"


def storage_conf(folder: Path, driver: str) -> str:
    """``storage.conf``: images and containers' state in the folder."""
    return "\n".join(
        [
            "# Written by deploy/image/podman_conf.py: podman's images for make image.",
            "[storage]",
            f"driver = {toml_string(driver)}",
            f"graphroot = {toml_string(str(folder / 'storage'))}",
            f"runroot = {toml_string(str(folder / 'run'))}",
            "",
        ]
    )


def driver_for(folder: Path, mounts: str) -> str:
    """``overlay``, or ``vfs`` where the folder is itself on an overlay (inside a container),
    which overlay cannot stack on. ``mounts``: ``/proc/self/mounts``."""
    kinds: dict[str, str] = {}
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            kinds[fields[1]] = fields[2]
    point = max((p for p in kinds if folder.is_relative_to(p)), key=len, default="/")
    return "vfs" if kinds.get(point) in ("overlay", "aufs") else "overlay"


def toml_string(text: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(toml_string(item) for item in items) + "]"


def write(folder: Path, limits: Limits | None = None) -> dict[str, str]:
    """Both files, written into ``folder``; the variables that point podman at them."""
    folder.mkdir(parents=True, exist_ok=True)
    limits = limits if limits is not None else Limits.of_this_machine()
    systemd = Path("/run/systemd/system").is_dir()
    runc = shutil.which("runc", path="/usr/local/sbin:/usr/sbin:/sbin:/usr/bin:/bin") is not None
    conf, storage = folder / "containers.conf", folder / "storage.conf"
    conf.write_text(containers_conf(folder, limits, systemd, runc), encoding="utf-8")
    mounts = Path("/proc/self/mounts").read_text(encoding="utf-8")
    storage.write_text(storage_conf(folder, driver_for(folder, mounts)), encoding="utf-8")
    return {"CONTAINERS_CONF": str(conf), "CONTAINERS_STORAGE_CONF": str(storage)}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: podman_conf.py DIR", file=sys.stderr)
        return 2
    said = write(Path(argv[0]).resolve())
    print("export " + " ".join(f"{name}={shlex.quote(value)}" for name, value in said.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
