#!/usr/bin/env bash
# The Dockerfile builds with scripts/epf and nothing else (no second recipe to drift): its build stage runs
# `scripts/epf deps`, `scripts/epf install` (which builds) and `scripts/epf runtime-packages`, and no cmake, ninja,
# make or compiler of its own; the only packages it installs itself are the CUDA toolkit and what fetching it needs.
# The runtime stage runs as a non-root user, has a HEALTHCHECK with `epctl health`, and starts epfabricd.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
file=$ROOT/Dockerfile
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

[[ -f $file ]] || { echo "FAIL: no Dockerfile"; exit 1; }
[[ -f $ROOT/.dockerignore ]] || fail "no .dockerignore"
grep -qx 'build' "$ROOT/.dockerignore" || fail ".dockerignore does not leave out build/"

# RUN instructions with their continuation lines joined.
runs=$(awk '/^[[:space:]]*#/ { next } { line = line $0 } /\\$/ { sub(/\\$/, "", line); next } { print line; line = "" }' \
       "$file" | grep -E '^RUN ' || true)
[[ -n $runs ]] || fail "no RUN instructions"
for step in 'scripts/epf deps' 'scripts/epf install' 'scripts/epf runtime-packages'; do
  grep -qF "$step" <<<"$runs" || fail "no RUN with '$step'"
done
if grep -nE '(^|[^[:alnum:]_/-])(cmake|ninja|make|g\+\+|gcc|nvcc|protoc)([[:space:]]|$)' <<<"$runs"; then
  fail "a RUN builds by itself (cmake/ninja/make/compiler) instead of scripts/epf"
fi
# apt-get install: only the CUDA toolkit (+ ca-certificates/wget to fetch its keyring) and the runtime packages list.
while read -r line; do
  packages=$(sed -E 's/.*apt-get install[^a-z$]*(-[a-zA-Z-]+ )*//' <<<"$line" | tr ' ' '\n' |
             grep -vE '^(-.*|\\|&&.*|)$' | sed -n '1,/&&/p' | grep -v '&&' || true)
  for p in $packages; do
    case $p in
      ca-certificates | wget | cuda-minimal-build-*) ;;
      *) fail "the Dockerfile installs '$p' itself; build dependencies belong in scripts/epf deps" ;;
    esac
  done
done < <(grep -oE 'apt-get install [^&]*' <<<"$runs" | grep -v xargs || true)
grep -q 'runtime-packages.txt' <<<"$runs" || fail "the runtime stage does not install the runtime-packages list"

# Every scripts/epf command the Dockerfile uses exists.
while read -r command; do
  "$ROOT/scripts/epf" --help | grep -qE "^  $command( |$)" || fail "scripts/epf has no command '$command'"
done < <(grep -oE 'scripts/epf [a-z-]+' <<<"$runs" | awk '{ print $2 }' | sort -u)

# Runtime stage: the last FROM onwards.
runtime=$(awk '/^FROM /{ block = "" } { block = block $0 "\n" } END { printf "%s", block }' "$file")
grep -qE '^FROM .* AS runtime' <<<"$runtime" || fail "the last stage is not 'runtime'"
user=$(grep -E '^USER ' <<<"$runtime" | tail -1 | awk '{ print $2 }')
[[ -n $user && ${user%%:*} != root && ${user%%:*} != 0 ]] || fail "the runtime stage does not run as a non-root USER"
grep -qE '^HEALTHCHECK .*' <<<"$runtime" || fail "no HEALTHCHECK"
grep -A2 -E '^HEALTHCHECK' <<<"$runtime" | grep -q 'epctl .*health' || fail "HEALTHCHECK is not epctl health"
grep -qE '^ENTRYPOINT \["epfabricd"' <<<"$runtime" || fail "ENTRYPOINT is not epfabricd"
grep -qE '^COPY --from=build /opt/epfabric' <<<"$runtime" || fail "the runtime stage does not take the install tree"

if ((fails)); then
  echo "dockerfile_test: $fails failures"
  exit 1
fi
echo "dockerfile_test: OK"
