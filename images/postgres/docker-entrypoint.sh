#!/bin/sh
# Entrypoint of the local postgres stand-in (see the Dockerfile next to this file): initialise
# PGDATA on the first start from POSTGRES_USER / POSTGRES_PASSWORD / POSTGRES_DB, then run
# the server as the postgres user in the foreground (PID 1, so it gets the stop signal).
set -eu

first="${1:-postgres}"
if [ "$first" = postgres ] || [ "${first#-}" != "$first" ]; then
  [ "$#" -gt 0 ] && [ "$first" = postgres ] && shift
  : "${POSTGRES_USER:=postgres}"
  : "${POSTGRES_DB:=$POSTGRES_USER}"
  if [ -z "${POSTGRES_PASSWORD:-}" ]; then
    echo "postgres stand-in: POSTGRES_PASSWORD must be set" >&2
    exit 1
  fi
  if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA" /var/run/postgresql
    chown postgres:postgres "$PGDATA" /var/run/postgresql
    chmod 700 "$PGDATA"
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$0" postgres "$@"
  fi
  if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile="$(mktemp)"
    printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
    initdb -D "$PGDATA" --username="$POSTGRES_USER" --pwfile="$pwfile" \
      --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 >/dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
    if [ "$POSTGRES_DB" != postgres ]; then
      echo "CREATE DATABASE \"$POSTGRES_DB\";" \
        | postgres --single -D "$PGDATA" postgres >/dev/null
    fi
    echo "postgres stand-in: initialised $PGDATA (database $POSTGRES_DB, user $POSTGRES_USER)"
  fi
  exec postgres -D "$PGDATA" "$@"
fi
exec "$@"
