#!/usr/bin/env bash
# Build the Code-node sandbox images.
#
#   docker/build.sh python|typescript|all [--offline|--registry]
#   docker/build.sh --debian-packages   (the offline build's Debian names for requirements.txt)
#
# Tags: studio-code:1 and studio-code-ts:1 (override with STUDIO_CODE_IMAGE and
# STUDIO_CODE_TS_IMAGE).
#
# Two ways to build each image:
#   registry  `docker build` of docker/studio-code*/Dockerfile. Needs the base
#             image (python:3.12-slim, debian:trixie-slim) locally or pullable.
#   offline   No container registry at all: debootstrap a Debian rootfs from a
#             Debian mirror, add what the image needs, `docker import` it.
#             The rootfs (and the Deno cache) are cached as tarballs under
#             ${XDG_CACHE_HOME:-~/.cache}/studio-code/, so rebuilds take seconds.
# Default: registry if the base image is present or `docker pull` succeeds within
# STUDIO_PULL_TIMEOUT seconds, otherwise offline.
#
# Environment (all optional):
#   STUDIO_CODE_IMAGE, STUDIO_CODE_TS_IMAGE  image tags
#   STUDIO_PY_BASE        registry base for python      (python:3.12-slim)
#   STUDIO_TS_BASE        registry base for typescript  (debian:trixie-slim)
#   STUDIO_PULL_TIMEOUT   seconds allowed for `docker pull` of a base (20)
#   STUDIO_PY_REQUIREMENTS  another requirements file for --debian-packages (a check
#                         before editing docker/studio-code/requirements.txt)
#   STUDIO_BUILD_NETWORK  --network for `docker build` (e.g. host)
#   STUDIO_DEBIAN_MIRROR  Debian mirror for debootstrap (default: the host's apt mirror)
#   STUDIO_DEBIAN_SUITE   Debian suite for debootstrap  (trixie)
#   STUDIO_DENO           deno binary to put in the TS image (default: deno on PATH,
#                         else the project venv's .venv/bin/deno)
#   STUDIO_BUILD_CA_FILE  extra CA bundle (PEM) trusted by `deno cache` in the
#                         registry TS build, for TLS-intercepting proxies
#   NPM_CONFIG_REGISTRY   npm registry used by `deno cache` (deno honours it)
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")

PY_IMAGE=${STUDIO_CODE_IMAGE:-studio-code:1}
TS_IMAGE=${STUDIO_CODE_TS_IMAGE:-studio-code-ts:1}
PY_BASE=${STUDIO_PY_BASE:-python:3.12-slim}
TS_BASE=${STUDIO_TS_BASE:-debian:trixie-slim}
PULL_TIMEOUT=${STUDIO_PULL_TIMEOUT:-20}
# An engine started with --bridge=none gives `docker build` RUN steps no network at all;
# the host's network is the one that reaches the package registries then.
if [[ -z ${STUDIO_BUILD_NETWORK:-} ]] && command -v docker >/dev/null 2>&1 \
  && ! docker network inspect bridge >/dev/null 2>&1; then
  STUDIO_BUILD_NETWORK=host
fi
SUITE=${STUDIO_DEBIAN_SUITE:-trixie}
CACHE_DIR=${XDG_CACHE_HOME:-$HOME/.cache}/studio-code
DEPS_TS=$HERE/studio-code-ts/deps.ts

PY_REQUIREMENTS=${STUDIO_PY_REQUIREMENTS:-$HERE/studio-code/requirements.txt}
# PyPI name -> Debian package, for the offline build (docker/README.md has the table).
# A name not listed here maps to python3-<name>, which is Debian's rule for most packages.
declare -A PY_DEBIAN=(
  [python-dateutil]=python3-dateutil
  [pyyaml]=python3-yaml
  [beautifulsoup4]=python3-bs4
  [scikit-learn]=python3-sklearn
  [pillow]=python3-pil
  [msgpack]=python3-msgpack
)
py_requirements() { sed -e 's/#.*//' -e 's/[[:space:]]//g' "$PY_REQUIREMENTS" | grep -v '^$' || true; }
py_debian_packages() {
  local name out=python3
  while read -r name; do
    name=${name,,}
    out+=",${PY_DEBIAN[$name]:-python3-$name}"
  done < <(py_requirements)
  echo "$out"
}
PY_PACKAGES=$(py_debian_packages)
if [[ ${1:-} == --debian-packages ]]; then echo "$PY_PACKAGES"; exit 0; fi
# What makes the Python image: a label on it, so an image from an older recipe is told apart.
py_recipe_hash() {
  cat "$HERE/studio-code/Dockerfile" "$PY_REQUIREMENTS" "$HERE/studio-code/record_modules.py" \
    | sha
}
TS_PACKAGES=                  # plain minbase: deno needs only libc and libgcc_s
# Bump when the rootfs recipe (stripping below) changes, to invalidate cached rootfs.
RECIPE=1

