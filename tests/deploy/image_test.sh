#!/usr/bin/env bash
# Builds the image with podman or buildah (Debian packages) where one is installed and can reach the base images,
# then runs `epfabricd --help` and a one-daemon health check in it. Exit 77 (skipped) without a builder, and unless
# EPF_IMAGE_TEST=1: the build compiles everything inside the image (long), which CI machines should not do by accident.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ ${EPF_IMAGE_TEST:-} != 1 ]]; then
  echo "SKIPPED: set EPF_IMAGE_TEST=1 to build the image (compiles the whole tree inside it)"
  exit 77
fi
if command -v podman >/dev/null; then
  build=(podman build) run=(podman run --rm)
elif command -v buildah >/dev/null; then
  build=(buildah bud) run=()
else
  echo "SKIPPED: no container builder (apt-get install podman or buildah) to build the Dockerfile"
  exit 77
fi
tag=localhost/epfabric-test:$$
"${build[@]}" --build-arg EPF_JOBS="${EPF_JOBS:-2}" -t "$tag" "$ROOT"
if ((${#run[@]} == 0)); then
  echo "built $tag with buildah; no podman to run it: the run checks are skipped"
  exit 0
fi
trap 'podman rmi -f "$tag" >/dev/null 2>&1 || true' EXIT
"${run[@]}" "$tag" --help | grep -q -- --metrics_listen
# shellcheck disable=SC2016  # the script runs in the container's sh
"${run[@]}" --entrypoint sh "$tag" -c '
  epfabricd --client_socket=/run/epfabric/d.sock --insecure_peer_port --backend=host & pid=$!
  for i in $(seq 100); do [ -S /run/epfabric/d.sock ] && break; sleep 0.1; done
  epctl --socket=/run/epfabric/d.sock health; rc=$?
  kill $pid; wait $pid; exit $rc'
echo "image_test: OK"
