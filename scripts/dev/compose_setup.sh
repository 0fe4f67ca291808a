#!/usr/bin/env bash
# Prepare this machine to run docker-compose.yml on a Docker-API engine without an image
# registry: Podman's API service and a compose client from Debian packages, a private
# containers.conf/storage.conf, and locally built images where the official ones cannot be
# pulled (a debootstrapped Debian base, stand-ins for postgres and redis; see images/).
# Idempotent and flock-protected: when everything is in place it only checks and prints.
#
#   scripts/dev/compose_setup.sh [ROOT]      ROOT defaults to $SYSHAX_COMPOSE_ROOT, else
#                                        /var/tmp/syshax-compose
#
# It prints KEY=VALUE lines for the caller to export (CONTAINERS_CONF, CONTAINERS_STORAGE_CONF,
# COMPOSE=<client>, SYSHAX_BASE_IMAGE, POSTGRES_IMAGE, REDIS_IMAGE, ...). It never starts
# `podman system service`: the caller starts and stops its own on a private socket.
#
# Environment: SYSHAX_DEBIAN_MIRROR (default http://deb.debian.org/debian),
# SYSHAX_COMPOSE_STORAGE_DRIVER (overlay or vfs; default: overlay when the kernel mounts it here).
set -euo pipefail

ROOT="${1:-${SYSHAX_COMPOSE_ROOT:-/var/tmp/syshax-compose}}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
MIRROR="${SYSHAX_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE_IMAGE="localhost/syshax-debian:bookworm"
POSTGRES_IMAGE="localhost/syshax-postgres-standin:bookworm"
REDIS_IMAGE="localhost/syshax-redis-standin:bookworm"

if ! mkdir -p "$ROOT" 2>/dev/null || [[ "$(id -u)" != 0 ]]; then
  echo "compose_setup.sh needs root (rootful Podman, debootstrap)" >&2
  exit 3
fi
exec 9>"$ROOT/.setup.lock"
flock 9  # several test runs may call this at once

# --- packages -------------------------------------------------------------------------------
# netavark + aardvark-dns: bridge networks with DNS between the compose services (CNI's
# dnsname plugin is the older alternative). iptables: netavark's firewall driver on bookworm.
# docker-compose (1.29.2, Python): the compose client; it talks to Podman's Docker-compatible
# API and honours `depends_on: condition: service_healthy`, which podman-compose 1.0.3 ignores.
PACKAGES=(podman runc conmon netavark aardvark-dns iptables catatonit debootstrap docker-compose)
missing=()
for pkg in "${PACKAGES[@]}"; do
  status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  # crun, slirp4netns, fuse-overlayfs and buildah are recommendations we do not need
  # (runc runtime, root, native overlay, builds through the API service).
  install() { apt-get install -y --no-install-recommends "${missing[@]}" >>"$ROOT/apt.log" 2>&1; }
  : >"$ROOT/apt.log"
  if ! install && ! { apt-get update >>"$ROOT/apt.log" 2>&1 && install; }; then
    # Exit status 3: the engine cannot be installed here (the test may skip on that alone).
    echo "cannot install ${missing[*]} (see $ROOT/apt.log):" >&2
    tail -5 "$ROOT/apt.log" >&2
    exit 3
  fi
fi

# --- storage driver -------------------------------------------------------------------------
# overlay shares image layers between containers; vfs copies the whole image for every
# container and every build step. Use overlay when the kernel mounts it on ROOT's filesystem.
overlay_works() {
  local probe
  probe="$(mktemp -d "$ROOT/overlay-probe.XXXXXX")"
  mkdir -p "$probe"/{lower,upper,work,merged}
  touch "$probe/lower/file"
  local ok=1
  if mount -t overlay overlay \
    -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" "$probe/merged" \
    2>/dev/null; then
    [[ -e "$probe/merged/file" ]] && ok=0
    umount "$probe/merged"
  fi
  rm -rf "$probe"
  return $ok
}
DRIVER="${SYSHAX_COMPOSE_STORAGE_DRIVER:-}"
if [[ -z "$DRIVER" ]]; then
  if [[ -s "$ROOT/driver" ]]; then
    DRIVER="$(cat "$ROOT/driver")"  # decided once: images live in that driver's storage
  elif overlay_works; then
    DRIVER=overlay
  else
    DRIVER=vfs
  fi
  echo "$DRIVER" >"$ROOT/driver"
