#!/usr/bin/env python3
"""A fault-injecting HTTP reverse proxy for dq's tests (standard library only).

Usage: faultproxy.py --listen PORT --upstream http://127.0.0.1:18080 [--random RATE --seed N]

Every request is forwarded to the upstream unless a fault is scripted for it (a GET of the CapabilityStatement,
`/metadata`, always passes: faults are for the writes). Faults are taken in order
from a script that tests fill through the control endpoint, or drawn at random with --random:

  pass            forward normally
  503[:SECONDS]   answer 503 with Retry-After (default 1) without forwarding
  drop-before     close the connection without forwarding (the server never sees the request)
  drop-after      forward (the server commits), then close the connection without answering
  delay:MS        forward after MS milliseconds
  stall:SECONDS   forward, then hold the answer SECONDS before sending it (beyond a client timeout)
  pad:BYTES       forward, then add BYTES of trailing whitespace to the answer's body (a huge answer)
  hold            forward, then hold the answer until POST /__proxy/release (at most 300 s): a request on the
                  wire for exactly as long as a test needs, whatever the machine's load

Server behaviours (flags): --max-entries N answers 413 to a transaction Bundle of more than N entries;
--no-transactions answers 405 to every transaction Bundle; --latency MS delays every request by MS
milliseconds each way (a slow link); --no-conditional-create takes `conditionalCreate` out of the
upstream's CapabilityStatement (a server that offers no way to be exactly once). Stats count the transaction
Bundles forwarded and their entries.

Control (never forwarded):
  POST /__proxy/faults   JSON list of faults to append to the script
  GET  /__proxy/stats    JSON counts: requests, forwarded, and each fault injected
  POST /__proxy/reset    clear the script and the counts
  POST /__proxy/release  send the held answers, and every later one of a hold at once
"""
import argparse
import http.client
import json
import random
import socket
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
SCRIPT = []
STATS = {"requests": 0, "forwarded": 0, "faults": {}, "tokens": [], "registrations": [], "bundles": 0, "entries": 0,
         "refused_bundles": 0, "holding": 0}
RELEASE = threading.Event()
ARGS = None
RNG = random.Random(0)
RANDOM_FAULTS = ["503:1", "drop-before", "drop-after", "delay:50", "stall:STALL"]


def next_fault():
    with LOCK:
        STATS["requests"] += 1
        if SCRIPT:
            return SCRIPT.pop(0)
        if ARGS.random > 0 and RNG.random() < ARGS.random:
            return RNG.choice(RANDOM_FAULTS).replace("STALL", str(ARGS.stall))
    return "pass"


