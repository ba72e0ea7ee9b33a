#!/usr/bin/env python3
"""Plays the person in dq's sign-in tests: follows an authorization URL through Canaille's forms.

Usage: sign_in.py URL --user NAME --password PASSWORD [--stop-at-redirect]

Follows the authorization URL with cookies, submits the login form (field `login`), the password form
(field `password`) and, when asked, the consent form (`answer=accept`), then:
- by default follows the final redirect to the app's loopback listener (as a browser would) and prints
  its status and the listener's page;
- with --stop-at-redirect, does not follow it and prints the redirect URL (what a person on a headless
  machine copies from the address bar to paste into `dq login --no-browser`).
Exits 1 when the provider answers something unexpected. Standard library only.
"""
import argparse
import http.cookiejar
import sys
import urllib.error
import urllib.parse
import urllib.request


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--user", required=True)
    parser.add_argument("--password", required=True)
    parser.add_argument("--stop-at-redirect", action="store_true")
    args = parser.parse_args()

    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar), NoRedirect())
    provider = urllib.parse.urlsplit(args.url)

    def request(url, form=None):
        data = urllib.parse.urlencode(form).encode() if form is not None else None
        try:
            response = opener.open(urllib.request.Request(url, data=data), timeout=30)
            return response.status, response.headers, response.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as error:
            return error.code, error.headers, error.read().decode("utf-8", "replace")

    url, form = args.url, None
    authorize_url = args.url
    for _ in range(20):
        status, headers, body = request(url, form)
        form = None
        if status in (301, 302, 303, 307):
            location = urllib.parse.urljoin(url, headers["Location"])
            target = urllib.parse.urlsplit(location)
            if (target.scheme, target.netloc) != (provider.scheme, provider.netloc):
                # The redirect back to the app: the end of the provider's part.
                if args.stop_at_redirect:
                    print(location)
                    return 0
                status, _, body = request(location)
                print(status)
                print(body)
                return 0 if status == 200 else 1
            url = location
            continue
        path = urllib.parse.urlsplit(url).path
        if status == 200 and path.endswith("/login"):
            form = {"login": args.user}
        elif status == 200 and path.endswith("/password"):
            form = {"password": args.password}
        elif status == 200 and "/oauth/authorize" in path:
            url, form = authorize_url if "answer" in body else url, {"answer": "accept"}
        else:
            print("sign_in: unexpected answer %d at %s" % (status, path), file=sys.stderr)
            print(body[:2000], file=sys.stderr)
            return 1
    print("sign_in: too many steps", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
