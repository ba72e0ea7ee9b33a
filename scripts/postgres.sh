#!/usr/bin/env bash
# A private PostgreSQL server for dq's tests, from Debian's packages, as a non-root user, on loopback.
#
#   scripts/postgres.sh start DIR PORT [TLSDIR]
#                                         initdb into DIR (once) and start on 127.0.0.1:PORT (and a Unix socket
#                                         in DIR); prints the URL. With TLSDIR (ca.pem, server.pem, server.key),
#                                         TLS is on and a TLS connection must log in with a client certificate
#                                         the CA signed, its CN the role (pg_hba's `cert` method)
#   scripts/postgres.sh stop DIR          stop it (fast shutdown) and wait
#   scripts/postgres.sh kill DIR          stop it at once (immediate shutdown: what a crash leaves)
#   scripts/postgres.sh remove DIR        stop it and remove its files
#   scripts/postgres.sh bouncer DIR PORT PGPORT
#                                         PgBouncer in transaction pooling mode on 127.0.0.1:PORT in front of
#                                         the server on PGPORT (every database, the same role); prints the URL;
#                                         `stop DIR` stops it too; run again on a running one, it is pointed
#                                         at PGPORT and reloaded (a failover)
#   scripts/postgres.sh standby DIR PORT PRIMARY_DIR PRIMARY_PORT
#                                         a streaming standby of the primary in DIR on 127.0.0.1:PORT
#                                         (pg_basebackup -R); the primary is made to wait for it on commit
#                                         (synchronous replication), so nothing acknowledged is lost on failover
#   scripts/postgres.sh promote DIR       promote a standby to primary (pg_ctl promote)
#
# The cluster has one role, `dq`, with a generated password (scram-sha-256) kept in DIR/password, and a
# database `dq`. As root the server runs as `nobody` (PostgreSQL refuses to run as root); when nobody cannot
# traverse the folders above DIR (a clone in a 0700 folder), DIR is a link to a folder in /var/tmp/dq-postgres.
set -euo pipefail
shopt -s inherit_errexit  # a failure inside $(...) ends the script too

bin=""
for candidate in /usr/lib/postgresql/*/bin; do [ -x "$candidate/initdb" ] && bin="$candidate"; done
if [ -z "$bin" ]; then
  echo "postgres: no PostgreSQL server binaries (apt-get install postgresql)" >&2
  exit 69
fi

as_owner() { # run as the cluster's owner
  if [ "$(id -u)" = 0 ]; then (cd / && runuser -u nobody -- "$@"); else "$@"; fi
}

daemon_as_owner() { # as_owner, for a command that leaves a daemon behind: without the descriptors this
  # script inherited beyond 0-2. A daemon that kept one open would hold it for its whole life; a parent that
  # learns of this script's end from such a descriptor (Foundation's Process does) would wait for the server.
  (
    for fd in /proc/self/fd/*; do
      fd=${fd##*/}
      if [ "$fd" -gt 2 ]; then eval "exec $fd>&-" 2>/dev/null || true; fi
    done
    as_owner "$@"
  )
}

physical() { # DIR: its path with every link resolved (the path the server's user is given)
  (cd "$1" && pwd -P)
}

