# Sourced by the image scripts: RUNTIME, docker when its daemon answers, else podman.
# Podman runs here as root without systemd: cgroupfs, and its events in a file.
if [ -z "${RUNTIME:-}" ]; then
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
        RUNTIME=docker
    elif command -v podman >/dev/null 2>&1; then
        RUNTIME=podman
    else
        echo "image: neither a docker daemon nor podman: apt-get install podman (or docker.io)" >&2
        exit 1
    fi
fi
if [ "$RUNTIME" = podman ] && [ ! -d /run/systemd/system ]; then
    RUNTIME="podman --cgroup-manager=cgroupfs --events-backend=file"
fi
