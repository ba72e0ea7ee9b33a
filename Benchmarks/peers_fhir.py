#!/usr/bin/env python3
"""Sequential creates with a peer FHIR client: peers_fhir.py fhirclient|fhirpy|requests BASE NDJSON -> items/s."""
import json
import sys
import time


def main():
    name, base, path = sys.argv[1:4]
    with open(path) as f:
        resources = [json.loads(line) for line in f if line.strip()]
    if name == "fhirclient":
        from fhirclient import server as fhirserver
        srv = fhirserver.FHIRServer(None, base_uri=base.rstrip("/") + "/")
        send = lambda r: srv.post_json(r["resourceType"], r)
    elif name == "fhirpy":
        from fhirpy import SyncFHIRClient
        client = SyncFHIRClient(base, extra_headers={"Content-Type": "application/fhir+json"})
        send = lambda r: client.resource(r["resourceType"], **r).create()
    else:
        import requests
        session = requests.Session()
        url = base.rstrip("/") + "/"

        def send(r):
            response = session.post(url + r["resourceType"], data=json.dumps(r),
                                    headers={"Content-Type": "application/fhir+json"})
            response.raise_for_status()
    start = time.perf_counter()
    for r in resources:
        send(r)
    print(len(resources) / (time.perf_counter() - start))


if __name__ == "__main__":
    main()
