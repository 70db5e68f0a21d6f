#!/usr/bin/env bash
# Build (or pull) the images deploy/compose.yaml runs, and say which ones to use.
#
#   deploy/build-images.sh [app|redis|postgres|prometheus|all] [--offline|--registry]
#
# Prints `NAME=image` lines (APP_IMAGE, REDIS_IMAGE, POSTGRES_IMAGE, PROMETHEUS_IMAGE) on
# stdout for the env file `make up` writes; everything else goes to stderr.
#
#   registry  redis:7, postgres:16 and prom/prometheus:v2.53.0 as they are; the app image is
#             `docker build -f deploy/Dockerfile` FROM python:3.12-slim.
#   offline   no container registry: each image is a Debian rootfs made by debootstrap
#             (trixie, minbase) and `docker import`ed, as docker/build.sh does for the
#             sandboxes. The rootfs tarballs are cached in ${XDG_CACHE_HOME:-~/.cache}/studio-code/.
#               studio-code-redis:1       redis-server + redis-tools (Debian)
#               studio-code-postgres:1    postgresql (Debian) + deploy/postgres-entrypoint.sh
#               studio-code-prometheus:1  prometheus (Debian)
#               studio-code-pybase:1      python3 + python3-venv: the app image's BASE
#             The app image studio-code-app:1 is then `docker build -f deploy/Dockerfile
#             --build-arg BASE=studio-code-pybase:1 --network host`: pip installs the
#             project's dependencies from PyPI (or PIP_INDEX_URL, a mirror) inside the build,
#             at the versions of requirements.lock.
# Default: registry when the image is present or `docker pull` gets it within
# STUDIO_PULL_TIMEOUT seconds (20), else offline; decided per image.
#
# Environment: STUDIO_PULL_TIMEOUT, STUDIO_DEBIAN_MIRROR, STUDIO_DEBIAN_SUITE (trixie),
# STUDIO_APP_IMAGE (studio-code-app:1), PIP_INDEX_URL (passed to the app build),
# STUDIO_APP_EXTRAS (the project's extras in the app image: http; http,otel for traces),
# STUDIO_SERVICE_TAG (the offline images' tag: 1), STUDIO_BUILD_CA_FILE (the CA bundle pip
# trusts in the app build; default: $PIP_CERT, else the host's ca-certificates.crt),
# STUDIO_REBUILD=1 (rebuild offline images that are present).
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
SUITE=${STUDIO_DEBIAN_SUITE:-trixie}
CACHE_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/studio-code
PULL_TIMEOUT=${STUDIO_PULL_TIMEOUT:-20}
APP_IMAGE=${STUDIO_APP_IMAGE:-studio-code-app:1}
TAG=${STUDIO_SERVICE_TAG:-1}
APP_BASE_REGISTRY=python:3.12-slim
APP_BASE_OFFLINE=studio-code-pybase:$TAG
# Bump when a recipe below changes, to invalidate the cached rootfs tarballs.
RECIPE=1

declare -A REGISTRY_IMAGE=([redis]=redis:7 [postgres]=postgres:16
  [prometheus]=prom/prometheus:v2.53.0)
declare -A OFFLINE_IMAGE=([redis]=studio-code-redis:$TAG [postgres]=studio-code-postgres:$TAG
  [prometheus]=studio-code-prometheus:$TAG)
declare -A PACKAGES=([redis]=redis-server,redis-tools
  [postgres]=postgresql,postgresql-client
  [prometheus]=prometheus,ca-certificates
  [pybase]=python3,python3-venv,ca-certificates,passwd)

log() { printf '[build-images] %s\n' "$*" >&2; }
die() { printf '[build-images] ERROR: %s\n' "$*" >&2; exit 1; }

TMP_ROOT=$(mktemp -d "${TMPDIR:-/tmp}/studio-images.XXXXXX")
trap 'rm -rf "$TMP_ROOT"' EXIT

present() { docker image inspect "$1" >/dev/null 2>&1; }