place() { # DIR: make DIR (once) where the server's user can reach it; prints its physical path.
  # As root the server runs as nobody, which must traverse every folder above DIR. A clone in a folder of mode
  # 0700 (mktemp -d, a home folder) cannot be traversed: the cluster is then kept in /var/tmp/dq-postgres/HASH
  # (HASH from DIR's path) and DIR is made a link to it. A DIR that did not exist gets a new, empty folder there.
  local dir="$1"
  if [ -L "$dir" ] && [ ! -e "$dir" ]; then
    rm -f "$dir"  # a link to a folder that is gone (/var/tmp cleaned): placed again below, empty
  fi
  if [ "$(id -u)" != 0 ] || [ -L "$dir" ]; then
    mkdir -p "$dir"
    physical "$dir"
    return
  fi
  mkdir -p "$(dirname "$dir")"
  local parent
  parent="$(physical "$(dirname "$dir")")"
  if runuser -u nobody -- test -x "$parent"; then
    mkdir -p "$dir"
    physical "$dir"
    return
  fi
  if [ -e "$dir" ]; then
    echo "postgres: $parent cannot be reached by the server's user (nobody), and $dir already exists as a folder; remove it or use a folder nobody can traverse" >&2
    exit 73
  fi
  local base=/var/tmp/dq-postgres hash
  hash="$(printf '%s' "$parent/$(basename "$dir")" | sha256sum | cut -c1-16)"
  mkdir -p "$base"
  # /var/tmp is everyone's: the folder root works in must be root's own, not a link or another user's.
  if [ -L "$base" ] || [ ! -d "$base" ] || [ "$(stat -c %u "$base")" != 0 ]; then
    echo "postgres: $base is not a folder of root's own; remove it" >&2
    exit 73
  fi
  chmod 755 "$base"
  rm -rf "${base:?}/${hash:?}"
  mkdir -m 755 "$base/$hash"
  ln -s "$base/$hash" "$dir"
  echo "postgres: $parent cannot be reached by the server's user (nobody); the cluster is kept in $base/$hash ($dir links to it)" >&2
  physical "$dir"
}

start() { # DIR PORT [TLSDIR]
  local dir port="$2" tls="${3:-}"
  dir="$(place "$1")"
  [ -n "$dir" ] || { echo "postgres: cannot place $1" >&2; exit 73; }
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    rm -rf "$dir/data"
    mkdir -p "$dir/data"
    head -c 18 /dev/urandom | base64 | tr -d '/+=' > "$dir/password"
    [ "$(id -u)" = 0 ] && chown -R nobody "$dir"
    chmod 700 "$dir/data"
    chmod 600 "$dir/password"
    as_owner "$bin/initdb" -D "$dir/data" -U dq --pwfile="$dir/password" -A scram-sha-256 \
      --encoding=UTF8 --no-locale > "$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; exit 1; }
  fi
  local tls_options=""
  if [ -n "$tls" ]; then
    for name in ca.pem server.pem server.key; do
      install -m 600 "$tls/$name" "$dir/data/$name"
      [ "$(id -u)" = 0 ] && chown nobody "$dir/data/$name"
    done
    grep -q '^hostssl' "$dir/data/pg_hba.conf" || sed -i '1i hostssl all all 127.0.0.1/32 cert' "$dir/data/pg_hba.conf"
    tls_options="-c ssl=on -c ssl_cert_file=server.pem -c ssl_key_file=server.key -c ssl_ca_file=ca.pem"
  fi
  daemon_as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-h 127.0.0.1 -p $port -k $dir -c max_connections=200 -c fsync=on -c synchronous_commit=on $tls_options" start > /dev/null
  export PGPASSWORD PGSSLMODE=disable
  PGPASSWORD="$(cat "$dir/password")"
  if ! "$bin/psql" -h 127.0.0.1 -p "$port" -U dq -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'dq'" | grep -q 1; then
    "$bin/psql" -h 127.0.0.1 -p "$port" -U dq -d postgres -qc "CREATE DATABASE dq" > /dev/null
  fi
  echo "postgres://dq@127.0.0.1:$port/dq"
}

