#!/usr/bin/env python3
"""Canaille (an OAuth2/OIDC server with RFC 7591 registration) on 127.0.0.1 for dq's tests.

Usage: canaille_server.py --port PORT

In-memory database, open dynamic client registration, client_credentials, introspection. Configured as
pytest-iam 0.3.0 configures it for its own fixtures.
"""
import argparse
import os
import sys
import uuid
import wsgiref.simple_server
from socketserver import ThreadingMixIn

os.environ["AUTHLIB_INSECURE_TRANSPORT"] = "1"

from canaille import create_app  # noqa: E402
from joserfc.jwk import JWKRegistry  # noqa: E402


class ThreadingWSGIServer(ThreadingMixIn, wsgiref.simple_server.WSGIServer):
    daemon_threads = True


class QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    def log_request(self, *args):
        pass


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    jwk = JWKRegistry.generate_key("RSA", 2048)
    jwk.ensure_kid()
    config = {
        "TESTING": True,
        "ENV_FILE": None,
        "SECRET_KEY": str(uuid.uuid4()),
        "WTF_CSRF_ENABLED": False,
        "PREFERRED_URL_SCHEME": "http",
        "SERVER_NAME": "127.0.0.1:%d" % args.port,
        "CANAILLE": {
            "DATABASE": "memory",
            "ENABLE_REGISTRATION": True,
            "JAVASCRIPT": False,
            "ACL": {"DEFAULT": {"PERMISSIONS": ["use_oidc", "manage_oidc"]}},
            "LOGGING": {
                "version": 1,
                "disable_existing_loggers": False,
                "handlers": {"canaille": {"class": "logging.NullHandler"}},
                "loggers": {"canaille": {"level": "DEBUG", "handlers": ["canaille"]}},
            },
        },
        "CANAILLE_OIDC": {
            "DYNAMIC_CLIENT_REGISTRATION_OPEN": True,
            "ACTIVE_JWKS": [jwk.as_dict(private=True)],
        },
    }
    app = create_app(config=config, env_file=None, env_prefix="DQ_TEST_CANAILLE_")
    httpd = wsgiref.simple_server.make_server(
        "127.0.0.1", args.port, app, server_class=ThreadingWSGIServer, handler_class=QuietHandler)
    print("canaille on http://127.0.0.1:%d" % args.port, flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