def count(name):
    with LOCK:
        STATS["faults"][name] = STATS["faults"].get(name, 0) + 1


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _body(self):
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _reply(self, status, body=b"", headers=None):
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _control(self, body):
        global SCRIPT
        if self.path == "/__proxy/faults":
            with LOCK:
                SCRIPT.extend(json.loads(body or b"[]"))
            return self._reply(204)
        if self.path == "/__proxy/stats":
            with LOCK:
                data = json.dumps(STATS).encode()
            return self._reply(200, data, {"Content-Type": "application/json"})
        if self.path == "/__proxy/release":
            RELEASE.set()
            return self._reply(204)
        if self.path == "/__proxy/reset":
            RELEASE.clear()
            with LOCK:
                SCRIPT = []
                STATS.update({"requests": 0, "forwarded": 0, "faults": {}, "tokens": [], "registrations": []})
            return self._reply(204)
        return self._reply(404)

    def _drop(self):
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _transaction_entries(self, body):
        """The number of entries when the request is a transaction Bundle posted to the base, else None."""
        if self.command != "POST" or not body.startswith(b"{") or b'"transaction"' not in body[:200]:
            return None
        try:
            bundle = json.loads(body)
        except ValueError:
            return None
        if bundle.get("resourceType") != "Bundle" or bundle.get("type") != "transaction":
            return None
        return len(bundle.get("entry", []))

    @staticmethod
    def _without_conditional_create(data):
        try:
            statement = json.loads(data)
            for rest in statement.get("rest", []):
                for resource in rest.get("resource", []):
                    resource.pop("conditionalCreate", None)
            return json.dumps(statement).encode()
        except (ValueError, AttributeError):
            return data

    def _forward(self, body):
        upstream = urllib.parse.urlsplit(ARGS.upstream)
        connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        connection.request(self.command, self.path, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
        with LOCK:
            STATS["forwarded"] += 1
            if b"access_token" in data:  # lets tests check that no token leaks into dq's output
                try:
                    STATS["tokens"].append(json.loads(data)["access_token"])
                except (ValueError, KeyError):
                    pass
        keep = {k: v for k, v in response.getheaders()
                if k.lower() not in ("content-length", "transfer-encoding", "connection")}
        connection.close()
        return response.status, data, keep

    def _handle(self):
        body = self._body()
        if self.path.startswith("/__proxy/"):
            return self._control(body)
        if "register" in self.path and self.command == "POST":
            with LOCK:  # lets tests check what a registration request carried
                STATS["registrations"].append({"headers": dict(self.headers.items()), "body": body.decode("utf-8", "replace")})
        if ARGS.latency > 0:
            time.sleep(ARGS.latency / 1000.0)
        entries = self._transaction_entries(body)
        if entries is not None:
            too_many = ARGS.max_entries > 0 and entries > ARGS.max_entries
            if ARGS.no_transactions or too_many:
                with LOCK:
                    STATS["requests"] += 1
                    STATS["refused_bundles"] += 1
                if too_many:
                    return self._reply(413, b'{"resourceType":"OperationOutcome","issue":[{"severity":"error",'
                                       b'"code":"too-costly","diagnostics":"too many entries"}]}',
                                       {"Content-Type": "application/fhir+json"})
                return self._reply(405, b'{"resourceType":"OperationOutcome","issue":[{"severity":"error",'
                                   b'"code":"not-supported","diagnostics":"transaction is not supported"}]}',
                                   {"Content-Type": "application/fhir+json"})
        if self.command == "GET" and self.path.split("?")[0].rstrip("/").endswith("/metadata"):
            # The CapabilityStatement read is not a write: scripted faults are for the writes after it.
            with LOCK:
                STATS["requests"] += 1
            fault = "pass"
        else:
            fault = next_fault()
        name = fault.split(":")[0]
        if name != "pass":
            count(name)
        if name == "503":
            seconds = fault.split(":")[1] if ":" in fault else "1"
            return self._reply(503, b'{"resourceType":"OperationOutcome"}',
                               {"Retry-After": seconds, "Content-Type": "application/fhir+json"})
        if name == "drop-before":
            return self._drop()
        if name == "delay":
            time.sleep(int(fault.split(":")[1]) / 1000.0)
        status, data, headers = self._forward(body)
        if ARGS.no_conditional_create and self.command == "GET" and self.path.split("?")[0].rstrip("/").endswith("/metadata"):
            data = self._without_conditional_create(data)
        if entries is not None:
            with LOCK:
                STATS["bundles"] += 1
                STATS["entries"] += entries
        if ARGS.latency > 0:
            time.sleep(ARGS.latency / 1000.0)
        if name == "drop-after":
            return self._drop()
        if name == "stall":
            time.sleep(float(fault.split(":")[1]))
        if name == "hold":
            with LOCK:
                STATS["holding"] += 1
            RELEASE.wait(timeout=300)
            with LOCK:
                STATS["holding"] -= 1
        if name == "pad":
            data = data + b" " * int(fault.split(":")[1])
        try:
            self._reply(status, data, headers)
        except (BrokenPipeError, ConnectionResetError):
            pass

    do_GET = do_POST = do_PUT = do_DELETE = _handle


def main():
    global ARGS, RNG
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--random", type=float, default=0.0, help="share of requests given a random fault")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stall", type=float, default=3.0, help="seconds a random stall lasts")
    parser.add_argument("--max-entries", type=int, default=0, help="413 for transaction Bundles with more entries")
    parser.add_argument("--no-transactions", action="store_true", help="405 for every transaction Bundle")
    parser.add_argument("--latency", type=float, default=0.0, help="milliseconds added each way to every request")
    parser.add_argument("--no-conditional-create", action="store_true",
                        help="the CapabilityStatement declares conditional create for no type")
    parser.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="the certificate's private key (PEM)")
    ARGS = parser.parse_args()
    RNG = random.Random(ARGS.seed)
    server = ThreadingHTTPServer(("127.0.0.1", ARGS.listen), Handler)
    server.daemon_threads = True
    if ARGS.tls_cert:
        import ssl
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(ARGS.tls_cert, ARGS.tls_key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    print(f"faultproxy listening on 127.0.0.1:{ARGS.listen} -> {ARGS.upstream}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
