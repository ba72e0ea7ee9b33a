#!/usr/bin/env python3
"""make bench: dq's figures next to a reference measured in the same run, as ratios.

Each case runs --repeat times; the table shows medians. Results go to Benchmarks/results.md.
"""
import argparse
import json
import os
import platform
import re
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = []


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def resource(i, size=1024):
    head = '{"resourceType":"Observation","status":"final","identifier":[{"system":"urn:bench","value":"%d"}],"code":{"text":"' % i
    return head + "x" * max(0, size - len(head) - 3) + '"}}'


def median_of(fn, repeat):
    values = [fn() for _ in range(repeat)]
    return statistics.median(values)


def interleaved(fns, repeat):
    """The median of each of `fns`, run in turn in each of `repeat` rounds: on a machine whose fsync time drifts
    (a VM), alternating puts dq and its references under the same conditions."""
    values = [[] for _ in fns]
    for _ in range(repeat):
        for index, fn in enumerate(fns):
            values[index].append(fn())
    return [statistics.median(v) for v in values]


def serial_rounds(args):
    """Rounds for the one-commit-per-item cases (1, 9): a run of 2,000 commits moves by 15-25% on this VM's
    disk, so a median of three swung the ratio by 0.15 between runs; nine rounds take about 15 s."""
    return max(args.repeat, 9)


def row(case, dq_value, unit, ref_name, ref_value, target, note=""):
    ratio = dq_value / ref_value if ref_value else float("nan")
    ROWS.append((case, dq_value, unit, ref_name, ref_value, ratio, target, note))
    print("  %-44s dq %12.1f %-8s | %-34s %12.1f | ratio %6.2f (target %s) %s"
          % (case, dq_value, unit, ref_name, ref_value, ratio, target, note), flush=True)


