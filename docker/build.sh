#!/usr/bin/env bash
# Build the Code-node sandbox images.
#
#   docker/build.sh python|typescript|all [--offline|--registry]
#   docker/build.sh --debian-packages   (Debian's names for requirements.txt: the fallback)
#
# `studio-code image build --python-packages ... --ts-packages ...` runs this script with
# the lists it is given (docs/operations.md, "Adding a package"); `make image` runs that
# command with the repository's lists (studio-code/requirements.txt, studio-code-ts/deps.ts).
#
# Tags: studio-code:1 and studio-code-ts:1 (override with STUDIO_CODE_IMAGE and
# STUDIO_CODE_TS_IMAGE).
#
# Two ways to build each image:
#   registry  `docker build` of docker/studio-code*/Dockerfile. Needs the base
#             image (python:3.12-slim, debian:trixie-slim) locally or pullable.
#   offline   No container registry at all: debootstrap a Debian rootfs from a
#             Debian mirror, add what the image needs, `docker import` it. Python
#             packages are PyPI wheels for the rootfs's own Python, fetched by the
#             host's pip (PyPI, the mirror of PIP_INDEX_URL..., or STUDIO_PY_WHEELS);
#             a requirement with no wheel falls back to Debian's python3-<name>.
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
#   STUDIO_PY_REQUIREMENTS  the Python requirements (pip's format: name or name==1.2.*;
#                         default docker/studio-code/requirements.txt)
#   STUDIO_PY_WHEELS      a folder of wheels: Python packages come from it only
#                         (pip --no-index --find-links), for air-gapped sites
#   STUDIO_PY_CONSTRAINTS a pip constraints file (e.g. an image's packages.lock) for
#                         every distribution installed, dependencies included
#                         (`studio-code image build` hands a copy it wrote from the
#                         checked name==version lines: pip obeys options in the file)
#   STUDIO_PY_SOURCE      offline python packages: wheels (default; Debian's package for
#                         a requirement with no wheel) or debian (Debian's only)
#   STUDIO_PIP            the host's pip for the offline build (python3 -m pip)
#   STUDIO_TS_DEPS        the TypeScript deps file (default docker/studio-code-ts/deps.ts)
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST  pip's own: a PyPI mirror
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
DEPS_TS=${STUDIO_TS_DEPS:-$HERE/studio-code-ts/deps.ts}

