#!/bin/sh
# The official image's entrypoint, in the part the containers backend uses (see Dockerfile).
set -eu
# As the official one: options alone (testcontainers passes `-c fsync=off`) are the server's.
if [ "$#" -eq 0 ] || [ "${1#-}" != "$1" ]; then
  set -- postgres "$@"
fi
if [ "$1" != postgres ]; then
  exec "$@"
fi
shift
user=${POSTGRES_USER:-postgres}
db=${POSTGRES_DB:-$user}
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  printf '%s\n' "${POSTGRES_PASSWORD:-postgres}" > "$pwfile"
  # initdb's own default, as the official image: trust on the socket and on loopback.
  initdb --username="$user" --pwfile="$pwfile" -D "$PGDATA" > /dev/null
  rm -f "$pwfile"
  # Every other address: POSTGRES_HOST_AUTH_METHOD (the official default: scram-sha-256).
  echo "host all all all ${POSTGRES_HOST_AUTH_METHOD:-scram-sha-256}" >> "$PGDATA/pg_hba.conf"
  # The setup server, local socket only, logging to stdout as the official image's does.
  pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start -l /dev/stdout
  if [ "$db" != postgres ]; then
    psql -v ON_ERROR_STOP=1 --username "$user" --dbname postgres -c "CREATE DATABASE \"$db\"" > /dev/null
  fi
  pg_ctl -D "$PGDATA" -m fast -w stop > /dev/null
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