fi
case "$DRIVER" in overlay | vfs) ;; *) echo "unknown storage driver $DRIVER" >&2; exit 2 ;; esac
STORE="$ROOT/$DRIVER"
mkdir -p "$STORE"

# --- configuration --------------------------------------------------------------------------
# As in scripts/dev/podman_setup.sh: runc (no crun here), cgroupfs (no systemd), events in a file,
# and explicit ulimits: podman would copy the host's huge limits, which runc may not set in
# this VM (it refuses nproc above 32768 and nofile above this shell's hard limit). Unlike it:
# containers get their own network namespaces (the compose networks), kept under ROOT.
limit() {  # FLAG CAP: this shell's hard limit, at most CAP
  local hard
  hard="$(ulimit -H "$1")"
  if [[ "$hard" == unlimited || "$hard" -gt "$2" ]]; then hard="$2"; fi
  echo "$hard"
}
NOFILE="$(limit -n 65536)"
NPROC="$(limit -u 32768)"
cat >"$STORE/containers.conf.new" <<CONF
[containers]
default_ulimits = ["nofile=$NOFILE:$NOFILE", "nproc=$NPROC:$NPROC"]
log_driver = "k8s-file"

[network]
network_backend = "netavark"
network_config_dir = "$STORE/networks"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$STORE/events.log"
tmp_dir = "$STORE/tmp"
CONF
mv "$STORE/containers.conf.new" "$STORE/containers.conf"

cat >"$STORE/storage.conf.new" <<CONF
[storage]
driver = "$DRIVER"
graphroot = "$STORE/storage"
runroot = "$STORE/run"
CONF
mv "$STORE/storage.conf.new" "$STORE/storage.conf"

export CONTAINERS_CONF="$STORE/containers.conf"
export CONTAINERS_STORAGE_CONF="$STORE/storage.conf"

# --- images ---------------------------------------------------------------------------------
# Each image carries the hash of the files it is built from; it is rebuilt only when they change.
inputs_hash() { cat "$@" | sha256sum | cut -c1-16; }
image_hash() {
  podman image inspect --format '{{index .Labels "syshax.inputs"}}' "$1" 2>/dev/null || true
}

# The base also carries this host's local CAs (see images/build_base.sh).
base_hash="$(inputs_hash "$HERE/images/build_base.sh" \
  $(find /usr/local/share/ca-certificates -type f 2>/dev/null | sort))"
if [[ "$(image_hash "$BASE_IMAGE")" != "$base_hash" ]]; then
  "$HERE/images/build_base.sh" "$BASE_IMAGE" "$ROOT/work" "$MIRROR" "syshax.inputs=$base_hash"
fi

build_standin() {  # IMAGE DIR
  local hash
  hash="$(inputs_hash "$HERE/images/$2"/* <(echo "$base_hash"))"
  if [[ "$(image_hash "$1")" != "$hash" ]]; then
    podman build --quiet --network host --build-arg "BASE=$BASE_IMAGE" \
      --label "syshax.inputs=$hash" -t "$1" "$HERE/images/$2" >"$ROOT/build-$2.log" 2>&1 || {
        tail -30 "$ROOT/build-$2.log" >&2
        exit 1
      }
  fi
}
build_standin "$POSTGRES_IMAGE" postgres
build_standin "$REDIS_IMAGE" redis

echo "CONTAINERS_CONF=$CONTAINERS_CONF"
echo "CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF"
echo "SYSHAX_COMPOSE_ROOT=$ROOT"
echo "SYSHAX_COMPOSE_STORAGE_DRIVER=$DRIVER"
echo "COMPOSE=$(command -v docker-compose)"
echo "SYSHAX_BASE_IMAGE=$BASE_IMAGE"
echo "POSTGRES_IMAGE=$POSTGRES_IMAGE"
echo "REDIS_IMAGE=$REDIS_IMAGE"
# docker-compose 1.29 would build and exec through the `docker` CLI, which is not installed:
# these make it use the API (Podman's service) for both.
echo "COMPOSE_DOCKER_CLI_BUILD=0"
echo "COMPOSE_INTERACTIVE_NO_CLI=1"