PY_REQUIREMENTS=${STUDIO_PY_REQUIREMENTS:-$HERE/studio-code/requirements.txt}
PY_WHEELS=${STUDIO_PY_WHEELS:-}
PY_CONSTRAINTS=${STUDIO_PY_CONSTRAINTS:-}
PY_SOURCE=${STUDIO_PY_SOURCE:-wheels}
read -r -a PIP <<<"${STUDIO_PIP:-python3 -m pip}"
# PyPI name -> Debian package, for the offline build's fallback (docker/README.md has the table).
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
# The Debian packages of requirements $@ (each a name with or without a version).
py_debian_names() {
  local req name out=python3
  for req in "$@"; do
    name=${req%%[<>=!~;[]*}
    name=${name,,}
    out+=",${PY_DEBIAN[$name]:-python3-$name}"
  done
  echo "$out"
}
if [[ ${1:-} == --debian-packages ]]; then
  mapfile -t reqs < <(py_requirements)
  py_debian_names "${reqs[@]}"
  exit 0
fi
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

# ---------------------------------------------------------------- labels

# Put labels $2... (key=value) on image $1, in place: a `docker build` FROM the image's own
# id (local, so no registry) adds no layer. The old image is removed when nothing uses it.
add_labels() {
  local tag=$1 old lines="" kv; shift
  old=$(image_id "$tag")
  for kv in "$@"; do lines+="LABEL ${kv%%=*}=\"${kv#*=}\""$'\n'; done
  printf 'FROM %s\n%s' "$old" "$lines" | docker build -q -t "$tag" - >/dev/null 2>"$TMP_ROOT/label.log" \
    || { cat "$TMP_ROOT/label.log" >&2; die "could not label $tag"; }
  drop_old "$old" "$tag"
}

# ---------------------------------------------------------------- python

# The image's own packages, as the smoke test found them: "name==version,..." (listed
# packages) on the first line, the Python version on the second.
python_versions() {
  docker run --rm --network none --user 65534:65534 "$PY_IMAGE" \
    cat /usr/share/studio-code/modules.json </dev/null \
    | python3 -c 'import json, sys
m = json.load(sys.stdin)
v = m.get("versions") or {}
print(",".join("%s==%s" % (n, v.get(n, "?")) for n in m["packages"]))
print(m["python"])'
}

check_python() {
  log "smoke test $PY_IMAGE under the sandbox policy: import each listed package"
  docker run "${SANDBOX_FLAGS[@]}" "$PY_IMAGE" \
    python3 -I -c 'import json, sys, importlib
m = json.load(open("/usr/share/studio-code/modules.json"))
for names in m["packages"].values():
    for n in names: importlib.import_module(n)
v = m.get("versions", {})
print("python", sys.version.split()[0], "imports", ", ".join("%s %s" % (p, v.get(p, "?")) for p in sorted(m["packages"])))' </dev/null >&2 \
    || die "$PY_IMAGE failed its smoke test (a listed package does not import under the sandbox policy)"
  local versions python
  { read -r versions; read -r python; } < <(python_versions)
  add_labels "$PY_IMAGE" "studio.packages=$versions" "studio.python=$python"
}

# The folder of a build context: Dockerfile, record_modules.py, the requirements, and the
# wheels and constraints when given (the first stage installs from them; the image keeps
# neither).
python_context() {
  local ctx
  ctx=$(tmpdir pyctx)
  cp "$HERE/studio-code/Dockerfile" "$HERE/studio-code/record_modules.py" "$ctx/"
  cp "$PY_REQUIREMENTS" "$ctx/requirements.txt"
  if [[ -n $PY_CONSTRAINTS ]]; then cp "$PY_CONSTRAINTS" "$ctx/constraints.txt"; fi
  if [[ -n $PY_WHEELS ]]; then cp "$PY_WHEELS"/*.whl "$ctx/" 2>/dev/null || true; fi
  echo "$ctx"
}

build_python_registry() {
  log "python: REGISTRY path (docker build FROM $PY_BASE) -> $PY_IMAGE"
  local old ctx pip_args=()
  ctx=$(python_context)
  if [[ -n $PY_WHEELS ]]; then pip_args+=(--no-index --find-links /tmp/build); fi
  if [[ -n $PY_CONSTRAINTS ]]; then pip_args+=(-c /tmp/build/constraints.txt); fi
  old=$(image_id "$PY_IMAGE")
  # PIP_INDEX_URL & co. are passed on when set (a --build-arg without a value takes the
  # variable of this environment).
  docker build --force-rm ${STUDIO_BUILD_NETWORK:+--network "$STUDIO_BUILD_NETWORK"} \
    --build-arg BASE="$PY_BASE" --build-arg PIP_ARGS="${pip_args[*]}" \
    --build-arg PIP_INDEX_URL --build-arg PIP_EXTRA_INDEX_URL --build-arg PIP_TRUSTED_HOST \
    --label studio.image=python \
    --label "studio.recipe-sha=$(py_recipe_hash)" \
    -t "$PY_IMAGE" "$ctx" \
    || die "python: docker build FROM $PY_BASE with $(py_requirements | paste -sd, -) failed (pip, or a listed package it did not install: its message is above)"
  drop_old "$old" "$PY_IMAGE"
}

# "3.13 2.41 x86_64 /usr/local/lib/python3.13/dist-packages": the Python of rootfs $1, its
# C library and machine, and the folder its site module adds first.
rootfs_python() {
  chroot "$1" /usr/bin/python3 -c 'import platform, site, sys
print("%d.%d" % sys.version_info[:2], platform.libc_ver()[1], platform.machine(), site.getsitepackages()[0])'
}

# pip's options for wheels that run on CPython $1 (3.13) with glibc $2 (2.41) on $3 (x86_64):
# binary only, the interpreter's ABI, every manylinux tag that glibc satisfies.
pip_target() {
  local ver=$1 minor=${2#*.} machine=$3 i
  PIP_TARGET=(--only-binary=:all: --implementation cp --python-version "$ver" --abi "cp${ver/./}")
  for ((i = minor; i >= 17; i--)); do PIP_TARGET+=(--platform "manylinux_2_${i}_$machine"); done
  PIP_TARGET+=(--platform "manylinux2014_$machine" --platform "manylinux2010_$machine" \
    --platform "manylinux1_$machine")
  if [[ -n $PY_WHEELS ]]; then PIP_TARGET+=(--no-index --find-links "$PY_WHEELS"); fi
  if [[ -n $PY_CONSTRAINTS ]]; then PIP_TARGET+=(-c "$PY_CONSTRAINTS"); fi
}

# Each requirement of modules.json $1 is met by the version installed (a Debian package may
# be another version than the one asked for); the host's pip brings the version parser.
check_versions() {
  python3 - "$1" <<'PY' || die "the image has another version than the one asked for (above)"
import json, sys
try:
    from pip._vendor.packaging.requirements import Requirement
except ImportError:
    try:
        from packaging.requirements import Requirement
    except ImportError:
        sys.exit(0)  # nothing to parse versions with here: the lock still says what it is
m = json.load(open(sys.argv[1]))
bad = []
for text in m.get("requirements", []):
    req = Requirement(text)
    have = m.get("versions", {}).get(req.name)
    if req.specifier and (have is None or not req.specifier.contains(have, prereleases=True)):
        bad.append(f"{text} (the image has {req.name} {have})")
if bad:
    sys.exit("[build.sh] not the version asked for: " + "; ".join(bad))
PY
}

build_python_offline() {
  log "python: OFFLINE path (debootstrap $SUITE + PyPI wheels + docker import) -> $PY_IMAGE"
  local tarball root="" ver glibc machine site req dl wheel_reqs=() debian_reqs=() reqs
  mapfile -t reqs < <(py_requirements)
  command -v "${PIP[0]}" >/dev/null && "${PIP[@]}" --version >/dev/null 2>&1 \
    || die "no pip on this host (${PIP[*]}): set STUDIO_PIP, e.g. STUDIO_PIP='.venv/bin/python -m pip'"
  if [[ $PY_SOURCE == debian ]]; then
    debian_reqs=("${reqs[@]}")
  elif [[ ${#reqs[@]} -gt 0 ]]; then
    # The wheels are for the rootfs's own Python: ask it which one it is.
    root=$(tmpdir pyroot)
    tar --numeric-owner -C "$root" -xf "$(rootfs_tarball python3)"
    read -r ver glibc machine site < <(rootfs_python "$root") || true
    [[ -n ${site:-} ]] || die "could not run the rootfs's python3 (chroot) to learn its version"
    pip_target "$ver" "$glibc" "$machine"
    dl=$(tmpdir wheels)
    log "pip download (${PY_WHEELS:+--no-index --find-links $PY_WHEELS, }Python $ver, glibc $glibc, $machine): ${reqs[*]}"
    if "${PIP[@]}" download -q -d "$dl" "${PIP_TARGET[@]}" "${reqs[@]}" >"$TMP_ROOT/pip.log" 2>&1; then
      wheel_reqs=("${reqs[@]}")
    else
      # Which ones have no wheel: each on its own; those go to Debian.
      for req in "${reqs[@]}"; do
        if "${PIP[@]}" download -q -d "$dl" "${PIP_TARGET[@]}" "$req" >"$TMP_ROOT/pip-one.log" 2>&1; then
          wheel_reqs+=("$req")
        else
          log "no wheel of $req for Python $ver on $machine: $(grep -E '^ERROR' "$TMP_ROOT/pip-one.log" | tail -n1)"
          debian_reqs+=("$req")
        fi
      done
      if [[ ${#debian_reqs[@]} -eq 0 ]]; then
        grep -v 'is ignored' "$TMP_ROOT/pip.log" | tail -n 20 >&2
        die "pip could not resolve ${reqs[*]} together (each alone has a wheel): see pip's message above"
      fi
    fi
  fi
  local include=python3
  if [[ ${#debian_reqs[@]} -gt 0 ]]; then
    include=$(py_debian_names "${debian_reqs[@]}")
    log "Debian's packages for ${debian_reqs[*]}: $include"
  fi
  if [[ $include != python3 || -z $root ]]; then
    tarball=$(rootfs_tarball "$include") \
      || die "no wheel and no Debian package for ${debian_reqs[*]} (Debian names: $include): add a wheel to STUDIO_PY_WHEELS, or fix the name"
    [[ -z $root ]] || rm -rf "$root"
    root=$(tmpdir pyroot)
    tar --numeric-owner -C "$root" -xf "$tarball"
  fi
  if [[ ${#wheel_reqs[@]} -gt 0 ]]; then
    log "pip install --target $site: ${wheel_reqs[*]}"
    # --no-compile: the host's Python is not the image's; the image compiles below.
    "${PIP[@]}" install -q --no-compile --no-index --find-links "$dl" --target "$root$site" \
      "${PIP_TARGET[@]}" "${wheel_reqs[@]}" >"$TMP_ROOT/pip.log" 2>&1 \
      || { tail -n 20 "$TMP_ROOT/pip.log" >&2; die "pip install of ${wheel_reqs[*]} into the image failed"; }
    rm -rf "$root$site/bin"
    chroot "$root" /usr/bin/python3 -m compileall -q "$site" >/dev/null \
      || die "python3 -m compileall $site failed in the image"
  fi
  mkdir -p "$root/usr/share/studio-code"
  cp "$PY_REQUIREMENTS" "$root/usr/share/studio-code/requirements.txt"
  cp "$HERE/studio-code/record_modules.py" "$root/usr/share/studio-code/"
  # The rootfs's own python3 records what it can import and the versions (fails if a
  # package is missing, or a Debian package's version is not the one asked for).
  chroot "$root" /usr/bin/python3 /usr/share/studio-code/record_modules.py \
    /usr/share/studio-code/requirements.txt /usr/share/studio-code/packages.lock \
    >"$root/usr/share/studio-code/modules.json" \
    || die "the offline python image lacks a package of $PY_REQUIREMENTS (the line above names it)"
  check_versions "$root/usr/share/studio-code/modules.json"
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

# The import specifiers of deps.ts, one a line (npm:zod@3 ...).
deps_specs() { sed 's#//.*##' "$DEPS_TS" | grep -oE '"(npm|jsr):[^",]+"' | tr -d '"'; }
deps_hash() { deps_specs | sha; }

# "npm:zod@3.25.76,npm:date-fns@4.4.0": each spec of deps.ts at the version the image's
# cache holds (the highest of its major), read from the image's /deno-dir.
typescript_versions() {
  docker run --rm --network none --user 65534:65534 "$TS_IMAGE" sh -c \
    'for d in /deno-dir/npm/*/*/* /deno-dir/npm/*/@*/*/*; do [ -f "$d/package.json" ] && echo "$d"; done' \
    </dev/null | python3 -c 'import re, sys
have = {}
for line in sys.stdin:
    parts = line.strip().split("/")[4:]  # registry host, [@scope,] name, version
    have.setdefault("/".join(parts[:-1]), []).append(parts[-1])
def key(v):
    return [int(x) if x.isdigit() else -1 for x in re.split(r"[.+-]", v)]
out = []
for spec in sys.argv[1:]:
    reg, _, rest = spec.partition(":")
    name, _, major = rest.rpartition("@")
    found = sorted((v for v in have.get(name, []) if v.split(".")[0] == major), key=key)
    out.append(f"{reg}:{name}@{found[-1]}" if found else f"{spec}")
print(",".join(out))' $(deps_specs)
}

check_typescript() {
  log "smoke test $TS_IMAGE under the sandbox policy: import each package of deps.ts"
  local spec i=0 program="" specs
  mapfile -t specs < <(deps_specs)
  for spec in "${specs[@]}"; do program+="import * as m$i from \"$spec\";"$'\n'; i=$((i + 1)); done
  program+="console.log(\"deno\", Deno.version.deno, \"imports\", $(printf '"%s", ' "${specs[@]}")[$(for ((j = 0; j < i; j++)); do printf 'Object.keys(m%d).length, ' "$j"; done)]);"
  docker run "${SANDBOX_FLAGS[@]}" -e DENO_DIR=/deno-dir -e DENO_NO_UPDATE_CHECK=1 -e NO_COLOR=1 \
    -e DENO_EMIT_CACHE_MODE=disable \
    "$TS_IMAGE" \
    deno run --no-remote --cached-only --no-prompt --no-config --no-lock \
      --v8-flags=--max-old-space-size=192 - >&2 <<<"$program" \
    || die "$TS_IMAGE failed its smoke test (a package of deps.ts does not import under the sandbox policy)"
  add_labels "$TS_IMAGE" "studio.packages=$(typescript_versions)"
}

# Print the path of a tarball of a Deno cache for deps.ts made on this host with
# $1 (deno), cached by deno version + deps.ts so a rebuild needs no npm registry.
deno_cache_tarball() {
  local deno=$1 key out dir ver
  ver=$("$deno" --version | head -n1)
  key=$(printf 'recipe=%s\n%s\n%s\n' "$RECIPE" "$ver" "$(deps_specs)" | sha)
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
    die "deno cache of $(deps_specs | paste -sd, -) failed: a package or version that does not exist (named above), or no npm registry (set NPM_CONFIG_REGISTRY for a mirror)"
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
  cp "$HERE/studio-code-ts/Dockerfile" "$ctx/"
  cp "$DEPS_TS" "$ctx/deps.ts"
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
