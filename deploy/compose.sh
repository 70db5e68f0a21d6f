#!/usr/bin/env bash
# What `make up`, `make scale`, `make down` run: Compose with the env file, the images and the
# network variant this host needs.
#
#   deploy/compose.sh up [WORKERS]     build/pull what is missing, write the env file, start
#   deploy/compose.sh scale N          N workers
#   deploy/compose.sh down [--purge]   stop everything (workers finish their nodes); --purge
#                                      also removes the volumes and the env file
#   deploy/compose.sh env              print the env file's path (after `up`)
#   deploy/compose.sh -- ARGS...       any other Compose command with the same files
#
# COMPOSE_PROJECT_NAME (studio-code) names the deployment; its env file is
# deploy/.state/<project>/env (mode 0600), made on the first `up` with random REDIS_PASSWORD,
# POSTGRES_PASSWORD and STUDIO_API_TOKEN, and reused after. DOCKER_GID is read from the
# socket every time. STUDIO_COMPOSE_NETWORK=bridge|host overrides the choice of variant
# (default: host when the engine has no `bridge` network). DOCKER_COMPOSE_EXTRA adds more
# Compose files (space-separated), e.g. deploy/compose.api-docker.yaml. On the host variant the ports
# are REDIS_PORT (16379), POSTGRES_PORT (15432), API_PORT (18080), PROMETHEUS_PORT (19090):
# set them in the environment of the first `up` to change them.
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PROJECT=${COMPOSE_PROJECT_NAME:-studio-code}
STATE_DIR=$HERE/.state/$PROJECT
ENV_FILE=$STATE_DIR/env

log() { printf '[compose] %s\n' "$*" >&2; }
die() { printf '[compose] ERROR: %s\n' "$*" >&2; exit 1; }

if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose)
elif command -v docker-compose >/dev/null; then COMPOSE=(docker-compose)
else die "no Compose: install docker-compose (scripts/host-setup.sh does)"; fi

network=${STUDIO_COMPOSE_NETWORK:-}
if [[ -z $network ]]; then
  if docker network inspect bridge >/dev/null 2>&1; then network=bridge; else network=host; fi
fi
FILES=(-f "$HERE/compose.yaml")
if [[ $network == host ]]; then FILES+=(-f "$HERE/compose.hostnet.yaml")
else FILES+=(-f "$HERE/compose.bridge.yaml"); fi
# more files, space-separated (e.g. deploy/compose.api-docker.yaml)
for f in ${DOCKER_COMPOSE_EXTRA:-}; do FILES+=(-f "$f"); done

# The shell's environment wins over the env file in Compose's interpolation: on the bridge
# variant the ports asked for are the published ones (in the env file); inside, the
# services keep their usual ports.
compose() {
  local unset=()
  [[ $network == bridge ]] && unset=(-u REDIS_PORT -u POSTGRES_PORT -u API_PORT -u PROMETHEUS_PORT)
  env "${unset[@]}" "${COMPOSE[@]}" -p "$PROJECT" --env-file "$ENV_FILE" "${FILES[@]}" "$@"
}

secret() { od -An -N24 -tx1 /dev/urandom | tr -d ' \n'; }

# The value of $1 in the existing env file, if any.
old() { [[ -r $ENV_FILE ]] && sed -n "s/^$1=//p" "$ENV_FILE" | tail -n1 || true; }

