#!/usr/bin/env bash
# Build a Debian bookworm base image from Debian's packages and import it into Podman, for
# machines that reach a Debian mirror but no image registry. The project image (`Dockerfile`,
# build argument BASE) and the stand-in postgres/redis images (images/postgres, images/redis)
# are built FROM it there; where a registry is reachable, use the official images instead.
#
#   images/build_base.sh IMAGE WORKDIR [MIRROR [LABEL=VALUE]]
#
# IMAGE   the tag to import as, e.g. localhost/syshax-debian:bookworm
# WORKDIR a scratch folder for the root filesystem (removed again afterwards)
# MIRROR  default http://deb.debian.org/debian
# LABEL   an image label to set, e.g. the hash of this script (scripts/dev/compose_setup.sh)
#
# Runs as root with CONTAINERS_CONF / CONTAINERS_STORAGE_CONF already exported (see
# scripts/dev/compose_setup.sh). Needs debootstrap.
set -euo pipefail

IMAGE="$1"
WORKDIR="$2"
MIRROR="${3:-http://deb.debian.org/debian}"
LABEL="${4:-}"
SUITE=bookworm
# python3 + venv for the project image; procps because health checks use pgrep;
# ca-certificates for pip and apt over HTTPS.
PACKAGES=python3,python3-venv,ca-certificates,procps

mkdir -p "$WORKDIR"
rootfs="$(mktemp -d "$WORKDIR/rootfs.XXXXXX")"
trap 'rm -rf "$rootfs" "$rootfs.tar"' EXIT

debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" \
  >"$WORKDIR/debootstrap.log" 2>&1 || {
    tail -20 "$WORKDIR/debootstrap.log" >&2
    exit 1
  }

security="${MIRROR%/debian}/debian-security"
cat >"$rootfs/etc/apt/sources.list" <<LIST
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $security $SUITE-security main
LIST
# The certificate authorities this host trusts locally (e.g. a TLS-inspecting proxy between it
# and PyPI) are trusted in the image too, so pip and apt inside builds work as they do here.
if compgen -G "/usr/local/share/ca-certificates/*" >/dev/null; then
  cp -a /usr/local/share/ca-certificates/. "$rootfs/usr/local/share/ca-certificates/"
  chroot "$rootfs" update-ca-certificates >/dev/null 2>&1
fi
# Like the official Debian images: no docs or man pages from later installs, no recommends,
# and apt's caches emptied after every install.
cat >"$rootfs/etc/dpkg/dpkg.cfg.d/excludes" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
CFG
cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'CFG'
APT::Install-Recommends "false";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
CFG
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin \
  "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
  "$rootfs"/usr/share/locale/* "$rootfs"/var/log/*.log "$rootfs"/tmp/* "$rootfs"/root/.cache
find "$rootfs/usr/share/doc" -mindepth 1 ! -type d ! -name copyright -delete
# The build host's identity must not leak into the image.
: >"$rootfs/etc/hostname"
rm -f "$rootfs/etc/resolv.conf" "$rootfs/etc/machine-id"

# mktemp made the folder 0700; as the image's / it would lock every other user out.
chmod 755 "$rootfs"
tar --numeric-owner -C "$rootfs" -cf "$rootfs.tar" .
podman import --quiet \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  ${LABEL:+--change "LABEL $LABEL"} \
  --message "debootstrap --variant=minbase $SUITE $MIRROR (+$PACKAGES)" \
  "$rootfs.tar" "$IMAGE" >/dev/null
