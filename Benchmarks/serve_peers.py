#!/usr/bin/env python3
"""The peers of case 14 (`dq serve`), one subcommand each:

  serve_peers.py envelopes KEY.pem NDJSON OUT     one C3-PRO envelope per resource of NDJSON, one a line (needs
                                                  `cryptography`: run with .peers/venv's python)
  serve_peers.py receiver DB PORT TOKEN           the Python reference receiver: uvicorn, a tiny ASGI app and sqlite3,
                                                  one commit per request (run with .peers/bench's python)
  serve_peers.py sink PORT                        a FHIR server that costs nothing: 201 with a Location for one
                                                  resource, a matching transaction-response for a Bundle
"""
import base64
import hashlib
import json
import os
import sqlite3
import sys
import time


def envelope(public_key, key_id, resource):
    """As a C3-PRO app makes it (and scripts/torture.py): AES-256-CBC, zero IV, PKCS#7; the key RSA-OAEP-SHA1 wrapped."""
    from cryptography.hazmat.primitives import hashes, padding
    from cryptography.hazmat.primitives.asymmetric import padding as asymmetric
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    key = os.urandom(32)
    padder = padding.PKCS7(128).padder()
    data = padder.update(resource.encode()) + padder.finalize()
    encryptor = Cipher(algorithms.AES(key), modes.CBC(b"\0" * 16)).encryptor()
    message = encryptor.update(data) + encryptor.finalize()
    wrapped = public_key.encrypt(key, asymmetric.OAEP(mgf=asymmetric.MGF1(hashes.SHA1()), algorithm=hashes.SHA1(), label=None))
    return json.dumps({"key_id": key_id, "symmetric_key": base64.b64encode(wrapped).decode(),
                       "message": base64.b64encode(message).decode(), "version": "3.0.0"})


def envelopes(key_path, ndjson, out):
    from cryptography.hazmat.primitives import serialization
    with open(key_path, "rb") as f:
        public_key = serialization.load_pem_private_key(f.read(), password=None).public_key()
    with open(ndjson) as source, open(out, "w") as target:
        for line in source:
            if line.strip():
                target.write(envelope(public_key, "k1", line.rstrip("\n")) + "\n")


def receiver(database, port, token):
    """A receiver written the way a small one is: uvicorn (as `pip install uvicorn` gives it: h11, asyncio), one
    ASGI function, the standard library's sqlite3 on one connection, WAL and synchronous=FULL, the bearer token
    looked up and the envelope inserted and committed before the 202, one transaction per request."""
    import uvicorn
    db = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE IF NOT EXISTS token (hash TEXT PRIMARY KEY, client TEXT NOT NULL, expires REAL NOT NULL)")
    db.execute("CREATE TABLE IF NOT EXISTS envelope (id INTEGER PRIMARY KEY, client TEXT NOT NULL, type TEXT NOT NULL, "
               "body BLOB NOT NULL, received REAL NOT NULL)")
    db.execute("INSERT OR REPLACE INTO token VALUES (?, 'bench', ?)",
               (hashlib.sha256(token.encode()).hexdigest(), time.time() + 86400))
    prefix = "/c3pro/encfhir/"

    async def answer(send, status, body=b""):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")] if body else []})
        await send({"type": "http.response.body", "body": body})

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["method"] != "POST" or not scope["path"].startswith(prefix):
            return await answer(send, 404)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        authorization = dict(scope["headers"]).get(b"authorization", b"")
        if not authorization.startswith(b"Bearer "):
            return await answer(send, 401)
        found = db.execute("SELECT client FROM token WHERE hash = ? AND expires > ?",
                           (hashlib.sha256(authorization[7:]).hexdigest(), time.time())).fetchone()
        if found is None:
            return await answer(send, 401)
        try:
            sent = json.loads(body)
            if not all(isinstance(sent.get(k), str) for k in ("key_id", "symmetric_key", "message")):
                raise ValueError
        except ValueError:
            return await answer(send, 400, b'{"resourceType":"OperationOutcome"}')
        db.execute("BEGIN IMMEDIATE")
        db.execute("INSERT INTO envelope (client, type, body, received) VALUES (?, ?, ?, ?)",
                   (found[0], scope["path"][len(prefix):], body, time.time()))
        db.execute("COMMIT")
        await answer(send, 202)

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def sink(port):
    """Answers at once and keeps nothing: the FHIR server of a drain whose cost is dq's alone."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    responses = {}

    def transaction_response(count):
        if count not in responses:
            entry = {"response": {"status": "201 Created", "location": "Observation/1/_history/1"}}
            responses[count] = json.dumps(
                {"resourceType": "Bundle", "type": "transaction-response", "entry": [entry] * count}).encode()
        return responses[count]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if body.startswith(b'{"resourceType":"Bundle"') or b'"transaction"' in body[:200]:
                answer, status, extra = transaction_response(body.count(b'"request"')), 200, []
            else:
                answer, status, extra = b"", 201, [("Location", "Observation/1/_history/1")]
            self.send_response(status)
            for name, value in [("Content-Type", "application/fhir+json"), ("Content-Length", str(len(answer)))] + extra:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(answer)

        def do_GET(self):
            body = b'{"resourceType":"CapabilityStatement"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/fhir+json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main():
    command, args = sys.argv[1], sys.argv[2:]
    if command == "envelopes":
        envelopes(*args)
    elif command == "receiver":
        receiver(args[0], int(args[1]), args[2])
    elif command == "sink":
        sink(int(args[0]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
