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

if command -v pg_ctlcluster >/dev/null && command -v pg_isready >/dev/null \
  && ! pg_isready -h 127.0.0.1 -q 2>/dev/null; then
  log "starting PostgreSQL"
  "${SUDO[@]}" pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
exit 0
