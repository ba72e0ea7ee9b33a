#!/usr/bin/env bash
# The main job of dq, end to end on loopback: resources are queued while the FHIR server is down,
# survive, and are delivered in order once it is up.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dq="${DQ_BIN:-$root/.build/debug/dq}"
work="$(mktemp -d /tmp/dq-demo.XXXXXX)"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()')
export DQ_SERVER="http://127.0.0.1:$port/fhir" DQ_DATABASE="$work/queue.sqlite"
server_pid=""
cleanup() { [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "The FHIR server at $DQ_SERVER is down. Queue four resources:"
echo "\$ dq enqueue Fixtures/resources/*.json"
"$dq" enqueue "$root"/Fixtures/resources/*.json

step "A flush from cron cannot deliver them: exit 75 (temporary failure), nothing lost"
echo "\$ dq flush"
"$dq" flush 2>&1 && rc=0 || rc=$?
echo "exit code: $rc"
echo "\$ dq status"
"$dq" status

step "Start the real FHIR server (sekmet-fhir) on port $port"
"$root/scripts/peers.sh" fhir "$work/server" "$port" > "$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 150); do curl -fsS -o /dev/null "$DQ_SERVER/metadata" 2>/dev/null && break; sleep 0.2; done

step "Flush now (--now skips the backoff the failure started)"
echo "\$ dq flush --now"
"$dq" flush --now
echo "\$ dq log"
"$dq" log

step "What arrived on the server, oldest first:"
curl -fsS "$DQ_SERVER/_history?_count=50" | python3 -c '
import json, sys
entries = json.load(sys.stdin).get("entry", [])
for e in reversed(entries):
    r = e["resource"]
    if r["resourceType"] == "Basic":
        continue  # seed data of the server
    print("  %s/%s  %s" % (r["resourceType"], r["id"], e["response"]["status"]))
'
