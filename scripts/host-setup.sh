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
#   runsc     gVisor's runtime from the distribution (when it offers it), registered with the
#             engine in /etc/docker/daemon.json (merged) and a SIGHUP to dockerd, never a restart
#   engine    says which Docker, containerd and runc it found, and WARNS when their version
#             has a known container escape of executor/runtimes/docker/known_escapes.toml (asked
#             with the system's python3 -S: no project start-up), naming the upgrade path
#
# On a machine that has all of it, it changes nothing and takes well under a second.
# STUDIO_HOST_SETUP=0 skips it (a machine managed otherwise).
#
#   --tune [--dry-run]  ONLY this, never by default: a machine-wide kernel setting that cuts a
#             container's start on some VMs (measure yours first: python -m bench.host_tuning;
#             docs/operations.md, "Host tuning"): /sys/kernel/rcu_expedited = 1, until the
#             next boot. It prints what it changed and how to undo it; --dry-run prints what it
#             would change.
set -Eeuo pipefail
log() { printf '[host-setup] %s\n' "$*" >&2; }
usage() { printf 'usage: %s [--tune [--dry-run]]\n' "${BASH_SOURCE[0]}"; }
tune=0 dry=0
for arg in "$@"; do
  case $arg in
    --tune) tune=1 ;;
    --dry-run) dry=1 ;;
    -h | --help) usage; exit 0 ;;
    *) log "unknown argument: $arg"; usage >&2; exit 2 ;;
  esac
done
if ((dry && !tune)); then
  log "--dry-run goes with --tune"; usage >&2; exit 2
fi
SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { log "not root and no sudo: install the packages below by hand"; }
  SUDO=(sudo)
fi

if ((tune)); then
  # RCU grace periods waited for the expedited way (IPIs to every CPU): runc's cgroup moves
  # and namespace set-up wait for grace periods, which on a VM's idle vCPUs are slow.
  knob=${STUDIO_HOST_RCU_EXPEDITED:-/sys/kernel/rcu_expedited}
  if [[ ! -e $knob ]]; then
    log "tune: $knob does not exist (this kernel has no rcu_expedited): nothing changed"
  elif [[ $(cat "$knob") == 1 ]]; then
    log "tune: $knob is 1 already: nothing changed"
  elif ((dry)); then
    log "tune (dry run): would set $knob $(cat "$knob") -> 1 (machine-wide, until reboot)"
  else
    was=$(cat "$knob")
    echo 1 | "${SUDO[@]}" tee "$knob" >/dev/null
    log "tune: set $knob $was -> 1: every RCU grace period on this machine is expedited until the next boot; undo: echo $was | sudo tee $knob"
  fi
  exit 0
fi

[[ ${STUDIO_HOST_SETUP:-1} == 0 ]] && exit 0
export DEBIAN_FRONTEND=noninteractive

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
    # In a session of its own (setsid): the engine outlives the command that started it, and a
    # Ctrl-C of `make test` or a signal to its process group never reaches dockerd.
    "${SUDO[@]}" setsid -f sh -c 'exec dockerd --bridge=none --iptables=false --ip6tables=false \
      </dev/null >>/var/log/dockerd-studio.log 2>&1'
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

# gVisor, the second wall (docs/security.md, "The second wall"): the distribution's runsc,
# registered with the engine as the runtime "runsc" (merged into /etc/docker/daemon.json, which
# keeps its other keys; a SIGHUP makes dockerd reload its runtimes: never a restart). ptrace:
# the KVM platform hangs in this kind of VM; --network=none: sandboxes have no network, and
# runsc cannot start with one in the host's network namespace; --oci-seccomp: without it runsc
# ignores the project's seccomp profile. STUDIO_HOST_RUNSC=0 skips it.
RUNSC_ARGS='["--platform=ptrace", "--network=none", "--oci-seccomp"]'
runsc_listed() { docker info --format '{{range $k, $v := .Runtimes}}{{$k}} {{end}}' 2>/dev/null | grep -qw runsc; }
if [[ ${STUDIO_HOST_RUNSC:-1} != 0 ]]; then
  if ! command -v runsc >/dev/null; then
    if [[ -n $(apt-cache policy runsc 2>/dev/null | sed -n 's/^ *Candidate: *\([0-9].*\)/\1/p') ]] \
      || { "${SUDO[@]}" apt-get update -qq && [[ -n $(apt-cache policy runsc 2>/dev/null | sed -n 's/^ *Candidate: *\([0-9].*\)/\1/p') ]]; }; then
      log "installing runsc (gVisor) from the distribution"
      "${SUDO[@]}" apt-get install -y -qq runsc >/dev/null
    fi
  fi
  if ! command -v runsc >/dev/null; then
    log "gVisor: this distribution offers no runsc package: sandboxes start with the engine's default runtime (docs/security.md, 'The second wall')"
  else
    # prints what it did: "added", "same" or "own" (an operator's own runsc entry, left alone)
    did=$("${SUDO[@]}" python3 -S - "$(command -v runsc)" "$RUNSC_ARGS" <<'PY'
import json, os, sys
path, args = "/etc/docker/daemon.json", json.loads(sys.argv[2])
try:
    with open(path) as f:
        conf = json.load(f)
except FileNotFoundError:
    conf = {}
want = {"path": sys.argv[1], "runtimeArgs": args}
have = (conf.get("runtimes") or {}).get("runsc")
if have == want:
    print("same")
elif have is not None:
    print("own")
else:
    conf.setdefault("runtimes", {})["runsc"] = want
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".studio-tmp", "w") as f:
        json.dump(conf, f, indent=2)
        f.write("\n")
    os.replace(path + ".studio-tmp", path)
    print("added")
PY
)
    version=$(runsc --version 2>/dev/null | sed -n 's/^runsc version //p' | head -n1)
    if [[ $did == same ]] && runsc_listed; then
      log "gVisor: runsc ${version:-?} is registered with the engine already: nothing to do"
    else
      [[ $did == own ]] && log "gVisor: /etc/docker/daemon.json has its own \"runsc\" entry: left as it is (the project's: $RUNSC_ARGS)"
      pid=
      for comm in /proc/[0-9]*/comm; do
        [[ $(cat "$comm" 2>/dev/null) == dockerd ]] && { pid=${comm#/proc/}; pid=${pid%/comm}; break; }
      done
      [[ -n $pid ]] && "${SUDO[@]}" kill -HUP "$pid"
      for _ in $(seq 1 50); do runsc_listed && break; sleep 0.1; done
      if runsc_listed; then
        log "gVisor: registered runsc ${version:-?} with the engine (/etc/docker/daemon.json, a SIGHUP to dockerd): STUDIO_CODE_OCI_RUNTIME=auto starts sandboxes under it"
      else
        log "gVisor: wrote runsc into /etc/docker/daemon.json but the engine does not list it: reload dockerd (SIGHUP) by hand"
      fi
    fi
  fi
fi

if command -v pg_ctlcluster >/dev/null && command -v pg_isready >/dev/null \
  && ! pg_isready -h 127.0.0.1 -q 2>/dev/null; then
  log "starting PostgreSQL"
  "${SUDO[@]}" pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
exit 0
