#!/usr/bin/env python3
"""A SMART-on-FHIR front for dq's sign-in tests: what an EHR puts before its FHIR API.

Usage: smart_gate.py --port PORT --fhir SEKMET_BASE --issuer CANAILLE_BASE [--patient ID] [--public-host NAME]

- GET  /fhir/.well-known/smart-configuration: Canaille's authorization and revocation endpoints, this
  gate's token endpoint, the issuer, and the JWKS that signs ID tokens.
- GET /jwks: Canaille's JWKS passed through (503 while the control's `jwks_down` is set).
  The smart-configuration names this gate's own endpoints by `--public-host` (default 127.0.0.1): a name
  that only a test's proxy resolves proves that dq fetched them through it.
- POST /token: passes the form to Canaille's token endpoint and adds the SMART launch context
  (`patient`, `encounter`) to a successful answer. A tamper mode (set over /_gate/control) changes the
  ID token first, to prove that dq refuses it: `bad-signature` flips a bit of Canaille's signature;
  `wrong-aud`, `wrong-nonce`, `expired` and `es256` re-sign the changed claims with this gate's own
  P-256 key (ES256), which the JWKS then lists instead of Canaille's; `es256` adds a `fhirUser` claim,
  and gives refresh answers (Canaille's have none) a new ID token for the same person.
  Every code, PKCE verifier and token that passes is recorded, for the tests to grep dq's output for.
- /fhir/*: each request must carry a Bearer access token that Canaille signed (checked with PyJWT against
  Canaille's JWKS, with `exp`), issued at or after the control's `reject_before`; it is then forwarded to
  sekmet-fhir without the header. Anything else is answered 401.
- POST /_gate/control {"tamper": MODE|null, "reject_issued_before_now": true, "jwks_down": bool};
  GET /_gate/stats: counts of token requests by grant type, FHIR requests accepted and refused, JWKS
  served, and the secrets seen.
"""
import argparse
import base64
import json
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jwt
from cryptography.hazmat.primitives.asymmetric import ec

STATE = {"tamper": None, "reject_before": 0.0, "jwks_down": False}
STATS = {"grants": {}, "fhir_accepted": 0, "fhir_refused": 0, "jwks_served": 0, "secrets": []}
LOCK = threading.Lock()
GATE_KEY = ec.generate_private_key(ec.SECP256R1())
GATE_KID = "gate-es256"


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def gate_jwks():
    numbers = GATE_KEY.public_key().public_numbers()
    return {"keys": [{
        "kty": "EC", "crv": "P-256", "kid": GATE_KID, "alg": "ES256", "use": "sig",
        "x": b64url(numbers.x.to_bytes(32, "big")), "y": b64url(numbers.y.to_bytes(32, "big")),
    }]}


