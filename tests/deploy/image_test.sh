#!/usr/bin/env bash
# Builds the Dockerfile's image and runs it. Checks, in the built image:
#   1. `epfabricd --help` (the ENTRYPOINT) lists --metrics_listen, and `epctl --version` runs: the binaries and the
#      shared libraries they load are all there (the runtime-packages list is complete);
#   2. it runs as uid 10001 (the manifests' runAsUser) and /run/epfabric is that user's;
#   3. the image's default command (ENTRYPOINT + CMD, one daemon) starts, and its HEALTHCHECK command passes within
#      10 s (what the examples' probes ask);
#   4. a fabric of two daemons on loopback (no credential by hand) is healthy on epfabric.v1.Fabric.
# Builder: docker where its daemon answers, else podman, else buildah (build only: checks 1-4 need a runner).
# Exit 77 (skipped) unless EPF_IMAGE_TEST=1 (the build compiles the whole tree inside the image: long, and it fetches
# the Debian base images and NVIDIA's CUDA repository, so it needs the network), and without a builder.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ ${EPF_IMAGE_TEST:-} != 1 ]]; then
  echo "SKIPPED: set EPF_IMAGE_TEST=1 to build the image (compiles the whole tree inside it)"
  exit 77
fi
if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
  engine=docker build=(docker build) run=(docker run --rm)
elif command -v podman >/dev/null; then
  engine=podman build=(podman build) run=(podman run --rm)
elif command -v buildah >/dev/null; then
  engine=buildah build=(buildah bud) run=()
else
  echo "SKIPPED: no container builder (a docker daemon that answers, podman or buildah) to build the Dockerfile"
  exit 77
fi
tag=localhost/epfabric-test:$$
"${build[@]}" --build-arg EPF_JOBS="${EPF_JOBS:-2}" -t "$tag" "$ROOT"
if ((${#run[@]} == 0)); then
  echo "built $tag with buildah; no runner: checks 1-4 are skipped"
  exit 0
fi
trap '"$engine" rmi -f "$tag" >/dev/null 2>&1 || true' EXIT
# 1
"${run[@]}" "$tag" --help | grep -q -- --metrics_listen
"${run[@]}" --entrypoint epctl "$tag" --version
# 2
[[ $("${run[@]}" --entrypoint sh "$tag" -c 'id -u; stat -c %u /run/epfabric' | sort -u) == 10001 ]]
# 3: the default command in the background, then the HEALTHCHECK's command as written in the Dockerfile.
health=$(sed -n 's/^  CMD \(.*\) || exit 1$/\1/p' "$ROOT/Dockerfile")
[[ -n $health ]]
# shellcheck disable=SC2016  # the script runs in the container's sh
"${run[@]}" --entrypoint sh "$tag" -c '
  epfabricd --client_socket=/run/epfabric/epfabricd.sock & pid=$!
  for i in $(seq 100); do '"$health"' >/dev/null 2>&1 && break; sleep 0.1; done
  '"$health"'; rc=$?
  kill $pid; wait $pid; exit $rc'
# 4
# shellcheck disable=SC2016
"${run[@]}" --entrypoint sh "$tag" -c '
  epfabricd --client_socket=/run/epfabric/r0.sock --world_size=2 --peer_listen=127.0.0.1:7000 --backend=host & a=$!
  epfabricd --client_socket=/run/epfabric/r1.sock --world_size=2 --rank=1 --coordinator=127.0.0.1:7000 \
    --backend=host & b=$!
  rc=1
  for i in $(seq 100); do
    epctl --socket=/run/epfabric/r1.sock health --service=epfabric.v1.Fabric >/dev/null 2>&1 && { rc=0; break; }
    sleep 0.1
  done
  kill $a $b; wait $a $b; exit $rc'
echo "image_test: OK ($engine)"