# After one pull fails, the others are not tried: an air-gapped host would otherwise wait
# up to STUDIO_PULL_TIMEOUT per image.
REGISTRY_DOWN=
pullable() {
  present "$1" && return 0
  [[ -z $REGISTRY_DOWN ]] || return 1
  log "trying: docker pull $1 (timeout ${PULL_TIMEOUT}s)"
  timeout "$PULL_TIMEOUT" docker pull -q "$1" >/dev/null 2>&1 && return 0
  log "no registry answers for $1: the next images are built offline too"
  REGISTRY_DOWN=1
  return 1
}

debian_mirror() { # the host's apt mirror, as docker/build.sh finds it
  if [[ -n ${STUDIO_DEBIAN_MIRROR:-} ]]; then echo "$STUDIO_DEBIAN_MIRROR"; return; fi
  local f uri
  for f in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -r $f ]] || continue
    uri=$(sed -n -E \
      -e 's#^[[:space:]]*URIs:[[:space:]]*([^[:space:]]+/debian)/?([[:space:]].*)?$#\1#p' \
      -e 's#^[[:space:]]*deb[[:space:]]+(\[[^]]*\][[:space:]]+)?([^[:space:]]+/debian)/?[[:space:]].*$#\2#p' \
      "$f" | head -n1)
    if [[ -n $uri ]]; then echo "$uri"; return; fi
  done
  echo "http://deb.debian.org/debian"
}

tarball_of() { # $1 name, $2 packages: the cache path of that rootfs
  local arch key
  arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)
  key=$(printf 'svc recipe=%s suite=%s arch=%s include=%s\n' "$RECIPE" "$SUITE" "$arch" "$2" \
    | sha256sum | cut -c1-16)
  echo "$CACHE_DIR/rootfs-$1-$SUITE-$arch-$key.tar"
}

