#!/usr/bin/env python3
"""The same transaction Bundles dq sends, posted by a plain Python loop:
peers_bundles.py BASE NDJSON SIZE -> items/s (one Bundle in flight at a time, as dq)."""
import json
import sys
import time

import requests


def main():
    base, path, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(path) as f:
        resources = [json.loads(line) for line in f if line.strip()]
    bundles = []
    for start in range(0, len(resources), size):
        entries = [{"resource": r, "request": {"method": "POST", "url": r["resourceType"]}}
                   for r in resources[start:start + size]]
        bundles.append(json.dumps({"resourceType": "Bundle", "type": "transaction", "entry": entries}))
    session = requests.Session()
    headers = {"Content-Type": "application/fhir+json", "Prefer": "return=minimal"}
    begin = time.perf_counter()
    for body in bundles:
        response = session.post(base.rstrip("/"), data=body, headers=headers)
        response.raise_for_status()
    print(len(resources) / (time.perf_counter() - begin))


if __name__ == "__main__":
    main()