def run(cmd, env=None, stdin=None, check=True):
    result = subprocess.run(cmd, env=env, stdin=stdin, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise SystemExit("command failed: %s\n%s" % (" ".join(cmd), result.stderr[-2000:]))
    return result


def bench_json(args, *cmd):
    out = run([args.bench] + [str(c) for c in cmd]).stdout.strip().splitlines()[-1]
    return json.loads(out)


RAW_DDL = ["CREATE TABLE item (seq INTEGER PRIMARY KEY AUTOINCREMENT, uuid TEXT, body BLOB)"]
RAW_INSERT = "INSERT INTO item (uuid, body) VALUES (?, ?)"


def dq_schema(dq_database):
    """The DDL of dq's item table and its indexes, read from a database dq made."""
    db = sqlite3.connect(dq_database)
    ddl = [r[0] for r in db.execute("SELECT sql FROM sqlite_master WHERE tbl_name = 'item' AND sql IS NOT NULL")]
    db.close()
    return ddl


DQ_INSERT = ("INSERT INTO item (uuid, queue, method, url, resource_type, resource_id, encrypted, content_type, body, "
             "enqueued_at, full_url) VALUES (?, ?, 'POST', 'Observation', 'Observation', NULL, 0, "
             "'application/fhir+json', ?, ?, NULL)")


def dq_row(index, body):
    """The values DQ_INSERT takes: a time-ordered 32-hex id (as dq's UUIDv7 ids grow), the queue, the body."""
    return ("0190%028x" % index, "http://127.0.0.1:9/fhir", body, time.time())


def open_sqlite(path, ddl):
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    for statement in ddl:
        db.execute(statement)
    return db


def sqlite_serial(path, count, size, ddl=RAW_DDL, insert=RAW_INSERT, values=lambda i, body: (str(i), body)):
    """One row per committed transaction, WAL and synchronous=FULL: by default the raw loop (3 columns, no
    index); with dq's DDL and insert, what SQLite itself costs for dq's schema, with no dq code in the way."""
    db = open_sqlite(path, ddl)
    bodies = [resource(i, size).encode() for i in range(count)]
    start = time.perf_counter()
    for i, body in enumerate(bodies):
        db.execute("BEGIN IMMEDIATE")
        db.execute(insert, values(i, body))
        db.execute("COMMIT")
    elapsed = time.perf_counter() - start
    db.close()
    return count / elapsed


def sqlite_bulk(path, lines, ddl=RAW_DDL, insert=RAW_INSERT, values=lambda i, body: (str(i), body)):
    """Every line of an NDJSON file in one transaction (`executemany`), reading the file inside the timing."""
    db = open_sqlite(path, ddl)
    start = time.perf_counter()
    with open(lines, "rb") as f:
        rows = [values(i, line.rstrip(b"\n")) for i, line in enumerate(f)]
    db.execute("BEGIN IMMEDIATE")
    db.executemany(insert, rows)
    db.execute("COMMIT")
    elapsed = time.perf_counter() - start
    db.close()
    return len(rows) / elapsed


def write_ndjson(path, count, size=512):
    with open(path, "w") as f:
        for i in range(count):
            f.write(resource(i, size) + "\n")


def dq_env(work, server, db="queue.sqlite", idempotent="false"):
    """dq's environment for a case. Plain creates (idempotent false) unless asked: the references send plain
    creates, the resources of one case share identifiers from round to round, and the rows stay comparable with
    the runs before `auto` became the default (case 5b measures what auto costs)."""
    env = dict(os.environ)
    env.update({"DQ_SERVER": server, "DQ_DATABASE": os.path.join(work, db), "HOME": work, "DQ_IDEMPOTENT": idempotent})
    return env


def case_enqueue(args, work):
    print("1-3. enqueue", flush=True)
    n = args.scale(2000)

    def dq_serial():
        path = os.path.join(work, "s-%f.sqlite" % time.time())
        return bench_json(args, "enqueue-serial", path, n, 1024, "full")["per_second"]

    def raw_serial():
        return sqlite_serial(os.path.join(work, "raw-%f.sqlite" % time.time()), n, 1024)

    ddl_source = os.path.join(work, "schema.sqlite")
    bench_json(args, "enqueue-serial", ddl_source, 1, 1024, "full")
    ddl = dq_schema(ddl_source)

    def schema_serial():
        return sqlite_serial(os.path.join(work, "sch-%f.sqlite" % time.time()), n, 1024, ddl, DQ_INSERT, dq_row)

    dq_value, raw_value, schema_value = interleaved([dq_serial, raw_serial, schema_serial], serial_rounds(args))
    row("1 durable enqueue, 1 item/commit (items/s)", dq_value, "items/s", "raw SQLite loop, WAL+FULL", raw_value, ">= 0.85")
    row("1 durable enqueue, 1 item/commit (items/s)", dq_value, "items/s", "the same loop into dq's table",
        schema_value, "-", "(what dq's code costs beyond its schema)")

    m = args.scale(20000)

    def dq_concurrent():
        path = os.path.join(work, "c-%f.sqlite" % time.time())
        return bench_json(args, "enqueue-concurrent", path, m, 1024, 64)["per_second"]

    concurrent = median_of(dq_concurrent, args.repeat)
    row("2 durable enqueue, 64 producers (items/s)", concurrent, "items/s", "dq 1 item/commit (case 1)", dq_value,
        ">= 4 and >= 20,000/s", "(%s)" % ("met" if concurrent >= 20000 and concurrent >= 4 * dq_value else "missed"))

    k = args.scale(100000)
    lines = os.path.join(work, "bulk.ndjson")
    write_ndjson(lines, k, 512)

    def dq_bulk():
        env = dq_env(work, "http://127.0.0.1:9/fhir", "b-%f.sqlite" % time.time())
        start = time.perf_counter()
        run([args.dq, "enqueue", "--ndjson", lines], env=env)
        return k / (time.perf_counter() - start)

    def raw_bulk():
        return sqlite_bulk(os.path.join(work, "rb-%f.sqlite" % time.time()), lines)

    def schema_bulk():
        return sqlite_bulk(os.path.join(work, "sb-%f.sqlite" % time.time()), lines, ddl, DQ_INSERT, dq_row)

    bulk_value, raw_value, schema_value = interleaved([dq_bulk, raw_bulk, schema_bulk], args.repeat)
    row("3 dq enqueue --ndjson %d (items/s)" % k, bulk_value, "items/s", "raw SQLite batched insert", raw_value, ">= 0.5")
    row("3 dq enqueue --ndjson %d (items/s)" % k, bulk_value, "items/s", "the same insert into dq's table",
        schema_value, "-", "(dq also reads, validates and names each item)")


def start_nginx(work):
    port = free_port()
    conf = os.path.join(work, "nginx.conf")
    with open(conf, "w") as f:
        f.write("""daemon off; worker_processes 1; pid %s/nginx.pid; error_log %s/nginx-error.log;
events { worker_connections 256; }
http { access_log off; client_body_temp_path %s; client_max_body_size 64m;
  server { listen 127.0.0.1:%d; location / { return 201 '{"resourceType":"OperationOutcome"}'; } } }
""" % (work, work, work, port))
    process = subprocess.Popen(["nginx", "-c", conf, "-p", work], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            urllib.request.urlopen("http://127.0.0.1:%d/" % port, timeout=1)
            break
        except Exception:
            time.sleep(0.05)
    return process, port


def timed_flush(args, env, lines, n):
    """Queues the n resources of `lines` with `env`, then times one `dq flush` that must deliver them all: items/s."""
    run([args.dq, "enqueue", "--ndjson", lines], env=env)
    start = time.perf_counter()
    out = run([args.dq, "flush"], env=env).stdout
    elapsed = time.perf_counter() - start
    assert "%d delivered" % n in out, out
    return n / elapsed


def sink_with_items(work, name, n):
    """nginx as a 201 sink, and n 1 KiB resources for it in work/name: (nginx process, base URL, NDJSON path)."""
    nginx, port = start_nginx(work)
    lines = os.path.join(work, name)
    write_ndjson(lines, n, 1024)
    return nginx, "http://127.0.0.1:%d/fhir" % port, lines


def case_flush_sink(args, work):
    print("4. flush to a loopback sink (nginx)", flush=True)
    if not shutil.which("nginx") or not shutil.which("ab"):
        print("  skipped: nginx and ab (apache2-utils) are not installed")
        return
    n = args.scale(5000)
    nginx, server, lines = sink_with_items(work, "sink.ndjson", n)
    try:

        def dq_flush():
            return timed_flush(args, dq_env(work, server, "f-%f.sqlite" % time.time()), lines, n)

        body = os.path.join(work, "body.json")
        with open(body, "w") as f:
            f.write(resource(0, 1024))

        def ab():
            out = run(["ab", "-q", "-n", str(n), "-c", "1", "-k", "-p", body, "-T", "application/fhir+json",
                       server + "/Observation"]).stdout
            return float(re.search(r"Requests per second:\s+([\d.]+)", out).group(1))

        row("4 flush to nginx 201 sink (items/s)", median_of(dq_flush, args.repeat), "items/s",
            "ab -c 1 -k, same bodies", median_of(ab, args.repeat), "-", "(reported, no target: dq journals each item durably)")
    finally:
        nginx.terminate()
        nginx.wait()


def case_flush_fhir(args, work):
    print("5. flush to sekmet-fhir", flush=True)
    bench_venv = os.path.join(ROOT, ".peers", "bench")
    server, _, base = start_sekmet(work, "sekmet")
    try:
        n = args.scale(1000)
        lines = os.path.join(work, "fhir.ndjson")
        write_ndjson(lines, n, 512)
        peer = os.path.join(ROOT, "Benchmarks", "peers_fhir.py")

        def peer_rate(name):
            out = run([os.path.join(bench_venv, "bin", "python"), peer, name, base, lines]).stdout
            return float(out.strip().splitlines()[-1])

        # One request per item, as the peers do (case 10 measures Bundles); dq and the peers take turns, so that
        # the server's growing store weighs on all of them alike.
        names = ("fhirclient", "fhirpy", "requests")
        rounds = []
        for _ in range(args.repeat):
            rounds.append([batched_flush(args, work, base, lines, n, batch=1)] + [peer_rate(name) for name in names])
        dq_value = statistics.median(r[0] for r in rounds)
        for index, name in enumerate(names, start=1):
            worst = min(r[0] / r[index] for r in rounds)
            row("5 flush to sekmet-fhir (items/s)", dq_value, "items/s", "%s, sequential creates" % name,
                statistics.median(r[index] for r in rounds), ">= 1.0",
                "(lowest round %.2f)" % worst)
        # 5b: what the default (idempotent auto: a conditional create, so a search on the server, for each declared
        # type's identified create) costs against plain creates, in turns, identifiers new in every flush.
        rates = {"auto": [], "false": []}
        for round_index in range(args.repeat):
            for mode in ("false", "auto"):
                path = os.path.join(work, "idempotent-%s-%d.ndjson" % (mode, round_index))
                with open(path, "w") as f:
                    for i in range(n):
                        f.write(resource(i, 512).replace('"urn:bench"', '"urn:bench:%s:%d"' % (mode, round_index)) + "\n")
                env = dict(dq_env(work, base, "idempotent-%f.sqlite" % time.time(), idempotent=mode), DQ_BATCH_SIZE="1")
                rates[mode].append(timed_flush(args, env, path, n))
        row("5b flush to sekmet-fhir, idempotent auto (items/s)", statistics.median(rates["auto"]), "items/s",
            "the same, idempotent false", statistics.median(rates["false"]), "report",
            "the cost of exactly once by default")
    finally:
        server.terminate()
        server.wait()


def batched_flush(args, work, base, path, count, batch):
    """Queues `path` in a new database, then times one dq flush of it with Bundles of `batch`: items/s."""
    return timed_flush(args, dict(dq_env(work, base, "flush-%f.sqlite" % time.time()), DQ_BATCH_SIZE=str(batch)), path,
                       count)


def case_seal(args, work):
    print("6. envelope sealing", flush=True)
    key = os.path.join(work, "k.pem")
    cert = os.path.join(work, "c.pem")
    run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-subj", "/CN=b", "-days", "2",
         "-out", cert])
    count = args.scale(20000)
    small = median_of(lambda: bench_json(args, "seal", cert, 2048, count, "c3pro")["per_second"], args.repeat)
    out = run(["openssl", "speed", "-seconds", "3", "rsa2048"]).stdout
    verify = float(re.search(r"rsa 2048 bits\s+[\d.]+s\s+[\d.]+s\s+[\d.]+\s+([\d.]+)", out).group(1))
    row("6a seal 2 KiB resource, c3pro (envelopes/s)", small, "env/s", "openssl speed rsa2048 public ops/s", verify, ">= 0.6")
    big = median_of(lambda: bench_json(args, "seal", cert, 1 << 20, args.scale(200), "c3pro")["mb_per_second"], args.repeat)
    out = run(["openssl", "speed", "-seconds", "3", "-bytes", "16384", "-evp", "aes-256-cbc"]).stdout
    kbytes = float(out.strip().splitlines()[-1].split()[-1].rstrip("k"))
    row("6b seal 1 MiB resource, c3pro (MB/s)", big, "MB/s", "openssl speed -evp aes-256-cbc (16 KiB)", kbytes * 1000 / 1e6, ">= 0.5")
    gcm = median_of(lambda: bench_json(args, "seal", cert, 1 << 20, args.scale(200), "authenticated")["mb_per_second"], args.repeat)
    out = run(["openssl", "speed", "-seconds", "3", "-bytes", "16384", "-evp", "aes-256-gcm"]).stdout
    kbytes = float(out.strip().splitlines()[-1].split()[-1].rstrip("k"))
    row("6c seal 1 MiB resource, authenticated (MB/s)", gcm, "MB/s", "openssl speed -evp aes-256-gcm (16 KiB)", kbytes * 1000 / 1e6, "-")


