#!/usr/bin/env python3
"""Durable put rate of a peer queue: peers_queue.py persist-queue|litequeue WORKDIR COUNT [FULL|NORMAL] -> items/s.

Both are SQLite queues; each put is its own commit with synchronous=FULL (or NORMAL when asked) and WAL where
the library lets us set it, matching dq's default durability.
"""
import os
import sys
import time


def resource(i, size=1024):
    head = '{"resourceType":"Observation","status":"final","identifier":[{"system":"urn:bench","value":"%d"}],"code":{"text":"' % i
    return head + "x" * max(0, size - len(head) - 3) + '"}}'


def main():
    name, work, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    synchronous = sys.argv[4] if len(sys.argv) > 4 else "FULL"
    assert synchronous in ("FULL", "NORMAL")
    bodies = [resource(i) for i in range(count)]
    path = os.path.join(work, "%s-%f" % (name, time.time()))
    if name == "persist-queue":
        import persistqueue
        queue = persistqueue.SQLiteAckQueue(path, auto_commit=True, multithreading=False)
        queue._putter.execute("PRAGMA synchronous=%s" % synchronous) if hasattr(queue, "_putter") else None
        put = queue.put
    else:
        import litequeue
        queue = litequeue.LiteQueue(path + ".sqlite")
        queue.conn.execute("PRAGMA synchronous=%s" % synchronous)
        put = queue.put
    start = time.perf_counter()
    for body in bodies:
        put(body)
    print(count / (time.perf_counter() - start))


if __name__ == "__main__":
    main()
