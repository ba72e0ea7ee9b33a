#!/usr/bin/env python3
"""Canaille (an OAuth2/OIDC server with RFC 7591 registration) on 127.0.0.1 for dq's tests.

Usage: canaille_server.py --port PORT [--user NAME:PASSWORD] [--client ID[:SECRET[:METHOD]]]
                          [--key-client ID=JWKS] [--token-lifetime S] [--refresh-lifetime S]

In-memory database, open dynamic client registration, client_credentials, introspection. Configured as
pytest-iam 0.3.0 configures it for its own fixtures. For the authorization code flow (`dq login`):
--user creates a person who can sign in; --client creates a trusted client (public without a secret,
client_secret_basic with one, or the METHOD named, e.g. client_secret_post), --key-client one that
authenticates with private_key_jwt signed by a key of the public JWKS given (JSON), both for
authorization_code and refresh_token whose redirect URI is
http://127.0.0.1/callback on any port (RFC 8252 7.3); tokens are signed RS256; access and refresh tokens
of the code flow live --token-lifetime seconds. Refresh tokens stay valid until revoked (Canaille would
otherwise expire them with their access token), or for --refresh-lifetime seconds when given, and revocation accepts public clients (RFC 7009 2.1) and client assertions.
Authorization codes are looked up by code alone (Canaille 0.3.6's memory backend ORs query filters, so a
lookup by code and client could return another unused code of the same client).
"""
import argparse
import datetime
import os
import urllib.parse
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


def loopback_redirect(client, redirect_uri):
    """RFC 8252 7.3: a loopback redirect URI matches whatever port the native app listens on."""
    parsed = urllib.parse.urlsplit(redirect_uri)
    if parsed.scheme == "http" and parsed.hostname == "127.0.0.1":
        redirect_uri = urllib.parse.urlunsplit(("http", "127.0.0.1", parsed.path, parsed.query, ""))
    return redirect_uri in client.redirect_uris


def add_people_and_clients(app, users, clients, key_clients, refresh_lifetime=None):
    from canaille.app import models
    from canaille.backends import Backend
    from canaille.oidc import provider

    def query_authorization_code(grant, code, client):
        # The memory backend ORs the filters of a query (code=..., client=...): any code of the client could
        # come back. Look the code up alone and check its client here.
        for item in Backend.instance.query(models.AuthorizationCode, code=code):
            if item.code == code and item.client and item.client.client_id == client.client_id and not item.is_expired():
                return item
        return None

    provider.AuthorizationCodeGrant.query_authorization_code = query_authorization_code
    models.Client.check_redirect_uri = loopback_redirect
    def is_refresh_token_active(token):
        if token.revokation_date:
            return False
        if refresh_lifetime is None:
            return True
        return datetime.datetime.now(token.issue_date.tzinfo) < token.issue_date + datetime.timedelta(seconds=refresh_lifetime)

    models.Token.is_refresh_token_active = is_refresh_token_active
    provider.RevocationEndpoint.CLIENT_AUTH_METHODS = [
        "client_secret_basic", "client_secret_post", provider.JWTClientAuth.CLIENT_AUTH_METHOD, "none"]
    with app.app_context():
        for entry in users:
            name, password = entry.split(":", 1)
            Backend.instance.save(
                models.User(user_name=name, family_name=name, emails=[name + "@example.org"], password=password))
        entries = [(entry.split(":", 2) + ["", ""])[:3] + [None] for entry in clients]
        entries += [entry.split("=", 1)[:1] + ["", "private_key_jwt", entry.split("=", 1)[1]] for entry in key_clients]
        for client_id, secret, method, jwks in entries:
            client = models.Client(
                client_id=client_id,
                client_secret=secret or None,
                client_name=client_id,
                client_uri="http://127.0.0.1/",
                redirect_uris=["http://127.0.0.1/callback"],
                grant_types=["authorization_code", "refresh_token"],
                response_types=["code"],
                token_endpoint_auth_method=method or ("client_secret_basic" if secret else "none"),
                jwks=jwks,
                scope=["openid", "profile", "email", "offline_access", "fhirUser", "launch/patient",
                       "patient/*.cruds", "patient/Observation.cruds"],
                client_id_issued_at=datetime.datetime.now(datetime.timezone.utc),
            )
            Backend.instance.save(client)
            client.audience = [client]
            Backend.instance.save(client)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--user", action="append", default=[])
    parser.add_argument("--client", action="append", default=[])
    parser.add_argument("--key-client", action="append", default=[])
    parser.add_argument("--token-lifetime", type=int, default=3600)
    parser.add_argument("--refresh-lifetime", type=int, default=None)
    args = parser.parse_args()
    jwk = JWKRegistry.generate_key("RSA", 2048, parameters={"alg": "RS256", "use": "sig"})
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
        "OAUTH2_TOKEN_EXPIRES_IN": {
            "authorization_code": args.token_lifetime,
            "refresh_token": args.token_lifetime,
        },
    }
    app = create_app(config=config, env_file=None, env_prefix="DQ_TEST_CANAILLE_")
    if args.user or args.client or args.key_client:
        add_people_and_clients(app, args.user, args.client, args.key_client, args.refresh_lifetime)
    httpd = wsgiref.simple_server.make_server(
        "127.0.0.1", args.port, app, server_class=ThreadingWSGIServer, handler_class=QuietHandler)
    print("canaille on http://127.0.0.1:%d" % args.port, flush=True)
    httpd.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
