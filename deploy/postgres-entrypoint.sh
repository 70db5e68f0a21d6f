#!/bin/sh
# Entrypoint of the offline PostgreSQL image (studio-code-postgres:1, deploy/build-images.sh):
# the part of the official image's docker-entrypoint.sh that deploy/compose.yaml relies on.
# On an empty PGDATA: initdb with POSTGRES_USER and POSTGRES_PASSWORD (or
# POSTGRES_PASSWORD_FILE; an empty password is refused, never defaulted), password
# (scram-sha-256) logins from any address, then POSTGRES_DB. Then exec the command.
set -eu
: "${PGDATA:=/var/lib/postgresql/data}"
if [ "${1:-}" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
  user=${POSTGRES_USER:-postgres}
  pw=${POSTGRES_PASSWORD:-}
  if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then pw=$(cat "$POSTGRES_PASSWORD_FILE"); fi
  if [ -z "$pw" ]; then
    echo "POSTGRES_PASSWORD is empty: set it (make up writes a random one to its env file)" >&2
    exit 1
  fi
  pwfile=$(mktemp)
  printf '%s\n' "$pw" >"$pwfile"
  initdb -D "$PGDATA" -U "$user" --pwfile="$pwfile" -E UTF8 --locale=C.UTF-8 \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  printf 'host all all all scram-sha-256\n' >>"$PGDATA/pg_hba.conf"
  db=${POSTGRES_DB:-$user}
  if [ "$db" != postgres ]; then
    echo "CREATE DATABASE \"$db\" OWNER \"$user\";" \
      | postgres --single -D "$PGDATA" -j postgres >/dev/null
  fi
  echo "initialised $PGDATA: user $user, database $db" >&2
fi
exec "$@"