docker_gid() {
  local sock=/var/run/docker.sock
  [[ ${DOCKER_HOST:-} == unix://* ]] && sock=${DOCKER_HOST#unix://}
  [[ -S $sock ]] || die "no Docker socket at $sock: the workers mount it to start sandboxes"
  stat -c %g "$sock"
}

write_env() { # $@: NAME=image lines from build-images.sh
  mkdir -p "$STATE_DIR"; chmod 0700 "$STATE_DIR" "$HERE/.state"
  local redis_pw pg_pw token
  redis_pw=$(old REDIS_PASSWORD); [[ -n $redis_pw ]] || { redis_pw=$(secret); log "new REDIS_PASSWORD"; }
  pg_pw=$(old POSTGRES_PASSWORD); [[ -n $pg_pw ]] || { pg_pw=$(secret); log "new POSTGRES_PASSWORD"; }
  token=$(old STUDIO_API_TOKEN); [[ -n $token ]] || { token=$(secret); log "new STUDIO_API_TOKEN"; }
  umask 077
  {
    echo "# written by deploy/compose.sh for project $PROJECT; the secrets are kept across runs"
    echo "REDIS_PASSWORD=$redis_pw"
    echo "POSTGRES_PASSWORD=$pg_pw"
    echo "STUDIO_API_TOKEN=$token"
    echo "DOCKER_GID=$(docker_gid)"
    echo "STATE_DIR=$STATE_DIR"
    echo "NETWORK=$network"
    printf '%s\n' "$@"
    # the sandbox images and lists (studio-code image build's tags and printed lists): from
    # this shell, else kept from the last env file; none: the executor's defaults
    local v val
    for v in STUDIO_CODE_IMAGE STUDIO_CODE_TS_IMAGE STUDIO_CODE_PACKAGES STUDIO_CODE_TS_PACKAGES \
        STUDIO_CODE_PREIMPORT STUDIO_CODE_USAGE_CGROUP_PARENT STUDIO_WORKER_GROUPS \
        BIG_WORKER_MEMORY BIG_WORKER_CPUS; do
      val=${!v:-$(old "$v")}
      [[ -z $val ]] || echo "$v=$val"
    done
    if [[ $network == host ]]; then
      local rp pp ap mp
      rp=${REDIS_PORT:-$(old REDIS_PORT)}; pp=${POSTGRES_PORT:-$(old POSTGRES_PORT)}
      ap=${API_PORT:-$(old API_PORT)}; mp=${PROMETHEUS_PORT:-$(old PROMETHEUS_PORT)}
      echo "REDIS_HOST=127.0.0.1"; echo "REDIS_BIND=127.0.0.1"; echo "REDIS_PORT=${rp:-16379}"
      echo "POSTGRES_HOST=127.0.0.1"; echo "POSTGRES_BIND=127.0.0.1"
      echo "POSTGRES_PORT=${pp:-15432}"
      echo "API_BIND=127.0.0.1"; echo "API_PORT=${ap:-18080}"; echo "API_PUBLISH_PORT=${ap:-18080}"
      echo "PROMETHEUS_BIND=127.0.0.1"; echo "PROMETHEUS_PORT=${mp:-19090}"
      echo "PROMETHEUS_PUBLISH_PORT=${mp:-19090}"
      echo "PROMETHEUS_CONFIG=$STATE_DIR/prometheus.yml"
    else
      local ap mp
      ap=${API_PORT:-$(old API_PUBLISH_PORT)}; mp=${PROMETHEUS_PORT:-$(old PROMETHEUS_PUBLISH_PORT)}
      echo "API_PUBLISH_PORT=${ap:-8080}"; echo "PROMETHEUS_PUBLISH_PORT=${mp:-9090}"
    fi
  } >"$ENV_FILE.part"
  mv "$ENV_FILE.part" "$ENV_FILE"
  umask 022
  # Prometheus (uid 65534) reads the token through a bind mount; the directory is 0700.
  printf '%s' "$token" >"$STATE_DIR/api_token"; chmod 0644 "$STATE_DIR/api_token"
  if [[ $network == host ]]; then
    cat >"$STATE_DIR/prometheus.yml" <<EOF
# written by deploy/compose.sh: the host-network variant scrapes the API only
global: {scrape_interval: 15s, evaluation_interval: 15s}
scrape_configs:
  - job_name: studio-code-api
    authorization: {type: Bearer, credentials_file: /etc/prometheus/api_token}
    static_configs: [{targets: ["127.0.0.1:$(old API_PORT)"]}]
EOF
    chmod 0644 "$STATE_DIR/prometheus.yml"
  fi
  log "env file $ENV_FILE ($network network)"
}

# Sandboxes started by this deployment's workers that are still there (a worker killed after
# its grace): owner host:pid where host is a worker container's hostname (bridge) or pid one
# of the worker containers' host pids (host network, pid: host).
leftover_sandboxes() { # $@: worker container ids
  local c hosts=() pids=() id owner
  for c in "$@"; do
    hosts+=("$(docker inspect --format '{{.Config.Hostname}}' "$c" 2>/dev/null || true)")
    mapfile -t -O "${#pids[@]}" pids < <(docker top "$c" -eo pid 2>/dev/null | tail -n +2 | tr -d ' ')
  done
  while read -r id owner; do
    [[ -n $id ]] || continue
    local h=${owner%:*} p=${owner##*:} x
    for x in "${pids[@]}"; do [[ $network == host && $p == "$x" ]] && echo "$id" && continue 2; done
    for x in "${hosts[@]}"; do [[ $network == bridge && $h == "$x" ]] && echo "$id" && continue 2; done
  done < <(docker ps -a --filter label=studio.job_id \
    --format '{{.ID}} {{.Label "studio.owner"}}')
}

cmd=${1:-}; shift || true
case $cmd in
  up)
    workers=${1:-1}
    mapfile -t images < <("$HERE/build-images.sh" all)
    write_env "${images[@]}"
    compose up -d --no-build --remove-orphans --scale "worker=$workers"
    ;;
  scale)
    [[ -r $ENV_FILE ]] || die "no env file $ENV_FILE: run make up first"
    compose up -d --no-build --no-recreate --scale "worker=${1:?how many workers}"
    ;;
  down)
    [[ -r $ENV_FILE ]] || { log "no env file $ENV_FILE: nothing to stop"; exit 0; }
    mapfile -t workers < <(compose ps -q worker 2>/dev/null || true)
    before=()
    ((${#workers[@]})) && mapfile -t before < <(leftover_sandboxes "${workers[@]}")
    if [[ ${1:-} == --purge ]]; then compose down --remove-orphans -v; else compose down --remove-orphans; fi
    # the workers removed their sandboxes when they stopped; any left (SIGKILL after the
    # grace) are removed here, by id
    for id in "${before[@]}"; do
      docker inspect "$id" >/dev/null 2>&1 || continue
      log "removing sandbox $id left by a stopped worker"
      docker rm -f "$id" >/dev/null 2>&1 || true
    done
    if [[ ${1:-} == --purge ]]; then rm -rf "$STATE_DIR"; log "removed volumes and $STATE_DIR"; fi
    ;;
  env) echo "$ENV_FILE" ;;
  --) compose "$@" ;;
  *) sed -n '2,11p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
esac