# The sandbox policy the executor uses; the smoke tests run under it.
# shellcheck disable=SC2054 # the commas are inside --tmpfs options
SANDBOX_FLAGS=(--rm -i --network none --read-only
  --tmpfs /tmp:rw,nosuid,nodev,noexec,size=64m,mode=1777
  --cap-drop ALL --security-opt no-new-privileges --user 65534:65534
  --security-opt "seccomp=$ROOT/executor/runtimes/docker/seccomp.json"
  --memory 256m --memory-swap 256m --cpus 0.5 --pids-limit 64 --log-driver none --ipc none
  --ulimit core=0 --ulimit msgqueue=0 --hostname sandbox
  -e HOME=/tmp)

log() { printf '[build.sh] %s\n' "$*" >&2; }
die() { printf '[build.sh] ERROR: %s\n' "$*" >&2; exit 1; }

usage() {
  sed -n '2,4p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# Scratch space for this run (created in main, before any $(...) subshell uses it).
TMP_ROOT=
cleanup() { if [[ -n $TMP_ROOT && -d $TMP_ROOT ]]; then rm -rf "$TMP_ROOT"; fi; }
trap cleanup EXIT
tmpdir() { mktemp -d "$TMP_ROOT/$1.XXXXXX"; } # a fresh directory under TMP_ROOT

sha() { sha256sum | cut -c1-16; }

# ---------------------------------------------------------------- helpers

need_docker() {
  command -v docker >/dev/null 2>&1 || die "docker CLI not found"
  docker info >/dev/null 2>&1 || die "cannot talk to the Docker engine (is dockerd running? are you in the docker group?)"
}

# True if $1 is present locally, or pulls within PULL_TIMEOUT seconds.
base_available() {
  local base=$1
  if docker image inspect "$base" >/dev/null 2>&1; then
    log "base image $base is present locally"
    return 0
  fi
  log "trying: docker pull $base (timeout ${PULL_TIMEOUT}s)"
  if timeout "$PULL_TIMEOUT" docker pull -q "$base" >/dev/null 2>&1; then
    return 0
  fi
  log "base image $base is not available"
  return 1
}

# The Debian mirror apt uses on this host (deb822 or one-line sources), else deb.debian.org.
debian_mirror() {
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

# Old image ID behind tag $1 (empty if none).
image_id() { docker image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

# After re-tagging, drop the previous image if it is now untagged and unused.
drop_old() {
  local old=$1 tag=$2 new
  new=$(image_id "$tag")
  if [[ -n $old && $old != "$new" ]]; then
    if [[ -z $(docker image inspect --format '{{join .RepoTags ""}}' "$old" 2>/dev/null) ]]; then
      docker rmi "$old" >/dev/null 2>&1 || true
    fi
  fi
}

# Print the path of a cached, stripped Debian rootfs tarball with packages $1,
# building it with debootstrap on a cache miss.
rootfs_tarball() {
  local include=$1 arch key out root mirror
  arch=$(dpkg --print-architecture 2>/dev/null || echo amd64)
  key=$(printf 'recipe=%s suite=%s arch=%s variant=minbase include=%s\n' \
    "$RECIPE" "$SUITE" "$arch" "$include" | sha)
  out=$CACHE_DIR/rootfs-$SUITE-$arch-$key.tar
  if [[ -s $out ]]; then
    log "using cached rootfs $out"
    echo "$out"; return
  fi
  command -v debootstrap >/dev/null 2>&1 \
    || die "debootstrap not found; install debootstrap: apt-get install -y debootstrap"
  [[ $(id -u) -eq 0 ]] || die "debootstrap needs root; run build.sh as root (or use --registry)"
  mirror=$(debian_mirror)
  root=$(tmpdir rootfs)
  log "debootstrap --variant=minbase ${include:+--include=$include }$SUITE from $mirror (takes ~1 min)"
  if ! debootstrap --variant=minbase ${include:+--include="$include"} --arch="$arch" \
      "$SUITE" "$root" "$mirror" >"$TMP_ROOT/debootstrap.log" 2>&1; then
    tail -n 30 "$TMP_ROOT/debootstrap.log" >&2
    [[ -f $root/debootstrap/debootstrap.log ]] && tail -n 30 "$root/debootstrap/debootstrap.log" >&2
    die "debootstrap of $SUITE from $mirror failed (set STUDIO_DEBIAN_MIRROR to a reachable Debian mirror)"
  fi
  strip_rootfs "$root"
  mkdir -p "$CACHE_DIR"
  tar --numeric-owner --xattrs -C "$root" -cf "$out.part" \
    --exclude=./dev/* --exclude=./proc/* --exclude=./sys/* --exclude=./run/* .
  mv "$out.part" "$out"
  rm -rf "$root"
  log "cached rootfs $out ($(du -h "$out" | cut -f1))"
  echo "$out"
}

strip_rootfs() {
  local r=$1
  # package lists, caches, logs, docs (keep copyright files), man pages, locales
  rm -rf "$r"/var/lib/apt/lists/* "$r"/var/cache/apt/* "$r"/var/cache/debconf/*-old \
    "$r"/var/log/* "$r"/var/tmp/* "$r"/tmp/* "$r"/root/.cache \
    "$r"/usr/share/man/* "$r"/usr/share/info/* "$r"/usr/share/locale/* \
    "$r"/usr/share/lintian "$r"/usr/share/linda "$r"/debootstrap
  find "$r"/usr/share/doc -mindepth 1 -not -type d -not -name copyright -delete 2>/dev/null || true
  find "$r"/usr/share/doc -mindepth 1 -type d -empty -delete 2>/dev/null || true
  # Docker provides these at run time.
  : >"$r"/etc/resolv.conf
  echo localhost >"$r"/etc/hostname
  [[ -e $r/etc/machine-id ]] && : >"$r"/etc/machine-id
  return 0
}

# docker import a directory or tarball ($1) as tag $2 with --change args $3...
import_rootfs() {
  local src=$1 tag=$2; shift 2
  local changes=() c old
  for c in "$@"; do changes+=(--change "$c"); done
  old=$(image_id "$tag")
  if [[ -d $src ]]; then
    tar --numeric-owner --xattrs -C "$src" -c . | docker import "${changes[@]}" - "$tag" >/dev/null
  else
    docker import "${changes[@]}" "$src" "$tag" >/dev/null
  fi
  drop_old "$old" "$tag"
}

find_deno() {
  local d=${STUDIO_DENO:-}
  if [[ -z $d ]]; then d=$(command -v deno 2>/dev/null || true); fi
  if [[ -z $d && -x $ROOT/.venv/bin/deno ]]; then d=$ROOT/.venv/bin/deno; fi
  [[ -n $d && -x $d ]] || die "no deno binary: set STUDIO_DENO or install the project (pip install deno)"
  log "deno binary: $d ($("$d" --version | head -n1))"
  echo "$d"
}

# ---------------------------------------------------------------- python

check_python() {
  log "smoke test $PY_IMAGE under the sandbox policy"
  docker run "${SANDBOX_FLAGS[@]}" "$PY_IMAGE" \
    python3 -I -c 'import json, sys, importlib
m = json.load(open("/usr/share/studio-code/modules.json"))
for names in m["packages"].values():
    for n in names: importlib.import_module(n)
print("python", sys.version.split()[0], "imports", sorted(m["packages"]))' </dev/null >&2 \
    || die "$PY_IMAGE failed its smoke test"
}

build_python_registry() {
  log "python: REGISTRY path (docker build FROM $PY_BASE) -> $PY_IMAGE"
  local old; old=$(image_id "$PY_IMAGE")
  docker build --force-rm ${STUDIO_BUILD_NETWORK:+--network "$STUDIO_BUILD_NETWORK"} \
    --build-arg BASE="$PY_BASE" --label studio.image=python \
    --label "studio.recipe-sha=$(py_recipe_hash)" \
    -t "$PY_IMAGE" "$HERE/studio-code"
  drop_old "$old" "$PY_IMAGE"
}

build_python_offline() {
  log "python: OFFLINE path (debootstrap $SUITE + docker import) -> $PY_IMAGE"
  local tarball root
  tarball=$(rootfs_tarball "$PY_PACKAGES")
  root=$(tmpdir pyroot)
  tar --numeric-owner -C "$root" -xf "$tarball"
  mkdir -p "$root/usr/share/studio-code"
  cp "$PY_REQUIREMENTS" "$HERE/studio-code/record_modules.py" "$root/usr/share/studio-code/"
  # The rootfs's own python3 records what it can import (fails if a package is missing).
  chroot "$root" /usr/bin/python3 /usr/share/studio-code/record_modules.py \
    /usr/share/studio-code/requirements.txt >"$root/usr/share/studio-code/modules.json" \
    || die "the offline python image lacks a package of $PY_REQUIREMENTS (Debian names: $PY_PACKAGES)"
  import_rootfs "$root" "$PY_IMAGE" \
    'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    'ENV LANG=C.UTF-8' \
    'WORKDIR /tmp' \
    'USER 65534:65534' \
    'LABEL studio.image=python' \
    "LABEL studio.recipe-sha=$(py_recipe_hash)" \
    "LABEL studio.build=offline-debootstrap-$SUITE"
  rm -rf "$root"
}

# ---------------------------------------------------------------- typescript

deps_hash() { sha <"$DEPS_TS"; }

check_typescript() {
  log "smoke test $TS_IMAGE under the sandbox policy"
  docker run "${SANDBOX_FLAGS[@]}" -e DENO_DIR=/deno-dir -e DENO_NO_UPDATE_CHECK=1 -e NO_COLOR=1 \
    -e DENO_EMIT_CACHE_MODE=disable \
    "$TS_IMAGE" \
    deno run --no-remote --cached-only --no-prompt --no-config --no-lock \
      --v8-flags=--max-old-space-size=192 - >&2 <<'EOF' || die "$TS_IMAGE failed its smoke test"
import { z } from "npm:zod@3";
import { format } from "npm:date-fns@4";
const v = z.object({ n: z.number() }).parse({ n: 1 });
console.log("deno", Deno.version.deno, "zod ok", v.n, "date-fns", format(new Date(0), "yyyy-MM-dd"));
EOF
}

# Print the path of a tarball of a Deno cache for deps.ts made on this host with
# $1 (deno), cached by deno version + deps.ts so a rebuild needs no npm registry.
deno_cache_tarball() {
  local deno=$1 key out dir ver
  ver=$("$deno" --version | head -n1)
  key=$(printf 'recipe=%s\n%s\n%s\n' "$RECIPE" "$ver" "$(cat "$DEPS_TS")" | sha)
  out=$CACHE_DIR/deno-dir-$key.tar
  if [[ -s $out ]]; then
    log "using cached Deno cache $out"
    echo "$out"; return
  fi
  dir=$(tmpdir denocache)
  mkdir -p "$dir/opt/studio-code"
  cp "$DEPS_TS" "$dir/opt/studio-code/deps.ts"
  log "deno cache --no-config --no-lock deps.ts (npm registry: ${NPM_CONFIG_REGISTRY:-https://registry.npmjs.org})"
  if ! (cd "$dir" && DENO_DIR="$dir/deno-dir" DENO_NO_UPDATE_CHECK=1 NO_COLOR=1 \
        "$deno" cache --no-config --no-lock "$dir/opt/studio-code/deps.ts" >&2); then
    die "deno cache failed (is the npm registry reachable? set NPM_CONFIG_REGISTRY for a mirror)"
  fi
  # Keep only the npm package cache: gen/ is the emit cache of deps.ts at its
  # host path, and the *_cache_v2 SQLite files (left in WAL mode) cannot be
  # opened read-write at run time anyway (deno then uses in-memory caches).
  rm -rf "$dir/deno-dir/gen" "$dir/deno-dir/latest.txt" "$dir"/deno-dir/*_cache_v2*
  chmod -R a+rX "$dir/deno-dir" "$dir/opt"
  mkdir -p "$CACHE_DIR"
  tar --numeric-owner --owner=0 --group=0 -C "$dir" -cf "$out.part" deno-dir opt
  mv "$out.part" "$out"
  echo "$out"
}

build_typescript_registry() {
  log "typescript: REGISTRY path (docker build FROM $TS_BASE) -> $TS_IMAGE"
  local deno ctx old
  deno=$(find_deno)
  ctx=$(tmpdir ctx)
  cp "$HERE/studio-code-ts/Dockerfile" "$DEPS_TS" "$ctx/"
  cp "$deno" "$ctx/deno"
  if [[ -n ${STUDIO_BUILD_CA_FILE:-} ]]; then
    [[ -r $STUDIO_BUILD_CA_FILE ]] || die "STUDIO_BUILD_CA_FILE=$STUDIO_BUILD_CA_FILE is not readable"
    cp "$STUDIO_BUILD_CA_FILE" "$ctx/extra-ca.pem"
  fi
  old=$(image_id "$TS_IMAGE")
  docker build --force-rm ${STUDIO_BUILD_NETWORK:+--network "$STUDIO_BUILD_NETWORK"} \
    --build-arg BASE="$TS_BASE" \
    --label studio.image=typescript --label "studio.deps-sha=$(deps_hash)" \
    -t "$TS_IMAGE" "$ctx"
  drop_old "$old" "$TS_IMAGE"
}

build_typescript_offline() {
  log "typescript: OFFLINE path (debootstrap $SUITE + host deno cache + docker import) -> $TS_IMAGE"
  local deno base cache root
  deno=$(find_deno)
  base=$(rootfs_tarball "$TS_PACKAGES")
  cache=$(deno_cache_tarball "$deno")
  root=$(tmpdir tsroot)
  tar --numeric-owner -C "$root" -xf "$base"
  tar --numeric-owner -C "$root" -xf "$cache"
  install -m 0755 "$deno" "$root/usr/local/bin/deno"
  chmod -R a+rX "$root/deno-dir"
  import_rootfs "$root" "$TS_IMAGE" \
    'ENV PATH=/usr/local/bin:/usr/bin:/bin' \
    'ENV DENO_DIR=/deno-dir' \
    'ENV DENO_NO_UPDATE_CHECK=1' \
    'ENV NO_COLOR=1' \
    'ENV DENO_EMIT_CACHE_MODE=disable' \
    'WORKDIR /tmp' \
    'USER 65534:65534' \
    'LABEL studio.image=typescript' \
    "LABEL studio.deps-sha=$(deps_hash)" \
    "LABEL studio.build=offline-debootstrap-$SUITE"
  rm -rf "$root"
}

# ---------------------------------------------------------------- main

build_one() { # $1 = python|typescript
  local lang=$1 base start
  start=$SECONDS
  if [[ $lang == python ]]; then base=$PY_BASE; else base=$TS_BASE; fi
  case $MODE in
    registry)
      base_available "$base" || die "--registry: base image $base is neither present nor pullable"
      "build_${lang}_registry" ;;
    offline)
      "build_${lang}_offline" ;;
    auto)
      if base_available "$base"; then
        # A base that pulls is no promise that the build's own downloads work (pip, npm):
        # when the registry build fails, the offline path still can.
        if ! ( "build_${lang}_registry" ); then
          log "$lang: the registry build failed; falling back to the offline path"
          "build_${lang}_offline"
        fi
      else
        log "$lang: no container registry; falling back to the offline path"
        "build_${lang}_offline"
      fi ;;
  esac
  "check_${lang}"
  log "$lang: done in $((SECONDS - start))s: $(docker image inspect --format '{{index .RepoTags 0}} {{.Id}} {{.Size}} bytes' \
    "$([[ $lang == python ]] && echo "$PY_IMAGE" || echo "$TS_IMAGE")")"
}

TARGET=${1:-}
MODE=auto
case ${2:-} in
  "") ;;
  --offline) MODE=offline ;;
  --registry) MODE=registry ;;
  *) usage ;;
esac
[[ $# -le 2 ]] || usage
case $TARGET in
  python|typescript|all) ;;
  -h|--help|*) usage ;;
esac

need_docker
TMP_ROOT=$(mktemp -d "${TMPDIR:-/tmp}/studio-build.XXXXXX")
if [[ $TARGET == python || $TARGET == all ]]; then build_one python; fi
if [[ $TARGET == typescript || $TARGET == all ]]; then build_one typescript; fi
