#!/usr/bin/env python3
"""The Python PostgreSQL queue reference for `make bench` case 12: pgqueuer enqueuing the same payloads.

Usage: pg_reference.py DSN COUNT SIZE PRODUCERS   (prints {"per_second": ...})

Each job is one autocommit INSERT (durable at commit, synchronous_commit=on), as pgqueuer enqueues one job;
PRODUCERS asyncio tasks share a pool of PRODUCERS connections.
"""
import asyncio
import json
import sys
import time

import asyncpg
from pgqueuer.queries import Queries


def resource(i, size=1024):
    head = '{"resourceType":"Observation","status":"final","identifier":[{"system":"urn:bench","value":"%d"}],"code":{"text":"' % i
    return head + "x" * max(0, size - len(head) - 3) + '"}}'


async def main(dsn, count, size, producers):
    pool = await asyncpg.create_pool(dsn, min_size=producers, max_size=producers)
    queries = Queries.from_asyncpg_pool(pool)
    await queries.install()
    per = count // producers
    payloads = [resource(i, size).encode() for i in range(per * producers)]

    async def producer(p):
        for i in range(per):
            await queries.enqueue("fhir", payloads[p * per + i])

    start = time.perf_counter()
    await asyncio.gather(*(producer(p) for p in range(producers)))
    elapsed = time.perf_counter() - start
    await pool.close()
    print(json.dumps({"per_second": per * producers / elapsed}))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
