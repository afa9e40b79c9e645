#!/usr/bin/env bash
# The compose file's images built from Debian's packages, for a machine where no image registry
# answers (`make cluster-images`): a bookworm base made with debootstrap and imported, then
# Redis, Prometheus and Python installed on it with apt-get, and the `rls` image built from this
# checkout by deploy/Dockerfile on that Python. deploy/images/debian.env names them, so the
# compose file runs unchanged:
#
#   deploy/images/build.sh
#   docker-compose --env-file deploy/images/debian.env up node-p0 node-p1
#
# Needs root (debootstrap), debootstrap and a Docker engine (DOCKER_HOST; DOCKER names the client,
# default `docker`). Images that exist already are kept (REBUILD=1 makes them again); the `rls`
# image is built every time (Docker's layer cache keeps an unchanged checkout quick). Each build
# step reaches the network as the host does (--network host): apt-get reaches the Debian mirror
# the host's apt uses (MIRROR), pip reaches PyPI. Grafana is not packaged by Debian: its image
# cannot be made this way, and the observability profile runs without it.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
docker="${DOCKER:-docker}"
# shellcheck source=deploy/images/debian.env
source "$here/debian.env"
BASE_IMAGE="${RLS_BASE_IMAGE:-rls-debian/bookworm:minbase}"

# The mirror the host's apt uses (deb822 or one-line sources), else Debian's own.
host_mirror() {
  local uri
  uri="$(sed -n 's/^URIs: *\(http[^ ]*\/debian\)\/* *$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)"
  [ -n "$uri" ] || uri="$(sed -n 's/^deb  *\(\[[^]]*\] *\)\{0,1\}\(http[^ ]*\/debian\)\/* .*/\2/p' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n1)"
  echo "${uri:-http://deb.debian.org/debian}"
}
MIRROR="${MIRROR:-$(host_mirror)}"

step() { printf '== %s\n' "$*"; }
seconds() { echo $(($(date +%s) - $1)); }
have_image() { [ "${REBUILD:-0}" != 1 ] && "$docker" image inspect "$1" >/dev/null 2>&1; }

for tool in "$docker" debootstrap tar; do
  command -v "$tool" >/dev/null || { echo "build.sh needs $tool (apt-get install docker.io debootstrap)" >&2; exit 1; }
done
"$docker" version --format '{{.Server.Version}}' >/dev/null || { echo "build.sh needs a running Docker engine (DOCKER_HOST=${DOCKER_HOST:-default})" >&2; exit 1; }

if have_image "$BASE_IMAGE"; then
  step "$BASE_IMAGE: kept"
else
  [ "$(id -u)" = 0 ] || { echo "debootstrap needs root: sudo $0" >&2; exit 1; }
  start=$(date +%s)
  rootfs="$(mktemp -d /tmp/rls-rootfs.XXXXXX)"
  trap 'rm -rf "$rootfs"' EXIT
  step "$BASE_IMAGE: debootstrap --variant=minbase bookworm from $MIRROR"
  debootstrap --variant=minbase --include=ca-certificates bookworm "$rootfs" "$MIRROR" >"$rootfs.log" 2>&1 ||
    { tail -n 20 "$rootfs.log" >&2; rm -f "$rootfs.log"; exit 1; }
  rm -f "$rootfs.log"
  # The certificate authorities this host added (an intercepting proxy's, for one) are trusted
  # inside too, so apt-get and pip in the builds reach the mirrors as the host's own do.
  if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >/dev/null
  fi
  # No package's service starts during a build (a build step shares the host's network).
  printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
  chmod 755 "$rootfs/usr/sbin/policy-rc.d"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner --exclude=./proc/* --exclude=./sys/* --exclude=./dev/* -c . |
    "$docker" import --change 'CMD ["bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
  step "$BASE_IMAGE: made in $(seconds "$start") s"
fi

# build IMAGE DOCKERFILE CONTEXT [ARGS...]
build() {
  local image=$1 dockerfile=$2 context=$3 start
  shift 3
  start=$(date +%s)
  "$docker" build --quiet --network host "$@" \
    -t "$image" -f "$dockerfile" "$context" >/dev/null
  step "$image: built in $(seconds "$start") s"
}

# version IMAGE COMMAND... : the version the image's server prints must be the one its tag says.
check_version() {
  local image=$1 want=${1##*:} got
  shift
  got="$("$docker" run --rm --network none --entrypoint "$1" "$image" "${@:2}" 2>&1 | head -n1)"
  case "$got" in
    *"${want#v}"*) ;;
    *) echo "$image runs '$got', not ${want#v}: Debian's package moved on, update deploy/images/debian.env" >&2; exit 1 ;;
  esac
}

for image in "$RLS_REDIS_IMAGE:redis" "$RLS_PROMETHEUS_IMAGE:prometheus" "$RLS_PYTHON_IMAGE:python"; do
  name=${image%:*} kind=${image##*:}
  if have_image "$name"; then step "$name: kept"; continue; fi
  build "$name" "$here/$kind.Dockerfile" "$here" --build-arg "BASE_IMAGE=$BASE_IMAGE"
done
check_version "$RLS_REDIS_IMAGE" redis-server --version
check_version "$RLS_PROMETHEUS_IMAGE" prometheus --version

# The `rls` image: deploy/Dockerfile on this Python, tagged as the compose file names it.
rls_image="$(sed -n 's/^ *image: *\(redis-layer-signals:.*\)$/\1/p' "$root/docker-compose.yml" | head -n1)"
build "$rls_image" "$root/deploy/Dockerfile" "$root" --build-arg "PYTHON_IMAGE=$RLS_PYTHON_IMAGE"
step "images ready; run the compose file with: docker-compose --env-file deploy/images/debian.env ..."
