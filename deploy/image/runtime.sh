# Sourced by the image scripts, from the clone's top: RUNTIME, and podman's configuration.
#
# docker when its daemon answers (a docker client alone is not enough: `docker
# info` must answer); else podman, installed with apt-get when it is missing
# (with runc), and configured for this machine by deploy/image/podman_conf.py:
# two files in PODMAN_DIR (~/.cache/nixl-twisted/podman), named by the
# CONTAINERS_CONF and CONTAINERS_STORAGE_CONF it exports. Nothing in /etc is
# written: podman's images stay in that folder, and `. deploy/image/runtime.sh`
# in a shell gives it the same podman (`$RUNTIME images`).

# apt-get install, quietly; apt's lists are refreshed only when the first try fails.
image_install() {
    command -v apt-get >/dev/null 2>&1 || {
        echo "image: $* missing, and there is no apt-get to install it" >&2
        exit 1
    }
    [ "$(id -u)" = 0 ] || { echo "image: $* missing: install as root (apt-get install $*)" >&2; exit 1; }
    echo "image: apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 || {
        apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
    }
}

# Whether a command is installed, on the PATH or in root's sbin (not always on a user's PATH).
image_has() {
    command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]
}

if [ -z "${RUNTIME:-}" ]; then
    if command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1; then
        RUNTIME=docker
    else
        RUNTIME=podman
    fi
fi
if [ "$RUNTIME" = podman ]; then
    image_missing=""
    image_has podman || image_missing="podman"
    image_has runc || image_missing="$image_missing runc"
    [ -z "$image_missing" ] || image_install $image_missing || exit 1
    PODMAN_DIR=${PODMAN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/nixl-twisted/podman}
    eval "$("${PYTHON:-python3}" deploy/image/podman_conf.py "$PODMAN_DIR")"
fi
