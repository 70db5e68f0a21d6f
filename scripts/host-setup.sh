#!/usr/bin/env bash
# Make this Debian/Ubuntu machine able to run studio-code: `make demo`, `make test`, `make up`
# and .ci/run call it first. It checks, and installs or starts only what is missing, saying
# what (as root, or through sudo):
#
#   packages  docker.io (dockerd), docker-compose, debootstrap (offline image builds),
#             redis-server (tests start their own), python3-venv (ensurepip, for `make
#             install`), python3-pydantic + python3-dateutil (the subprocess runtime's
#             /usr/bin/python3 needs what the sandbox image has)
#   dockerd   started when no engine answers: --bridge=none --iptables=false
#             --ip6tables=false (sandboxes use no network, and these machines must not create
#             a private-range network); log in /var/log/dockerd-studio.log
#   postgres  an installed but stopped cluster is started (the run store tests use it)
#   engine    says which Docker, containerd and runc it found, and WARNS when their version
#             has a known container escape of executor/runtimes/docker/known_escapes.toml (asked
#             with the system's python3 -S: no project start-up), naming the upgrade path
#
# On a machine that has all of it, it changes nothing and takes well under a second.
# STUDIO_HOST_SETUP=0 skips it (a machine managed otherwise).
set -Eeuo pipefail
[[ ${STUDIO_HOST_SETUP:-1} == 0 ]] && exit 0
export DEBIAN_FRONTEND=noninteractive

log() { printf '[host-setup] %s\n' "$*" >&2; }
SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { log "not root and no sudo: install the packages below by hand"; }
  SUDO=(sudo)
fi

need=()
command -v dockerd >/dev/null && command -v docker >/dev/null || need+=(docker.io)
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 \
  || need+=(docker-compose)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v redis-server >/dev/null || need+=(redis-server)
# Python modules, by file (a Python start costs 50-250 ms): ensurepip (venv alone is stdlib on
# Debian, pip in a venv needs ensurepip), and for /usr/bin/python3 pydantic and dateutil
has_py() {
  compgen -G "/usr/lib/python3*/$1" >/dev/null || compgen -G "/usr/lib/python3/dist-packages/$1" >/dev/null \
    || compgen -G "/usr/local/lib/python3*/dist-packages/$1" >/dev/null
}
py=()
has_py ensurepip/__init__.py || py+=(python3-venv)
has_py pydantic/__init__.py || py+=(python3-pydantic)
has_py dateutil/__init__.py || py+=(python3-dateutil)
need+=("${py[@]}")
if ((${#need[@]})); then
  log "installing: ${need[*]}"
  "${SUDO[@]}" apt-get update -qq
  # with Recommends: on trixie the docker CLI (docker-cli) is only a Recommends of docker.io
  "${SUDO[@]}" apt-get install -y -qq "${need[@]}" >/dev/null
fi

answers() { "$@" version --format '{{.Server.Version}}' >/dev/null 2>&1; }
if ! answers docker; then
  running=
  for comm in /proc/[0-9]*/comm; do
    [[ $(cat "$comm" 2>/dev/null) == dockerd ]] && { running=1; break; }
  done
  if [[ -z $running ]]; then
    log "starting dockerd --bridge=none --iptables=false --ip6tables=false (log: /var/log/dockerd-studio.log)"
    "${SUDO[@]}" sh -c 'nohup dockerd --bridge=none --iptables=false --ip6tables=false \
      >/var/log/dockerd-studio.log 2>&1 &'
  fi
  for _ in $(seq 1 120); do answers "${SUDO[@]}" docker && break; sleep 1; done
  if ! answers "${SUDO[@]}" docker; then
    log "the Docker engine does not answer; its log:"
    tail -n 30 /var/log/dockerd-studio.log >&2 2>/dev/null || true
    exit 1
  fi
  if ! answers docker; then
    log "the engine runs but you may not use it: sudo usermod -aG docker $USER, then log in again"
    exit 1
  fi
fi

# The engine under the sandboxes: its versions, and the known escapes they have (the same
# table and comparison as the workers' engine posture, executor/runtimes/docker/escapes.py).
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
engine=$(docker version --format \
  '{{range .Server.Components}}{{.Name}}|{{.Version}}|{{index .Details "GitCommit"}}{{"\n"}}{{end}}' \
  2>/dev/null || true)
found=() escapes=()
while IFS='|' read -r name version commit; do
  case $name in
    Engine) found+=("Docker $version") ;;
    containerd | runc)
      package=
      [[ $commit == "$version"-* ]] && package=$commit # Debian's package version
      found+=("$name $version${package:+ ($package)}")
      command -v python3 >/dev/null || continue
      while read -r cve ghsa fixed only_when; do
        [[ -n $cve && -z $only_when ]] && escapes+=("$name ${package:-$version}: $cve ($ghsa), fixed in ${fixed//\// / }")
      done < <(python3 -S "$root/executor/runtimes/docker/escapes.py" "$name" "$version" ${package:+"$package"} 2>/dev/null)
      ;;
  esac
done <<<"$engine"
((${#found[@]})) && log "engine: $(printf '%s, ' "${found[@]}" | sed 's/, $//')"
if ((${#escapes[@]})); then
  log "WARNING: this engine has known container escapes (executor/runtimes/docker/known_escapes.toml):"
  for e in "${escapes[@]}"; do log "  $e"; done
  log "  upgrade: the Docker project's packages (docker-ce, containerd.io from"
  log "  https://download.docker.com/linux/), a newer distribution, or a runc from the"
  log "  distribution's backports; docs/security.md, 'The engine posture'. Sandboxes still run:"
  log "  STUDIO_CODE_ENGINE_REFUSE_VULNERABLE=1 makes the workers refuse this engine."
fi

if command -v pg_ctlcluster >/dev/null && command -v pg_isready >/dev/null \
  && ! pg_isready -h 127.0.0.1 -q 2>/dev/null; then
  log "starting PostgreSQL"
  "${SUDO[@]}" pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
exit 0