bouncer() { # DIR PORT PGPORT
  local dir port="$2" pg_port="$3"
  dir="$(physical "$1")"
  local pgbouncer=/usr/sbin/pgbouncer
  if [ ! -x "$pgbouncer" ]; then
    echo "postgres: no PgBouncer (apt-get install pgbouncer)" >&2
    exit 69
  fi
  mkdir -p "$dir/bouncer"
  printf '"dq" "%s"\n' "$(cat "$dir/password")" > "$dir/bouncer/userlist.txt"
  cat > "$dir/bouncer/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=$pg_port

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = scram-sha-256
auth_file = $dir/bouncer/userlist.txt
pool_mode = transaction
max_client_conn = 400
default_pool_size = 20
logfile = $dir/bouncer/pgbouncer.log
pidfile = $dir/bouncer/pgbouncer.pid
INI
  chmod 600 "$dir/bouncer/userlist.txt"
  [ "$(id -u)" = 0 ] && chown -R nobody "$dir/bouncer"
  if [ -f "$dir/bouncer/pgbouncer.pid" ] && kill -0 "$(cat "$dir/bouncer/pgbouncer.pid")" 2>/dev/null; then
    kill -HUP "$(cat "$dir/bouncer/pgbouncer.pid")"  # RELOAD: the new [databases] line applies to new server connections
    echo "postgres://dq@127.0.0.1:$port/dq"
    return 0
  fi
  daemon_as_owner "$pgbouncer" -d -q "$dir/bouncer/pgbouncer.ini"
  for _ in $(seq 1 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && { echo "postgres://dq@127.0.0.1:$port/dq"; return 0; }
    sleep 0.1
  done
  echo "postgres: PgBouncer did not start (see $dir/bouncer/pgbouncer.log)" >&2
  exit 1
}

standby() { # DIR PORT PRIMARY_DIR PRIMARY_PORT
  local dir port="$2" primary="$3" primary_port="$4"
  dir="$(place "$1")"
  [ -n "$dir" ] || { echo "postgres: cannot place $1" >&2; exit 73; }
  rm -rf "$dir/data"
  cp "$primary/password" "$dir/password"
  mkdir -p "$dir/data"
  [ "$(id -u)" = 0 ] && chown -R nobody "$dir"
  chmod 700 "$dir/data"
  export PGPASSWORD
  PGPASSWORD="$(cat "$dir/password")"
  as_owner "$bin/pg_basebackup" -h 127.0.0.1 -p "$primary_port" -U dq -D "$dir/data" -R -X stream -c fast \
    > "$dir/basebackup.log" 2>&1 || { cat "$dir/basebackup.log" >&2; exit 1; }
  daemon_as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-h 127.0.0.1 -p $port -k $dir -c max_connections=200 -c cluster_name=standby" start > /dev/null
  "$bin/psql" -h 127.0.0.1 -p "$primary_port" -U dq -d postgres -qc "ALTER SYSTEM SET synchronous_standby_names = '*'" \
    -c "SELECT pg_reload_conf()" > /dev/null
  for _ in $(seq 1 100); do
    state=$("$bin/psql" -h 127.0.0.1 -p "$primary_port" -U dq -d postgres -tAc "SELECT sync_state FROM pg_stat_replication")
    [ "$state" = sync ] && { echo "postgres://dq@127.0.0.1:$port/dq"; return 0; }
    sleep 0.1
  done
  echo "postgres: the standby did not become synchronous (see $dir/server.log)" >&2
  exit 1
}

promote() { # DIR
  daemon_as_owner "$bin/pg_ctl" -D "$(physical "$1")/data" -w -t 60 promote > /dev/null
}

stop_bouncer() { # DIR
  local pidfile="$1/bouncer/pgbouncer.pid"
  [ -f "$pidfile" ] || return 0
  local pid
  pid=$(cat "$pidfile")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  rm -f "$pidfile"
}

stop() { # DIR MODE
  local dir mode="$2"
  [ -d "$1" ] || return 0
  dir="$(physical "$1")"
  stop_bouncer "$dir"
  [ -f "$dir/data/postmaster.pid" ] || return 0
  as_owner "$bin/pg_ctl" -D "$dir/data" -m "$mode" -w -t 60 stop > /dev/null || true
}

remove() { # DIR: stop it and remove its files (and the folder DIR links to, if it is a link)
  local dir="$1"
  stop "$dir" fast
  if [ -L "$dir" ]; then
    [ -d "$dir" ] && rm -rf "$(physical "$dir")"
    rm -f "$dir"
  else
    rm -rf "$dir"
  fi
}

case "${1:-}" in
  start) start "$2" "$3" "${4:-}" ;;
  stop) stop "$2" fast ;;
  kill) stop "$2" immediate ;;
  remove) remove "$2" ;;
  bouncer) bouncer "$2" "$3" "$4" ;;
  standby) standby "$2" "$3" "$4" "$5" ;;
  promote) promote "$2" ;;
  *) echo "usage: $0 start DIR PORT [TLSDIR] | stop DIR | kill DIR | remove DIR | bouncer DIR PORT PGPORT | standby DIR PORT PRIMARY_DIR PRIMARY_PORT | promote DIR" >&2; exit 64 ;;
esac
