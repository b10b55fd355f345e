#!/bin/sh
# `make image`: the proxy's image, built with docker (when its daemon answers)
# or podman, with no network inside the build.
#
# The wheelhouse is made first, here, for the base image's own Python and C
# library (asked of the base itself): every dependency as a wheel from PyPI,
# with setuptools and wheel to build the proxy's own wheel from this tree in
# the Dockerfile's first stage. The build itself then reaches nothing.
#
#   IMAGE_BASE                     the base; unset: python:3.12-slim from Docker Hub,
#                                  or, when no registry answers, Debian's own made here
#                                  from Debian's archive by deploy/image/debian-base.sh
#   IMAGE (nixl-twisted:VERSION)   the tag to give it
#   RUNTIME                        docker or podman (found when unset: runtime.sh)
#   PYTHON (python3)               runs pip to fill the wheelhouse
set -eu
cd "$(dirname "$0")/../.."

. deploy/image/runtime.sh
REGISTRY_BASE=docker.io/library/python:3.12-slim
DEBIAN_BASE=localhost/nixl-twisted-base:bookworm
BASE=${IMAGE_BASE:-}
if [ -z "$BASE" ]; then
    # Python's own image when it is here or a registry gives it; else Debian's, made once.
    if $RUNTIME image inspect "$REGISTRY_BASE" >/dev/null 2>&1 ||
        said=$(timeout 120 $RUNTIME pull "$REGISTRY_BASE" 2>&1); then
        BASE=$REGISTRY_BASE
    else
        echo "image: no registry gave $REGISTRY_BASE ($(echo "$said" | tail -n1))"
        if ! $RUNTIME image inspect "$DEBIAN_BASE" >/dev/null 2>&1; then
            echo "image: making $DEBIAN_BASE from Debian's archive (deploy/image/debian-base.sh)"
            RUNTIME=$RUNTIME deploy/image/debian-base.sh "$DEBIAN_BASE"
        fi
        BASE=$DEBIAN_BASE
    fi
fi
PYTHON=${PYTHON:-python3}
VERSION=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' nixl_twisted/__init__.py)
IMAGE=${IMAGE:-nixl-twisted:$VERSION}
REVISION=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

# The base's Python (X.Y) and glibc (2.NN), so that each wheel is one it can load.
set -- $($RUNTIME run --rm --network=none "$BASE" python3 -c \
    'import platform, sys; print("%d.%d" % sys.version_info[:2], platform.libc_ver()[1])')
python_version=$1
glibc=$2
arch=$(uname -m)
# pip takes a platform tag as it is: name every manylinux the base's glibc runs.
platforms=$(python3 -c 'import sys
major, minor = map(int, sys.argv[1].split("."))
arch = sys.argv[2]
tags = [f"manylinux_{major}_{m}_{arch}" for m in range(5, minor + 1)]
tags += [f"manylinux{name}_{arch}" for name in ("1", "2010", "2014")]
print(" ".join(f"--platform {tag}" for tag in tags))' "$glibc" "$arch")
echo "image: $IMAGE from $BASE (Python $python_version, glibc $glibc, $arch) with $RUNTIME"

rm -rf wheelhouse
trap 'rm -rf wheelhouse' EXIT
"$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    --implementation cp --python-version "$python_version" \
    $platforms --dest wheelhouse . setuptools wheel

$RUNTIME build --network=none \
    --build-arg BASE="$BASE" --build-arg VERSION="$VERSION" --build-arg REVISION="$REVISION" \
    --tag "$IMAGE" .
$RUNTIME image inspect --format '{{.Size}}' "$IMAGE" |
    awk -v image="$IMAGE" '{ printf "image: %s is %.0f MB\n", image, $1 / 1000000 }'