# A directory holding a cached Debian rootfs with packages $2, for recipe $1 (unpacked from
# the cached tarball, or made by debootstrap on a miss and then cached).
rootfs() {
  local name=$1 include=$2 arch tarball root
  arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)
  tarball=$(tarball_of "$name" "$include")
  root=$(mktemp -d "$TMP_ROOT/$name.XXXXXX")
  if [[ -s $tarball ]]; then
    log "$name: using cached rootfs $tarball"
  else
    command -v debootstrap >/dev/null || die "debootstrap not found (scripts/host-setup.sh installs it)"
    [[ $(id -u) -eq 0 ]] || die "debootstrap needs root: run as root or through sudo"
    log "$name: debootstrap --variant=minbase --include=$include $SUITE from $(debian_mirror)"
    if ! debootstrap --variant=minbase --include="$include" --arch="$arch" "$SUITE" "$root" \
        "$(debian_mirror)" >"$TMP_ROOT/$name-debootstrap.log" 2>&1; then
      tail -n 30 "$TMP_ROOT/$name-debootstrap.log" >&2
      die "debootstrap of $SUITE failed (set STUDIO_DEBIAN_MIRROR to a reachable Debian mirror)"
    fi
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/log/* \
      "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
      "$root"/usr/share/doc/* "$root"/debootstrap "$root"/tmp/* "$root"/var/tmp/*
    : >"$root"/etc/resolv.conf
    echo localhost >"$root"/etc/hostname
    [[ -e $root/etc/machine-id ]] && : >"$root"/etc/machine-id
    mkdir -p "$CACHE_DIR"
    tar --numeric-owner --xattrs -C "$root" -cf "$tarball.part" \
      --exclude=./dev/* --exclude=./proc/* --exclude=./sys/* --exclude=./run/* .
    mv "$tarball.part" "$tarball"
    log "$name: cached $tarball ($(du -h "$tarball" | cut -f1))"
    rm -rf "$root"
    [[ ${3:-} != --cache-only ]] || return 0
    root=$(mktemp -d "$TMP_ROOT/$name.XXXXXX")
  fi
  tar --numeric-owner --xattrs -C "$root" -xf "$tarball"
  echo "$root"
}

uid_of() { awk -F: -v u="$2" '$1 == u { print $3 }' "$1/etc/passwd"; }

import_dir() { # $1 dir, $2 tag, then --change instructions
  local dir=$1 tag=$2 c; shift 2
  local changes=()
  for c in "$@"; do changes+=(--change "$c"); done
  tar --numeric-owner --xattrs -C "$dir" -c . | docker import "${changes[@]}" - "$tag" >/dev/null
  rm -rf "$dir"
  log "imported $tag"
}

build_redis_offline() {
  local r u; r=$(rootfs redis "${PACKAGES[redis]}")
  u=$(uid_of "$r" redis)
  mkdir -p "$r/data"; chown "$u:$u" "$r/data"
  import_dir "$r" "${OFFLINE_IMAGE[redis]}" 'ENV PATH=/usr/sbin:/usr/bin:/sbin:/bin' \
    'WORKDIR /data' "USER $u:$u" 'EXPOSE 6379' 'CMD ["redis-server"]' \
    "LABEL studio.build=offline-debootstrap-$SUITE"
}

build_postgres_offline() {
  local r u bin; r=$(rootfs postgres "${PACKAGES[postgres]}")
  u=$(uid_of "$r" postgres)
  bin=$(ls -d "$r"/usr/lib/postgresql/*/bin | sort -V | tail -n1); bin=${bin#"$r"}
  # the cluster Debian's postinst made: the entrypoint makes its own in the volume
  rm -rf "$r"/var/lib/postgresql/* "$r"/etc/postgresql/*
  # /var/run is an absolute symlink to /run: write through $r/run, never through a path
  # whose symlink would resolve on the HOST
  [[ -d $r/run && ! -L $r/run && ! -L $r/var/lib ]] || die "unexpected rootfs layout in $r"
  mkdir -p "$r/var/lib/postgresql/data" "$r/run/postgresql"
  chown -R "$u:$u" "$r/var/lib/postgresql" "$r/run/postgresql"
  chmod 2775 "$r/run/postgresql"
  chmod 0700 "$r/var/lib/postgresql/data"
  install -m 0755 "$HERE/postgres-entrypoint.sh" "$r/usr/local/bin/docker-entrypoint.sh"
  import_dir "$r" "${OFFLINE_IMAGE[postgres]}" \
    "ENV PATH=$bin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    'ENV PGDATA=/var/lib/postgresql/data' 'ENV LANG=C.UTF-8' \
    "USER $u:$u" 'EXPOSE 5432' \
    'ENTRYPOINT ["docker-entrypoint.sh"]' 'CMD ["postgres"]' \
    "LABEL studio.build=offline-debootstrap-$SUITE"
}

build_prometheus_offline() {
  local r; r=$(rootfs prometheus "${PACKAGES[prometheus]}")
  mkdir -p "$r/prometheus" "$r/etc/prometheus"
  chown 65534:65534 "$r/prometheus"
  import_dir "$r" "${OFFLINE_IMAGE[prometheus]}" 'ENV PATH=/usr/bin:/bin' \
    'WORKDIR /prometheus' 'USER 65534:65534' 'EXPOSE 9090' \
    'ENTRYPOINT ["/usr/bin/prometheus"]' \
    'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]' \
    "LABEL studio.build=offline-debootstrap-$SUITE"
}

build_pybase_offline() {
  local r; r=$(rootfs pybase "${PACKAGES[pybase]}")
  import_dir "$r" "$APP_BASE_OFFLINE" 'ENV PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    'ENV LANG=C.UTF-8' "LABEL studio.build=offline-debootstrap-$SUITE"
}

# A service image: print NAME=image on stdout.
service() { # $1 redis|postgres|prometheus
  local svc=$1 var
  var=$(tr '[:lower:]' '[:upper:]' <<<"$svc")_IMAGE
  if [[ $MODE != offline ]] && pullable "${REGISTRY_IMAGE[$svc]}"; then
    log "$svc: registry image ${REGISTRY_IMAGE[$svc]}"
    echo "$var=${REGISTRY_IMAGE[$svc]}"
    return
  fi
  [[ $MODE != registry ]] || die "--registry: ${REGISTRY_IMAGE[$svc]} is neither present nor pullable"
  if present "${OFFLINE_IMAGE[$svc]}" && [[ ${STUDIO_REBUILD:-} != 1 ]]; then
    log "$svc: ${OFFLINE_IMAGE[$svc]} is present (STUDIO_REBUILD=1 rebuilds it)"
  else
    log "$svc: no registry: building ${OFFLINE_IMAGE[$svc]} from Debian packages"
    "build_${svc}_offline"
  fi
  echo "$var=${OFFLINE_IMAGE[$svc]}"
}

app() {
  local base=$APP_BASE_REGISTRY net=()
  if [[ $MODE == offline ]] || ! pullable "$base"; then
    [[ $MODE != registry ]] || die "--registry: $base is neither present nor pullable"
    base=$APP_BASE_OFFLINE
    if ! present "$base" || [[ ${STUDIO_REBUILD:-} == 1 ]]; then build_pybase_offline; fi
  fi
  # no bridge network: RUN steps reach PyPI only through the host's network
  docker network inspect bridge >/dev/null 2>&1 || net=(--network host)
  # A context of what the image needs, plus the CA bundle pip trusts in the build: the
  # host's (which a TLS-intercepting proxy's CA is in, where there is one), or
  # STUDIO_BUILD_CA_FILE.
  local ctx ca=${STUDIO_BUILD_CA_FILE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
  ctx=$(mktemp -d "$TMP_ROOT/app.XXXXXX")
  cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/requirements.lock" "$ROOT/executor" \
    "$ROOT/worker" "$ROOT/api_client" "$ctx/"
  find "$ctx" -name __pycache__ -prune -exec rm -rf {} +
  if [[ -r $ca ]]; then cp "$ca" "$ctx/build-ca.pem"; fi
  log "app: docker build -f deploy/Dockerfile --build-arg BASE=$base -> $APP_IMAGE"
  local old; old=$(docker image inspect --format '{{.Id}}' "$APP_IMAGE" 2>/dev/null || true)
  docker build -q --force-rm "${net[@]}" -f "$HERE/Dockerfile" --build-arg BASE="$base" \
    ${PIP_INDEX_URL:+--build-arg PIP_INDEX_URL="$PIP_INDEX_URL"} \
    ${STUDIO_APP_EXTRAS:+--build-arg EXTRAS="$STUDIO_APP_EXTRAS"} \
    --label studio.base="$base" -t "$APP_IMAGE" "$ctx" >&2
  # the previous build, now untagged: removed unless a container still uses it
  if [[ -n $old && $old != "$(docker image inspect --format '{{.Id}}' "$APP_IMAGE")" ]]; then
    docker rmi "$old" >/dev/null 2>&1 || true
  fi
  echo "APP_IMAGE=$APP_IMAGE"
}

TARGET=${1:-all}
MODE=auto
case ${2:-} in
  "") ;; --offline) MODE=offline ;; --registry) MODE=registry ;;
  *) sed -n '2,4p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
esac
docker info >/dev/null 2>&1 || die "cannot talk to the Docker engine (scripts/host-setup.sh starts one)"
case $TARGET in
  app) app ;;
  redis|postgres|prometheus) service "$TARGET" ;;
  all)
    # The debootstraps of the images that will be built offline run side by side (mostly
    # downloads and dpkg): on a cold cache this roughly halves the wait.
    warm=()
    for s in redis postgres prometheus; do
      if [[ $MODE == offline ]] || ! pullable "${REGISTRY_IMAGE[$s]}"; then
        { present "${OFFLINE_IMAGE[$s]}" && [[ ${STUDIO_REBUILD:-} != 1 ]]; } || warm+=("$s")
      fi
    done
    if [[ $MODE == offline ]] || ! pullable "$APP_BASE_REGISTRY"; then
      { present "$APP_BASE_OFFLINE" && [[ ${STUDIO_REBUILD:-} != 1 ]]; } || warm+=(pybase)
    fi
    pids=()
    for s in "${warm[@]}"; do
      [[ -s $(tarball_of "$s" "${PACKAGES[$s]}") ]] && continue
      rootfs "$s" "${PACKAGES[$s]}" --cache-only >/dev/null &
      pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || die "a rootfs build failed (above)"; done
    for s in redis postgres prometheus; do service "$s"; done
    app ;;
  *) sed -n '2,4p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
esac