def tamper(id_token, mode):
    if mode == "bad-signature":
        head, body, signature = id_token.split(".")
        raw = bytearray(base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4)))
        raw[len(raw) // 2] ^= 0x01
        return ".".join([head, body, b64url(bytes(raw))])
    claims = jwt.decode(id_token, options={"verify_signature": False})
    if mode == "wrong-aud":
        claims["aud"] = ["someone-else"]
    elif mode == "wrong-nonce":
        claims["nonce"] = "not-the-nonce-dq-sent"
    elif mode == "expired":
        claims["iat"] = int(time.time()) - 7200
        claims["exp"] = int(time.time()) - 3600
    elif mode == "es256":
        claims["fhirUser"] = FHIR_USER
    return jwt.encode(claims, GATE_KEY, algorithm="ES256", headers={"kid": GATE_KID})


FHIR_USER = "Patient/example-patient"


LAST_CLAIMS = {}


def reissue():
    """A new ES256 ID token for the person of the last sign-in (for a refresh answer)."""
    claims = dict(LAST_CLAIMS, iat=int(time.time()), exp=int(time.time()) + 300)
    claims.pop("nonce", None)
    return jwt.encode(claims, GATE_KEY, algorithm="ES256", headers={"kid": GATE_KID})


def record(*values):
    with LOCK:
        STATS["secrets"].extend(value for value in values if isinstance(value, str) and value)


def main():
    global FHIR_USER
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fhir", required=True)
    parser.add_argument("--issuer", required=True)
    parser.add_argument("--patient", default="example-patient")
    parser.add_argument("--public-host", default="127.0.0.1")
    args = parser.parse_args()
    FHIR_USER = "Patient/" + args.patient
    issuer = args.issuer.rstrip("/")
    base = "http://%s:%d" % (args.public_host, args.port)
    jwks_client = jwt.PyJWKClient(issuer + "/oauth/jwks.json")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def reply(self, status, body=b"", content_type="application/json", headers=()):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def body(self):
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def do_GET(self):
            if self.path == "/fhir/.well-known/smart-configuration":
                resign = STATE["tamper"] not in (None, "bad-signature")
                document = {
                    "issuer": issuer,
                    "jwks_uri": base + "/jwks",
                    "authorization_endpoint": issuer + "/oauth/authorize",
                    "token_endpoint": base + "/token",
                    "revocation_endpoint": issuer + "/oauth/revoke",
                    "code_challenge_methods_supported": ["S256"],
                    "capabilities": ["launch-standalone", "client-public", "client-confidential-symmetric",
                                     "context-standalone-patient", "permission-offline", "sso-openid-connect"],
                }
                return self.reply(200, json.dumps(document).encode())
            if self.path == "/jwks":
                with LOCK:
                    down, resign = STATE["jwks_down"], STATE["tamper"] not in (None, "bad-signature")
                if down:
                    return self.reply(503, b'{"error":"temporarily_unavailable"}')
                STATS["jwks_served"] += 1
                if resign:
                    return self.reply(200, json.dumps(gate_jwks()).encode())
                with urllib.request.urlopen(issuer + "/oauth/jwks.json", timeout=30) as response:
                    return self.reply(200, response.read())
            if self.path == "/_gate/stats":
                with LOCK:
                    return self.reply(200, json.dumps(STATS).encode())
            return self.fhir("GET")

        def do_POST(self):
            if self.path == "/token":
                return self.token()
            if self.path == "/_gate/control":
                control = json.loads(self.body() or b"{}")
                with LOCK:
                    if "tamper" in control:
                        STATE["tamper"] = control["tamper"]
                    if "jwks_down" in control:
                        STATE["jwks_down"] = bool(control["jwks_down"])
                    if control.get("reject_issued_before_now"):
                        STATE["reject_before"] = time.time()
                return self.reply(200, b"{}")
            return self.fhir("POST")

        def do_PUT(self):
            return self.fhir("PUT")

        def token(self):
            form = self.body()
            fields = urllib.parse.parse_qs(form.decode())
            grant = fields.get("grant_type", ["?"])[0]
            record(*(fields.get(name, [""])[0] for name in ("code", "code_verifier", "refresh_token", "client_assertion")))
            with LOCK:
                STATS["grants"][grant] = STATS["grants"].get(grant, 0) + 1
            headers = {"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"}
            if self.headers.get("Authorization"):
                headers["Authorization"] = self.headers["Authorization"]
            request = urllib.request.Request(issuer + "/oauth/token", data=form, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    status, answer = response.status, json.loads(response.read())
            except urllib.error.HTTPError as error:
                return self.reply(error.code, error.read())
            answer["patient"] = args.patient
            answer["encounter"] = "enc-7"
            mode = STATE["tamper"]
            if mode and "id_token" in answer:
                answer["id_token"] = tamper(answer["id_token"], mode)
                LAST_CLAIMS.clear()
                LAST_CLAIMS.update(jwt.decode(answer["id_token"], options={"verify_signature": False}))
            elif mode == "es256" and grant == "refresh_token" and LAST_CLAIMS:
                answer["id_token"] = reissue()
            record(answer.get("access_token"), answer.get("refresh_token"), answer.get("id_token"))
            return self.reply(status, json.dumps(answer).encode(), headers=[("Cache-Control", "no-store")])

        def fhir(self, method):
            body = self.body() if method != "GET" else None
            authorization = self.headers.get("Authorization", "")
            try:
                if not authorization.startswith("Bearer "):
                    raise ValueError("no bearer token")
                token = authorization[len("Bearer "):]
                key = jwks_client.get_signing_key_from_jwt(token)
                claims = jwt.decode(token, key.key, algorithms=["RS256", "RS512"], issuer=issuer,
                                    options={"verify_aud": False, "require": ["exp", "iat"]})
                with LOCK:
                    if claims["iat"] < STATE["reject_before"]:
                        raise ValueError("token issued before the reject mark")
            except Exception:
                with LOCK:
                    STATS["fhir_refused"] += 1
                return self.reply(401, b'{"resourceType":"OperationOutcome","issue":[{"severity":"error","code":"login"}]}',
                                  headers=[("WWW-Authenticate", 'Bearer error="invalid_token"')])
            with LOCK:
                STATS["fhir_accepted"] += 1
            path = self.path[len("/fhir"):] if self.path.startswith("/fhir") else self.path
            headers = {name: value for name, value in self.headers.items()
                       if name.lower() in ("content-type", "accept", "if-none-exist", "if-match", "prefer")}
            request = urllib.request.Request(args.fhir.rstrip("/") + path, data=body, method=method, headers=headers)
            try:
                response = urllib.request.urlopen(request, timeout=30)
                status = response.status
            except urllib.error.HTTPError as error:
                response, status = error, error.code
            answer = response.read()
            passed = [(name, value) for name, value in response.headers.items()
                      if name.lower() in ("location", "etag", "last-modified")]
            return self.reply(status, answer, response.headers.get("Content-Type", "application/fhir+json"), passed)

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print("smart gate on %s" % base, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
