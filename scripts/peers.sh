#!/usr/bin/env bash
# Installs and runs the real servers dq is tested against, on free loopback ports.
#
#   scripts/peers.sh install          create .peers/venv (sekmet-fhir, cryptography, fhirkit-rs) and .peers/canaille (idempotent)
#   scripts/peers.sh bench            also .peers/bench with the benchmark peers (fhirclient, fhirpy, queues, uvicorn)
#   scripts/peers.sh start            start a shared sekmet-fhir, a PostgreSQL server and PgBouncer in front of it (scripts/postgres.sh);
#                                     writes .peers/env (DQ_TEST_FHIR_BASE, DQ_TEST_POSTGRES_URL, ...)
#   scripts/peers.sh stop             stop exactly the processes `start` started
#   scripts/peers.sh fhir DIR PORT    run sekmet-fhir in the foreground with its data in DIR (used by tests)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
peers="$root/.peers"
venv="$peers/venv"
PY="${PYTHON:-python3}"

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }

# sekmet-fhir and the Python checks of the tests (all that `make demo` needs).
install_fhir() {
  mkdir -p "$peers"
  if [ ! -f "$venv/.installed-v6" ]; then
    "$PY" -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "sekmet-fhir==0.1.1" "cryptography==50.0.2" "PyJWT==2.15.1" \
      "fhirkit-rs==0.1.0" "prometheus_client==0.21.1" "requests==2.34.2"
    touch "$venv/.installed-v6"
  fi
}

install() {
  install_fhir
  # Canaille (OAuth2 with RFC 7591 registration) in its own venv: its Flask stack is not sekmet's.
  if [ ! -f "$peers/canaille/.installed-v1" ]; then
    "$PY" -m venv "$peers/canaille"
    "$peers/canaille/bin/pip" install --quiet --disable-pip-version-check \
      "pytest-iam==0.3.0" "canaille==0.3.6" "authlib==1.9.9" "joserfc==1.8.0"
    touch "$peers/canaille/.installed-v1"
  fi
}

write_settings() { # DIR PORT
  mkdir -p "$1"
  cat > "$1/settings.yaml" <<YAML
host: 127.0.0.1
port: $2
base_url: http://127.0.0.1:$2/fhir
data_dir: $1/data
log_inbound: false
simulator: {enabled: false}
server_auth:
  types: [none]
YAML
}

wait_ready() { # URL
  for _ in $(seq 1 150); do
    if curl -fsS -o /dev/null "$1/metadata" 2>/dev/null; then return 0; fi
    sleep 0.2
  done
  echo "peers: $1 did not become ready" >&2
  return 1
}

bench() {
  install
  if [ ! -f "$peers/bench/.installed-v3" ]; then
    "$PY" -m venv "$peers/bench"
    "$peers/bench/bin/pip" install --quiet --disable-pip-version-check \
      "fhirclient==4.4.0" "fhirpy==2.3.1" "requests==2.34.2" "persist-queue==1.1.0" "litequeue==0.9" \
      "pgqueuer==1.6.0" "asyncpg==0.32.0" "uvicorn==0.54.0"
    touch "$peers/bench/.installed-v3"
  fi
}

case "${1:-}" in
  install) install ;;
  install-fhir) install_fhir ;;
  bench) bench ;;
  fhir)
    dir="$2"; port="$3"
    write_settings "$dir" "$port"
    cd "$dir"
    exec "$venv/bin/sekmet" serve -c "$dir/settings.yaml"
    ;;
  start)
    install
    "$0" stop >/dev/null 2>&1 || true
    port=$(free_port)
    dir="$peers/run/fhir"
    rm -rf "$dir"; mkdir -p "$dir"
    write_settings "$dir" "$port"
    cd "$dir"
    nohup "$venv/bin/sekmet" serve -c "$dir/settings.yaml" > "$dir/server.log" 2>&1 &
    echo $! > "$peers/fhir.pid"
    cd "$root"
    wait_ready "http://127.0.0.1:$port/fhir"
    pg_port=$(free_port)
    rm -rf "$peers/run/pg"
    pg_url=$("$root/scripts/postgres.sh" start "$peers/run/pg" "$pg_port")
    bouncer_url=$("$root/scripts/postgres.sh" bouncer "$peers/run/pg" "$(free_port)" "$pg_port")
    {
      echo "DQ_TEST_FHIR_BASE=http://127.0.0.1:$port/fhir"
      echo "DQ_PEERS_VENV=$venv"
      echo "DQ_TEST_POSTGRES_URL=$pg_url"
      echo "DQ_TEST_POSTGRES_PASSWORD=$(cat "$peers/run/pg/password")"
      echo "DQ_TEST_PGBOUNCER_URL=$bouncer_url"
    } > "$peers/env"
    echo "peers: sekmet-fhir on http://127.0.0.1:$port/fhir (pid $(cat "$peers/fhir.pid")), PostgreSQL on $pg_url, PgBouncer (transaction mode) on $bouncer_url"
    ;;
  stop)
    if [ -f "$peers/fhir.pid" ]; then
      pid=$(cat "$peers/fhir.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$peers/fhir.pid" "$peers/env"
      echo "peers: stopped sekmet-fhir (pid $pid)"
    fi
    if [ -d "$peers/run/pg/data" ]; then
      "$root/scripts/postgres.sh" stop "$peers/run/pg"
      echo "peers: stopped PostgreSQL"
    fi
    ;;
  *) echo "usage: $0 install|install-fhir|bench|start|stop|fhir DIR PORT" >&2; exit 64 ;;
esac