def peak_rss_mb(cmd, env):
    result = run(["/usr/bin/time", "-v"] + cmd, env=env, check=False)
    match = re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr)
    return int(match.group(1)) / 1024 if match else float("nan")


def case_memory(args, work):
    print("7. memory", flush=True)
    if not shutil.which("nginx"):
        print("  skipped: nginx is not installed")
        return
    n = args.scale(1000000)
    lines = os.path.join(work, "mem.ndjson")
    nginx, port = start_nginx(work)
    try:
        env = dq_env(work, "http://127.0.0.1:%d/fhir" % port, "mem.sqlite")
        # Fill the queue in chunks (the CLI validates and commits each file in one transaction).
        chunk = min(n, 100000)
        write_ndjson(lines, chunk, 300)
        for _ in range(n // chunk):
            run([args.dq, "enqueue", "--ndjson", lines], env=env)
        limit = args.scale(20000)
        flush_rss = peak_rss_mb([args.dq, "flush", "--limit", str(limit)], env)
        empty_rss = peak_rss_mb([args.dq, "status"], dq_env(work, "http://127.0.0.1:9/fhir", "empty.sqlite"))
        row("7a peak RSS, dq flush (%d of %d queued)" % (limit, n), flush_rss, "MB", "dq status, empty queue", empty_rss,
            "flush <= 64 MB", "(%s)" % ("met" if flush_rss <= 64 else "missed"))
    finally:
        nginx.terminate()
        nginx.wait()
    bundle = os.path.join(work, "bundle.json")
    entries = args.scale(50000)
    with open(bundle, "w") as f:
        f.write('{"resourceType":"Bundle","type":"transaction","entry":[')
        f.write(",".join('{"resource":%s,"request":{"method":"POST","url":"Observation"}}' % resource(i, 900)
                         for i in range(entries)))
        f.write("]}")
    size_mb = os.path.getsize(bundle) / 1e6
    rss = peak_rss_mb([args.dq, "enqueue", bundle], dq_env(work, "http://127.0.0.1:9/fhir", "bundle.sqlite"))
    row("7b peak RSS, dq enqueue of a %.0f MB Bundle" % size_mb, rss, "MB", "the Bundle's size", size_mb, "-")


def case_startup(args, work):
    print("8. start-up", flush=True)
    env = dq_env(work, "http://127.0.0.1:9/fhir", "start.sqlite")
    db = os.path.join(work, "start.sqlite")
    bench_json(args, "enqueue-serial", db, 1, 1024, "full")  # read commands need a database: one item in it
    runs = args.scale(30)

    def timed(cmd, env=None):
        start = time.perf_counter()
        for _ in range(runs):
            run(cmd, env=env)
        return (time.perf_counter() - start) / runs * 1000

    dq_ms = median_of(lambda: timed([args.dq, "status"], env), args.repeat)
    sqlite_ms = median_of(lambda: timed(["sqlite3", db, "select count(*) from item"]), args.repeat)
    row("8 dq status, one item queued (ms per run)", dq_ms, "ms", "sqlite3 DB 'select count(*)'", sqlite_ms, "-",
        "(a plain figure: no target)")
    version_ms = median_of(lambda: timed([args.dq, "version"]), args.repeat)
    row("8 dq version (ms per run)", version_ms, "ms", "sqlite3 DB 'select count(*)'", sqlite_ms,
        "-", "(the floor under every other command)")
    sqlite_size = os.path.getsize(shutil.which("sqlite3")) / 1e6
    row("8 dq binary size (MB, stripped)", os.path.getsize(args.dq) / 1e6, "MB", "sqlite3 binary", sqlite_size, "-")


def case_peers(args, work):
    print("9. durable queue peers", flush=True)
    bench_venv = os.path.join(ROOT, ".peers", "bench")
    n = args.scale(2000)
    peer = os.path.join(ROOT, "Benchmarks", "peers_queue.py")

    def dq_put(durability="full"):
        return lambda: bench_json(args, "enqueue-serial", os.path.join(work, "p-%f.sqlite" % time.time()), n, 1024,
                                  durability)["per_second"]

    def peer_put(name, synchronous="FULL"):
        return lambda: float(run([os.path.join(bench_venv, "bin", "python"), peer, name, work, str(n), synchronous])
                             .stdout.strip().splitlines()[-1])

    def disk_alone():
        """What the disk allows one commit at a time: a 16 KiB append (four WAL frames, what one durable enqueue
        writes) and an fdatasync, in a 4 MB file written round and round like a WAL; no SQLite."""
        path = os.path.join(work, "disk-%f.bin" % time.time())
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        frames = b"\x01" * (4 * 4120)
        try:
            start, offset = time.perf_counter(), 32
            for _ in range(n):
                if offset + len(frames) > 4 << 20:
                    offset = 32
                os.pwrite(fd, frames, offset)
                os.fdatasync(fd)
                offset += len(frames)
            return n / (time.perf_counter() - start)
        finally:
            os.close(fd)
            os.remove(path)

    names = ("persist-queue", "litequeue")
    dq_value, *peers, disk, dq_normal, litequeue_normal = interleaved(
        [dq_put()] + [peer_put(name) for name in names] + [disk_alone, dq_put("normal"), peer_put("litequeue", "NORMAL")],
        serial_rounds(args))
    for name, out in zip(names, peers):
        row("9 durable put, 1 item/commit (items/s)", dq_value, "items/s", "%s put, synchronous=FULL" % name, out, ">= 0.9")
    row("9 durable put, 1 item/commit (items/s)", dq_value, "items/s", "the disk alone: 16 KiB write + fdatasync", disk,
        "-", "(the ceiling for any queue)")
    row("9 put without an fsync per commit (items/s)", dq_normal, "items/s", "litequeue put, synchronous=NORMAL",
        litequeue_normal, "-", "(each queue's own work per commit)")


def start_sekmet(work, name, port=None):
    """A sekmet-fhir server in work/name on `port` (a free one by default), ready: (process, port, base URL)."""
    venv = os.path.join(ROOT, ".peers", "venv")
    port = port or free_port()
    data = os.path.join(work, name)
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(data, "settings.yaml"), "w") as f:
        f.write("host: 127.0.0.1\nport: %d\nbase_url: http://127.0.0.1:%d/fhir\ndata_dir: %s/data\nlog_inbound: false\n"
                "simulator: {enabled: false}\nserver_auth:\n  types: [none]\n" % (port, port, data))
    server = subprocess.Popen([os.path.join(venv, "bin", "sekmet"), "serve", "-c", os.path.join(data, "settings.yaml")],
                              cwd=data, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = "http://127.0.0.1:%d/fhir" % port
    for _ in range(1000):
        try:
            urllib.request.urlopen(base + "/metadata", timeout=1)
            break
        except Exception:
            time.sleep(0.02)
    return server, port, base


def start_latency_proxy(port, latency_ms=25):
    """scripts/faultproxy.py adding `latency_ms` each way in front of the server on `port`, ready: (process, base URL)."""
    proxy_port = free_port()
    proxy = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", "faultproxy.py"), "--listen", str(proxy_port),
                              "--upstream", "http://127.0.0.1:%d" % port, "--latency", str(latency_ms)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            urllib.request.urlopen("http://127.0.0.1:%d/__proxy/stats" % proxy_port, timeout=1)
            break
        except Exception:
            time.sleep(0.1)
    return proxy, "http://127.0.0.1:%d/fhir" % proxy_port


def case_drain_latency(args, work):
    """10: a backlog drained through a link with 25 ms added each way: Bundles against one request per item."""
    print("10. drain at latency (25 ms each way)", flush=True)
    bench_venv = os.path.join(ROOT, ".peers", "bench")
    server, port, direct = start_sekmet(work, "drain")
    proxy, slow = start_latency_proxy(port)
    try:
        n = args.scale(10000)
        single_n = args.scale(300)  # one by one is bounded: its rate, not its 10,000 items
        lines = os.path.join(work, "drain.ndjson")
        write_ndjson(lines, n, 512)
        single_lines = os.path.join(work, "drain-single.ndjson")
        write_ndjson(single_lines, single_n, 512)

        def dq_drain(base, path, count, batch):
            return batched_flush(args, work, base, path, count, batch)

        bundles = os.path.join(ROOT, "Benchmarks", "peers_bundles.py")

        def python_bundles(base):
            out = run([os.path.join(bench_venv, "bin", "python"), bundles, base, lines, "100"]).stdout
            return float(out.strip().splitlines()[-1])

        peer = os.path.join(ROOT, "Benchmarks", "peers_fhir.py")

        def fhirclient_single():
            out = run([os.path.join(bench_venv, "bin", "python"), peer, "fhirclient", slow, single_lines]).stdout
            return float(out.strip().splitlines()[-1])

        dq_bundles = median_of(lambda: dq_drain(slow, lines, n, 100), args.repeat)
        dq_single = median_of(lambda: dq_drain(slow, single_lines, single_n, 1), args.repeat)
        py_bundles = median_of(lambda: python_bundles(slow), args.repeat)
        fc_single = median_of(fhirclient_single, args.repeat)
        ingest = median_of(lambda: python_bundles(direct), args.repeat)
        dq_direct = median_of(lambda: dq_drain(direct, lines, n, 100), args.repeat)
        case = "10 drain %d queued at +25 ms each way (items/s)" % n
        row(case, dq_bundles, "items/s", "dq one by one (%d items)" % single_n, dq_single, ">= 10")
        row(case, dq_bundles, "items/s", "Python loop posting the same Bundles", py_bundles, ">= 0.9")
        row(case, dq_bundles, "items/s", "fhirclient one by one (%d items)" % single_n, fc_single, "-")
        row(case, dq_bundles, "items/s", "server ingest: Python Bundles, no added latency", ingest, "(the limit)")
        row("10 drain %d queued at 0 ms added (items/s)" % n, dq_direct, "items/s",
            "server ingest: Python Bundles, no added latency", ingest, ">= 0.8")
    finally:
        proxy.terminate()
        proxy.wait()
        server.terminate()
        server.wait()


def case_service(args, work):
    """11: dq run: the delay from the server coming back to the first delivery, and the CPU of an idle dq run."""
    print("11. dq run: recovery delay and idle CPU", flush=True)
    poll = 1.0
    server, port, base = start_sekmet(work, "service")
    server.terminate()
    server.wait()

    def start():
        return start_sekmet(work, "service", port=port)[0]

    def count():
        with urllib.request.urlopen(base + "/Observation?_count=1", timeout=5) as r:
            return json.load(r).get("total", 0)

    def recovery():
        env = dq_env(work, base, "svc-%f.sqlite" % time.time())
        env["DQ_CONFIG"] = os.path.join(work, "svc.json")
        with open(env["DQ_CONFIG"], "w") as f:
            f.write('{"retry": {"initial_seconds": 0.2, "maximum_seconds": 0.2, "jitter": 0}}')
        lines = os.path.join(work, "svc.ndjson")
        write_ndjson(lines, 1, 256)
        run([args.dq, "enqueue", "--ndjson", lines], env=env)
        runner = subprocess.Popen([args.dq, "run", "--poll-interval", str(poll)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)  # it has tried and backs off: the server is down
        server = start()
        up = time.perf_counter()
        before = count()
        while count() == before:
            time.sleep(0.01)
        delay = time.perf_counter() - up
        runner.terminate()
        runner.wait()
        server.terminate()
        server.wait()
        return delay * 1000

    server = start()
    try:
        # Idle: an empty queue for 60 s (6 s with --quick); CPU from /proc.
        env = dq_env(work, base, "idle.sqlite")
        runner = subprocess.Popen([args.dq, "run"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
        seconds = 6 if args.quick else 60
        def ticks():
            with open("/proc/%d/stat" % runner.pid) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])
        first = ticks()
        time.sleep(seconds)
        used = (ticks() - first) / os.sysconf("SC_CLK_TCK")
        runner.terminate()
        runner.wait()
    finally:
        server.terminate()
        server.wait()
    row("11 dq run idle CPU (% of one core)", 100 * used / seconds, "%", "one core", 100.0, "< 1%")
    delay = median_of(recovery, args.repeat)
    row("11 dq run: server back to first delivery (ms)", delay, "ms", "poll interval", poll * 1000,
        "<= 1 + one round trip")


def case_postgres(args, work):
    print("12. PostgreSQL store", flush=True)
    bench_venv = os.path.join(ROOT, ".peers", "bench")
    folder = tempfile.mkdtemp(prefix="dq-bench-pg-")
    os.chmod(folder, 0o755)  # the server runs as nobody when make runs as root
    cluster = os.path.join(folder, "cluster")
    url = run([os.path.join(ROOT, "scripts", "postgres.sh"), "start", cluster, str(free_port())]).stdout.strip()
    with open(os.path.join(cluster, "password")) as f:
        password = f.read().strip()
    env = dict(os.environ, PGPASSWORD=password)
    host, port = url.split("@", 1)[1].split("/", 1)[0].split(":")
    counter = [0]

    def fresh():
        counter[0] += 1
        name = "bench_%d_%d" % (os.getpid(), counter[0])
        run(["psql", "-h", host, "-p", port, "-U", "dq", "-d", "dq", "-qc", "CREATE DATABASE " + name], env=env)
        return "postgres://dq@%s:%s/%s?sslmode=disable" % (host, port, name)

    def dq_enqueue(producers, count):
        out = run([args.bench, "enqueue-concurrent", fresh(), str(count), "1024", str(producers)], env=env).stdout
        return json.loads(out.strip().splitlines()[-1])["per_second"]

    def pgqueuer(producers, count):
        dsn = fresh().replace("?sslmode=disable", "").replace("postgres://dq@", "postgres://dq:%s@" % password)
        out = run([os.path.join(bench_venv, "bin", "python"), os.path.join(ROOT, "Benchmarks", "pg_reference.py"), dsn,
                   str(count), "1024", str(producers)], env=env).stdout
        return json.loads(out.strip().splitlines()[-1])["per_second"]

    try:
        for producers, count, target in ((1, 1000, ">= 1.0"), (8, 4000, ">= 1.0"), (64, 20000, ">= 1.0 and >= 10,000/s")):
            n = args.scale(count)
            dq_value, reference = interleaved([lambda: dq_enqueue(producers, n), lambda: pgqueuer(producers, n)], args.repeat)
            row("12 PostgreSQL enqueue, %d producer(s) (items/s)" % producers, dq_value, "items/s",
                "pgqueuer 1.6, same payloads and server", reference, target)
        if shutil.which("nginx"):
            n = args.scale(5000)
            nginx, server, lines = sink_with_items(work, "pg-sink.ndjson", n)
            try:

                def flush_rate(database):
                    return timed_flush(args, dict(dq_env(work, server), DQ_DATABASE=database, PGPASSWORD=password), lines, n)

                on_postgres, on_sqlite = interleaved(
                    [lambda: flush_rate(fresh()), lambda: flush_rate(os.path.join(work, "pgf-%f.sqlite" % time.time()))],
                    args.repeat)
                row("12 PostgreSQL flush to nginx, lease held (items/s)", on_postgres, "items/s", "the same flush, SQLite store",
                    on_sqlite, ">= 0.8")
            finally:
                nginx.terminate()
                nginx.wait()
    finally:
        run([os.path.join(ROOT, "scripts", "postgres.sh"), "stop", cluster], check=False)
        shutil.rmtree(folder, ignore_errors=True)


def case_at_rest(args, work):
    """13: what sealing every item at rest costs: each figure against the same run without `at_rest`."""
    print("13. sealed at rest against plain", flush=True)
    key = os.path.join(work, "at-rest.key")
    run([args.dq, "keygen", "--at-rest", "--out", key])
    n = args.scale(2000)

    def serial(sealed):
        path = os.path.join(work, "ar-s-%f.sqlite" % time.time())
        return bench_json(args, "enqueue-serial", path, n, 1024, "full", *([key] if sealed else []))["per_second"]

    sealed, plain = interleaved([lambda: serial(True), lambda: serial(False)], serial_rounds(args))
    row("13a durable enqueue, 1 item/commit, sealed (items/s)", sealed, "items/s", "the same, plain", plain, ">= 0.9")
    m = args.scale(20000)

    def concurrent(sealed):
        path = os.path.join(work, "ar-c-%f.sqlite" % time.time())
        return bench_json(args, "enqueue-concurrent", path, m, 1024, 64, *([key] if sealed else []))["per_second"]

    sealed, plain = interleaved([lambda: concurrent(True), lambda: concurrent(False)], args.repeat)
    row("13b durable enqueue, 64 producers, sealed (items/s)", sealed, "items/s", "the same, plain", plain, ">= 0.9")
    k = args.scale(100000)
    lines = os.path.join(work, "ar-bulk.ndjson")
    write_ndjson(lines, k, 512)

    def bulk(sealed):
        env = dq_env(work, "http://127.0.0.1:9/fhir", "ar-b-%f.sqlite" % time.time())
        if sealed:
            env["DQ_AT_REST_KEY_FILE"] = key
        start = time.perf_counter()
        run([args.dq, "enqueue", "--ndjson", lines], env=env)
        return k / (time.perf_counter() - start)

    sealed, plain = interleaved([lambda: bulk(True), lambda: bulk(False)], args.repeat)
    row("13c dq enqueue --ndjson %d, sealed (items/s)" % k, sealed, "items/s", "the same, plain", plain, ">= 0.8")

    server, port, direct = start_sekmet(work, "at-rest")
    proxy, slow = start_latency_proxy(port)
    try:
        single = args.scale(1000)
        single_lines = os.path.join(work, "ar-single.ndjson")
        write_ndjson(single_lines, single, 512)
        drain = args.scale(5000)
        drain_lines = os.path.join(work, "ar-drain.ndjson")
        write_ndjson(drain_lines, drain, 512)

        def flush(base, path, count, batch, sealed):
            env = dict(dq_env(work, base, "ar-f-%f.sqlite" % time.time()), DQ_BATCH_SIZE=str(batch))
            if sealed:
                env["DQ_AT_REST_KEY_FILE"] = key
            return timed_flush(args, env, path, count)

        sealed, plain = interleaved(
            [lambda: flush(direct, single_lines, single, 1, True), lambda: flush(direct, single_lines, single, 1, False)], args.repeat)
        row("13d flush to sekmet-fhir one by one, sealed (items/s)", sealed, "items/s", "the same, plain", plain, ">= 0.95")
        sealed, plain = interleaved(
            [lambda: flush(slow, drain_lines, drain, 100, True), lambda: flush(slow, drain_lines, drain, 100, False)], args.repeat)
        row("13e drain in Bundles of 100 at +25 ms, sealed (items/s)", sealed, "items/s", "the same, plain", plain, ">= 0.95")
    finally:
        proxy.terminate()
        proxy.wait()
        server.terminate()
        server.wait()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dq", default=os.path.join(ROOT, ".build", "release", "dq"))
    parser.add_argument("--bench", default=os.path.join(ROOT, ".build", "release", "dq-bench"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tenth of the sizes")
    parser.add_argument("--cases", default="1,4,5,6,7,8,9,10,11,12,13")
    parser.add_argument("--out", default=os.path.join(ROOT, "Benchmarks", "results.md"))
    args = parser.parse_args()
    factor = 0.1 if args.quick else 1.0
    args.scale = lambda n: max(1, int(n * factor))
    cases = {"1": case_enqueue, "4": case_flush_sink, "5": case_flush_fhir, "6": case_seal, "7": case_memory,
             "8": case_startup, "9": case_peers, "10": case_drain_latency,
             "11": case_service, "12": case_postgres, "13": case_at_rest}
    work = tempfile.mkdtemp(prefix="dq-bench-")
    try:
        for key in args.cases.split(","):
            cases[key](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    machine = "%s, %d cores, %s" % (platform.machine(), os.cpu_count(), platform.platform())
    lines = ["# dq benchmarks", "", "Machine: %s. Command: `make bench` (release build, median of %d runs, %d for cases 1 "
             "and 9%s)." % (machine, args.repeat, serial_rounds(args), ", --quick" if args.quick else ""), "",
             "| case | dq | unit | reference | reference value | ratio | target |", "|---|---:|---|---|---:|---:|---|"]
    for case, dq_value, unit, ref_name, ref_value, ratio, target, note in ROWS:
        lines.append("| %s | %.1f | %s | %s | %.1f | %.2f | %s %s |" % (case, dq_value, unit, ref_name, ref_value, ratio, target, note))
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
