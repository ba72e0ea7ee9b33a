#!/usr/bin/env python3
"""An independent C3-PRO receiver for dq's tests, written with Python `cryptography`.

It decrypts envelopes exactly as the Java C3-PRO consumer does -- RSA/ECB/OAEPWithSHA1AndMGF1Padding for
the key, AES/CBC/PKCS5Padding with a zero IV for the message -- and dq's authenticated format
("alg": "A256GCM+RSA-OAEP-256": OAEP with SHA-256/MGF1-SHA-256, AES-256-GCM nonce|ciphertext|tag).

  c3pro_receiver.py serve --listen PORT --key private.pem --forward http://127.0.0.1:P/fhir [--reply empty|ok]
      POST /<anything>/<ResourceType> with an envelope: decrypt, check the resource type, forward the resource
      to the FHIR server, answer 200 with an empty body (or "OK"). A failure is answered the way the C3-PRO
      servlet does: HTTP 200 with a body {'error':'...'}.
      GET /__receiver/stats: JSON {received, forwarded, failed}.
  c3pro_receiver.py seal --cert cert.pem --key-id ID [--fhir-version V] FILE
      print a C3-PRO envelope of FILE, made independently of dq.
  c3pro_receiver.py open --key private.pem FILE
      print the resource inside an envelope.
"""
import argparse
import base64
import json
import os
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cryptography import x509
from cryptography.hazmat.primitives import hashes, padding, serialization
from cryptography.hazmat.primitives.asymmetric import padding as asym
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MARKER = "A256GCM+RSA-OAEP-256"


def oaep(sha256):
    algorithm = hashes.SHA256() if sha256 else hashes.SHA1()
    return asym.OAEP(mgf=asym.MGF1(algorithm=algorithm), algorithm=algorithm, label=None)


def open_envelope(private_key, body):
    envelope = json.loads(body)
    for field in ("key_id", "symmetric_key", "message", "version"):
        if not isinstance(envelope.get(field), str):
            raise ValueError("missing " + field)
    authenticated = envelope.get("alg") == MARKER
    key = private_key.decrypt(base64.b64decode(envelope["symmetric_key"], validate=True), oaep(authenticated))
    message = base64.b64decode(envelope["message"], validate=True)
    if authenticated:
        return AESGCM(key).decrypt(message[:12], message[12:], None), envelope
    decryptor = Cipher(algorithms.AES(key), modes.CBC(b"\0" * 16)).decryptor()
    padded = decryptor.update(message) + decryptor.finalize()
    unpadder = padding.PKCS7(128).unpadder()
    return unpadder.update(padded) + unpadder.finalize(), envelope


def seal(public_key, key_id, version, plaintext):
    key = os.urandom(32)
    padder = padding.PKCS7(128).padder()
    padded = padder.update(plaintext) + padder.finalize()
    encryptor = Cipher(algorithms.AES(key), modes.CBC(b"\0" * 16)).encryptor()
    message = encryptor.update(padded) + encryptor.finalize()
    return json.dumps({
        "key_id": key_id,
        "symmetric_key": base64.b64encode(public_key.encrypt(key, oaep(False))).decode(),
        "message": base64.b64encode(message).decode(),
        "version": version,
    })


def load_private(path):
    with open(path, "rb") as f:
        return serialization.load_pem_private_key(f.read(), password=None)


def load_public(path):
    with open(path, "rb") as f:
        data = f.read()
    if b"BEGIN CERTIFICATE" in data:
        return x509.load_pem_x509_certificate(data).public_key()
    if b"BEGIN PUBLIC KEY" in data:
        return serialization.load_pem_public_key(data)
    return x509.load_der_x509_certificate(data).public_key()


def serve(args):
    private_key = load_private(args.key)
    stats = {"received": 0, "forwarded": 0, "failed": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def reply(self, body):
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            with lock:
                self.reply(json.dumps(stats))

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                stats["received"] += 1
            resource_type = self.path.rstrip("/").split("/")[-1]
            try:
                if self.headers.get("Content-Type", "").split(";")[0] != "application/json":
                    raise ValueError("content type")
                plaintext, _ = open_envelope(private_key, body)
                resource = json.loads(plaintext)
                if resource.get("resourceType") != resource_type:
                    raise ValueError("resource type does not match the URL")
                request = urllib.request.Request(
                    args.forward.rstrip("/") + "/" + resource_type, data=plaintext, method="POST",
                    headers={"Content-Type": "application/fhir+json"})
                with urllib.request.urlopen(request, timeout=30) as response:
                    if response.status not in (200, 201):
                        raise ValueError("FHIR server answered %d" % response.status)
            except Exception as error:  # the C3-PRO servlet answers 200 with an error body
                with lock:
                    stats["failed"] += 1
                return self.reply("{'error':'%s'}" % type(error).__name__)
            with lock:
                stats["forwarded"] += 1
            self.reply('"OK"' if args.reply == "ok" else "")

    server = ThreadingHTTPServer(("127.0.0.1", args.listen), Handler)
    server.daemon_threads = True
    print("c3pro receiver on 127.0.0.1:%d" % args.listen, flush=True)
    server.serve_forever()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", type=int, required=True)
    s.add_argument("--key", required=True)
    s.add_argument("--forward", required=True)
    s.add_argument("--reply", choices=["empty", "ok"], default="empty")
    e = sub.add_parser("seal")
    e.add_argument("--cert", required=True)
    e.add_argument("--key-id", required=True)
    e.add_argument("--fhir-version", default="1.0.2")
    e.add_argument("file")
    o = sub.add_parser("open")
    o.add_argument("--key", required=True)
    o.add_argument("file")
    args = parser.parse_args()
    if args.command == "serve":
        return serve(args)
    with open(args.file, "rb") as f:
        data = f.read()
    if args.command == "seal":
        sys.stdout.write(seal(load_public(args.cert), args.key_id, args.fhir_version, data))
    else:
        plaintext, _ = open_envelope(load_private(args.key), data)
        sys.stdout.buffer.write(plaintext)
    return 0


if __name__ == "__main__":
    sys.exit(main())
