#!/usr/bin/env bash
# A PostgreSQL server for the tests (Debian 12, run as root). Idempotent: installs PostgreSQL only
# when its binaries are missing, creates (or reuses, starting it if stopped) a dedicated cluster
# "planetserve" listening on 127.0.0.1, (re)creates the role and the database planetserve_test, and
# writes the SQLAlchemy URL to build/postgres.url.
# Port: the first from $PLANETSERVE_PG_PORT (default 5432) that nothing listens on and no other
# cluster is configured for. Test-only settings: fsync off (the data is throw-away).
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER="planetserve"
DB="planetserve_test"
ROLE="planetserve"
PASSWORD="planetserve-test"
FIRST_PORT="${PLANETSERVE_PG_PORT:-5432}"

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [ "$(id -u)" != 0 ]; then
  echo "scripts/postgres.sh must run as root (it manages a system PostgreSQL cluster)" >&2
  exit 1
fi

have_pg() { command -v pg_ctlcluster >/dev/null && ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; }
if ! have_pg; then
  step "installing PostgreSQL"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y postgresql
fi
VERSION=$(ls /usr/lib/postgresql | sort -V | tail -n 1)

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
# Ports taken by a listener or reserved by another cluster's configuration.
port_free() {
  local p=$1
  port_busy "$p" && return 1
  pg_lsclusters -h | awk -v c="$CLUSTER" -v p="$p" '$2 != c && $3 == p {found=1} END {exit !found}' && return 1
  return 0
}
pick_port() {
  local p=$FIRST_PORT
  until port_free "$p"; do p=$((p + 1)); done
  echo "$p"
}
cluster_field() { pg_lsclusters -h | awk -v v="$VERSION" -v c="$CLUSTER" -v f="$1" '$1 == v && $2 == c {print $f}'; }

if [ -z "$(cluster_field 2)" ]; then
  port=$(pick_port)
  step "creating cluster $VERSION/$CLUSTER on port $port"
  pg_createcluster "$VERSION" "$CLUSTER" --port "$port" >/dev/null
fi

conf() { pg_conftool "$VERSION" "$CLUSTER" set "$1" "$2"; }
if [ "$(cluster_field 4)" != "online" ]; then
  port=$(cluster_field 3)
  if port_busy "$port"; then
    port=$(pick_port)
    step "port taken by something else; moving cluster to port $port"
    conf port "$port"
  fi
  cat > "/etc/postgresql/$VERSION/$CLUSTER/conf.d/planetserve.conf" <<'CONF'
listen_addresses = '127.0.0.1'
fsync = off
synchronous_commit = off
full_page_writes = off
max_connections = 200
CONF
  step "starting cluster $VERSION/$CLUSTER"
  pg_ctlcluster "$VERSION" "$CLUSTER" start
fi
port=$(cluster_field 3)

psql_admin() { runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -p "$port" -d postgres "$@"; }
for _ in $(seq 1 30); do
  psql_admin -c "SELECT 1" >/dev/null 2>&1 && break
  sleep 1
done

step "role $ROLE and database $DB"
psql_admin <<SQL
SET client_min_messages = warning;
DO \$\$
BEGIN
  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$ROLE') THEN
    CREATE ROLE $ROLE LOGIN;
  END IF;
END
\$\$;
ALTER ROLE $ROLE WITH LOGIN PASSWORD '$PASSWORD';
DROP DATABASE IF EXISTS $DB WITH (FORCE);
CREATE DATABASE $DB OWNER $ROLE;
SQL

mkdir -p build
url="postgresql+psycopg://$ROLE:$PASSWORD@127.0.0.1:$port/$DB"
echo "$url" > build/postgres.url
step "PostgreSQL ready: $url (in build/postgres.url)"
