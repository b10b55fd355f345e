#!/bin/sh
# Makes a base image from Debian's archive alone, for machines that reach no
# container registry (air-gapped ones, or a CI that reaches only package
# mirrors): debootstrap's minimal Debian with python3 and its venv module, made
# into an image by the container runtime, with no registry on the way.
#
#   deploy/image/debian-base.sh [TAG]        (as root; TAG: localhost/nixl-twisted-base:bookworm)
#   make image IMAGE_BASE=localhost/nixl-twisted-base:bookworm
#
# SUITE (bookworm) and MIRROR (the one apt uses here, else deb.debian.org) can
# be set; RUNTIME is docker or podman as deploy/image/runtime.sh finds it, and
# debootstrap is installed with apt-get when it is missing. `make image` runs
# this itself when no registry gives it Python's image.
set -eu
cd "$(dirname "$0")/../.."
. deploy/image/runtime.sh

SUITE=${SUITE:-bookworm}
TAG=${1:-localhost/nixl-twisted-base:$SUITE}
if [ -z "${MIRROR:-}" ]; then
    # The mirror apt is set up with (deb822 or one-line sources), else Debian's own.
    MIRROR=$(grep -hs -m1 -o 'http[^ ]*/debian/\?$' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
        | head -n1 || true)
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi
image_has debootstrap || image_install debootstrap

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
# python3-venv brings ensurepip's wheels: the image makes its virtualenv offline.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$root" "$MIRROR"
# What an image does not need: apt's lists and caches, docs, man pages, locales.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
    "$root"/usr/share/locale/* "$root"/var/log/*.log
tar -C "$root" -c . | $RUNTIME import \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$TAG"
echo "debian-base.sh: made $TAG from $MIRROR ($SUITE)"
