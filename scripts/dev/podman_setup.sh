#!/usr/bin/env bash
# Prepare a Docker-API engine for the agent's docker-runtime tests: Podman from Debian packages,
# a private containers.conf/storage.conf, and a tiny imported image. Idempotent: when everything
# is already in place it only checks and prints the environment, in well under a second.
#
#   scripts/dev/podman_setup.sh [ROOT]      ROOT defaults to /var/tmp/syshax-podman
#
# It prints shell assignments (CONTAINERS_CONF=..., CONTAINERS_STORAGE_CONF=..., SYSHAX_PODMAN_IMAGE=...)
# that the caller exports before running `podman system service`. It never starts the service
# itself: the test fixture starts and stops its own service so no process outlives the tests.
set -euo pipefail

ROOT="${1:-/var/tmp/syshax-podman}"
IMAGE="localhost/syshax-hostroot:1"
mkdir -p "$ROOT"
exec 9>"$ROOT/.setup.lock"
flock 9  # several test runs may call this at once

if ! command -v podman >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  # conmon and the CNI plugins are hard dependencies of podman on bookworm; crun, slirp and
  # friends are recommendations we do not need (runc runtime, host networking, root).
  apt-get install -y --no-install-recommends podman runc conmon containernetworking-plugins \
    catatonit >"$ROOT/apt.log" 2>&1 || {
      apt-get update >>"$ROOT/apt.log" 2>&1
      apt-get install -y --no-install-recommends podman runc conmon \
        containernetworking-plugins catatonit >>"$ROOT/apt.log" 2>&1
    }
fi

# The CI machine needs runc (crun is not installed) and explicit ulimits: without them
# podman copies the host's huge nofile limit, which runc rejects inside this VM.
cat >"$ROOT/containers.conf.new" <<CONF
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
netns = "host"
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$ROOT/events.log"
tmp_dir = "$ROOT/tmp"
CONF
mv "$ROOT/containers.conf.new" "$ROOT/containers.conf"

# vfs instead of overlay: the host root is itself a container filesystem where overlay-on-
# overlay may be refused, and our image is a few empty directories so vfs costs nothing.
cat >"$ROOT/storage.conf.new" <<CONF
[storage]
driver = "vfs"
graphroot = "$ROOT/storage"
runroot = "$ROOT/run"
CONF
mv "$ROOT/storage.conf.new" "$ROOT/storage.conf"

export CONTAINERS_CONF="$ROOT/containers.conf"
export CONTAINERS_STORAGE_CONF="$ROOT/storage.conf"

if ! podman image exists "$IMAGE" 2>/dev/null; then
  # A root filesystem of mount points only: /usr, the Python installation and the project are
  # bind-mounted read-only at run time, so the host's interpreter and venv run unchanged.
  rootfs="$(mktemp -d "$ROOT/rootfs.XXXXXX")"
  mkdir -p "$rootfs"/{usr,etc,tmp,dev,proc,sys,root,work,var/tmp,run}
  for d in bin sbin lib lib64; do ln -s "usr/$d" "$rootfs/$d"; done
  echo "root:x:0:0:root:/root:/bin/sh" >"$rootfs/etc/passwd"
  echo "root:x:0:" >"$rootfs/etc/group"
  tar -C "$rootfs" -cf "$ROOT/rootfs.tar" .
  podman import "$ROOT/rootfs.tar" "$IMAGE" >/dev/null
  rm -rf "$rootfs" "$ROOT/rootfs.tar"
fi

echo "CONTAINERS_CONF=$CONTAINERS_CONF"
echo "CONTAINERS_STORAGE_CONF=$CONTAINERS_STORAGE_CONF"
echo "SYSHAX_PODMAN_IMAGE=$IMAGE"
echo "SYSHAX_PODMAN_ROOT=$ROOT"
