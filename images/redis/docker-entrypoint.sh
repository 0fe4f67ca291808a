#!/bin/sh
# Entrypoint of the local redis stand-in (see the Dockerfile next to this file): like the
# official image, `redis-server` without a config file gets `--protected-mode no`, and runs
# as the redis user in the foreground with /data owned by it.
set -eu

first="${1:-redis-server}"
if [ "${first#-}" != "$first" ]; then
  set -- redis-server "$@"
elif [ "$#" -eq 0 ]; then
  set -- redis-server
fi
if [ "$1" = redis-server ]; then
  shift
  case "${1:-}" in
    *.conf) ;;
    *) set -- --protected-mode no "$@" ;;
  esac
  if [ "$(id -u)" = 0 ]; then
    chown -R redis:redis /data 2>/dev/null || true
    exec setpriv --reuid=redis --regid=redis --init-groups redis-server "$@"
  fi
  exec redis-server "$@"
fi
exec "$@"
