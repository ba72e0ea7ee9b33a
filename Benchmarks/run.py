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
import urllib.error
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


SERVE_PEERS = os.path.join(ROOT, "Benchmarks", "serve_peers.py")
WRK_SCRIPT = """wrk.method = "POST"
local f = io.open("%s", "rb")
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %s"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{"requests": %%d, "duration_us": %%d, "status_errors": %%d, "socket_errors": %%d, '
    .. '"p50_us": %%d, "p99_us": %%d}\\n', summary.requests, summary.duration, e.status,
    e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99)))
end
"""


def wait_url(url, seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except urllib.error.HTTPError:
            return  # it answers
        except Exception:
            time.sleep(0.05)
    raise SystemExit("no answer from %s" % url)


def stop(process):
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class ServeBench:
    """dq serve's surroundings for case 14 (as scripts/torture.py's ServeRig): a key pair, the Antispam secret, a
    config file per FHIR server; start() runs a receiver on a database, token() speaks as a C3-PRO app."""

    def __init__(self, args, work):
        self.args, self.work = args, work
        self.keys = os.path.join(work, "serve-keys")
        os.makedirs(self.keys, exist_ok=True)
        self.key = os.path.join(self.keys, "k1.pem")
        run(["openssl", "genrsa", "-out", self.key, "2048"])
        self.antispam = os.path.join(work, "serve-antispam")
        with open(self.antispam, "w") as f:
            f.write("bench-antispam\n")

    def envelopes(self, name, count):
        """count envelopes of about 2 KiB (1,200-byte Observations inside), one a line: (envelopes path, NDJSON path)."""
        lines = os.path.join(self.work, name + ".ndjson")
        write_ndjson(lines, count, 1200)
        out = os.path.join(self.work, name + ".envelopes")
        run([os.path.join(ROOT, ".peers", "venv", "bin", "python"), SERVE_PEERS, "envelopes", self.key, lines, out])
        return out, lines

    def start(self, server, database, port, batch=None, extra_env=None, edge=None):
        """dq serve on `database`; with `edge` (inside base URL, client id, secret) a --role edge forwarding there."""
        config = os.path.join(self.work, "serve-%f.json" % time.time())
        # One bench client posts far more than a device would: its waiting items are limited far above what a run
        # queues (the check itself is measured), and wrk's connections come from one address.
        limits = {"max_waiting_per_client": 100000000, "max_waiting_bytes_per_client": 1 << 50,
                  "max_connections_per_address": 1024}
        settings = {"server": server, "serve": dict({"antispam_file": self.antispam, "keys_dir": self.keys,
                                                     "default_key_id": "k1", "plain_fhir": False,
                                                     "auth_requests_per_minute": 1000000}, **limits)}
        if edge:
            inside, client_id, secret = edge
            settings = {"serve": dict({"role": "edge", "antispam_file": self.antispam, "forward_to": inside + "/c3pro",
                                       "forward_certificate": self.certificate(), "forward_key_id": "k1",
                                       "plain_fhir": False, "auth_requests_per_minute": 1000000}, **limits),
                        "auth": {"client_id": client_id, "client_secret": secret, "token_uri": inside + "/c3pro/oauth"}}
        if batch:
            settings["batch_size"] = batch
        with open(config, "w") as f:
            json.dump(settings, f)
        env = dict(dq_env(self.work, server or "unused"), DQ_DATABASE=database, **(extra_env or {}))
        if edge:
            del env["DQ_SERVER"]  # an edge has no server of its own
        log_path = os.path.join(self.work, "serve.log")
        with open(log_path, "ab") as log:
            process = subprocess.Popen([self.args.dq, "serve", "--config", config, "--listen", "127.0.0.1:%d" % port,
                                        "--poll-interval", "0.1"], env=env, stdout=log, stderr=log)
        try:
            wait_url("http://127.0.0.1:%d/healthz" % port)
        except SystemExit as error:
            stop(process)
            with open(log_path) as f:
                raise SystemExit("%s; dq serve said:\n%s" % (error, f.read()[-2000:]))
        return process

    def certificate(self):
        """The certificate of the receiver's key k1 (an edge seals plain resources for it)."""
        path = os.path.join(self.work, "serve-k1.crt")
        if not os.path.exists(path):
            run(["openssl", "req", "-x509", "-new", "-key", self.key, "-subj", "/CN=dq-bench", "-days", "30", "-out", path])
        return path

    def register(self, port):
        """A client registered with the Antispam secret: (id, secret)."""
        client = json.loads(self.post(port, "/c3pro/register", json.dumps({"sandbox": False, "receipt-data": "NO-APP-RECEIPT"}),
                                      {"Antispam": "bench-antispam", "Content-Type": "application/json"}))
        return client["client_id"], client["client_secret"]

    @staticmethod
    def post(port, path, body, headers):
        request = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=body.encode(), headers=headers,
                                         method="POST")
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.read()

    def token(self, port):
        import base64
        client = json.loads(self.post(port, "/c3pro/register", json.dumps({"sandbox": False, "receipt-data": "NO-APP-RECEIPT"}),
                                      {"Antispam": "bench-antispam", "Content-Type": "application/json"}))
        basic = base64.b64encode(("%s:%s" % (client["client_id"], client["client_secret"])).encode()).decode()
        answer = self.post(port, "/c3pro/oauth", "grant_type=client_credentials",
                           {"Authorization": "Basic " + basic, "Content-Type": "application/x-www-form-urlencoded"})
        return json.loads(answer)["access_token"]

    def fill(self, server, database, envelopes, edge=None):
        """Queues every envelope of the file through dq serve for `server` (or an edge for its inside receiver), which
        is down meanwhile (nothing listens on its port), over 8 keep-alive connections; then stops dq serve: the
        backlog of a drain."""
        import http.client
        import threading
        port = free_port()
        process = self.start(server, database, port, edge=edge)
        try:
            token = self.token(port)
            with open(envelopes) as f:
                bodies = [line.rstrip("\n") for line in f if line.strip()]
            failures = []

            def post(part):
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                for body in part:
                    connection.request("POST", "/c3pro/encfhir/Observation", body,
                                       {"Authorization": "Bearer " + token, "Content-Type": "application/json"})
                    answer = connection.getresponse()
                    answer.read()
                    if answer.status != 202:
                        failures.append(answer.status)
                connection.close()

            # Eight slices in order: the backlog's order does not matter to a drain.
            threads = [threading.Thread(target=post, args=(bodies[i::8],)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if failures:
                raise SystemExit("dq serve refused %d envelopes (%s)" % (len(failures), failures[:3]))
        finally:
            stop(process)
        return len(bodies)

    def drain(self, server, backlog, count, batch, split=None):
        """Copies the queued backlog to a new database, starts dq serve on it with `server` up, and times the drain
        from its first delivery (read from /metrics) to its last: (items/s, envelopes opened). With `split` (the
        inside's database with the edge's client, its port, the client id and secret), the backlog is an edge's: the
        inside receiver (--role decrypt) starts on a copy of its database, then the edge; timed from the edge's first
        delivery to the inside's last."""
        def copy(source):
            database = os.path.join(self.work, "drain-%f.sqlite" % time.time())
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(source + suffix):
                    shutil.copyfile(source + suffix, database + suffix)
            return database
        database = copy(backlog)
        inside = None
        if split:
            inside_database, inside_port, client_id, secret = split
            inside = self.start(server, copy(inside_database), inside_port, batch=batch)
            port = free_port()
            process = self.start(server, database, port, edge=("http://127.0.0.1:%d" % inside_port, client_id, secret))
        else:
            port = free_port()
            process = self.start(server, database, port, batch=batch)
        try:
            first, deadline = None, time.time() + 600
            while time.time() < deadline:
                delivered, opened = self.metrics(inside_port if split else port)
                # Split: timed from the edge's first delivery (to the inside), counted at the inside (to sekmet).
                started = self.metrics(port)[0] if split and first is None else delivered
                now = time.perf_counter()
                if started and first is None:
                    first = (now, delivered)
                if delivered >= count:
                    break
                time.sleep(0.01)
            else:
                raise SystemExit("the drain did not finish: %d of %d delivered" % (delivered, count))
        finally:
            stop(process)
            if inside:
                stop(inside)
        if first[1] >= count:
            raise SystemExit("the drain was over before it could be timed: more items needed")
        return (count - first[1]) / (now - first[0]), opened

    @staticmethod
    def metrics(port):
        """dq_items_delivered_total and dq_envelopes_opened_total, summed over their labels."""
        text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10).read().decode()
        sums = {"dq_items_delivered_total": 0.0, "dq_envelopes_opened_total": 0.0}
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in sums:
                sums[name] += float(line.rsplit(" ", 1)[1])
        return sums["dq_items_delivered_total"], sums["dq_envelopes_opened_total"]


def wrk_run(args, work, port, body_path, token, seconds, connections=64, path="/c3pro/encfhir/Observation"):
    """wrk, 2 threads and `connections` keep-alive connections posting the same envelope for `seconds` (with no
    `body_path`, GETs of `path`): its figures."""
    script = os.path.join(work, "wrk-%f.lua" % time.time())
    with open(script, "w") as f:
        f.write(WRK_SCRIPT % (body_path, token) if body_path else WRK_SCRIPT[WRK_SCRIPT.index("done = "):].replace("%%", "%"))
    out = run(["wrk", "-t2", "-c%d" % connections, "-d%ds" % seconds, "--timeout", "10s", "-s", script,
               "http://127.0.0.1:%d%s" % (port, path)]).stdout
    result = json.loads([line for line in out.splitlines() if line.startswith('{"requests"')][-1])
    if result["status_errors"] or result["socket_errors"]:
        raise SystemExit("wrk: %d answers not 2xx, %d socket errors\n%s"
                         % (result["status_errors"], result["socket_errors"], out))
    return {"per_second": result["requests"] / (result["duration_us"] / 1e6), "p50_ms": result["p50_us"] / 1000,
            "p99_ms": result["p99_us"] / 1000, "requests": result["requests"]}


def start_nginx_202(work):
    """nginx (both cores, as dq's event loops) answering 202 to every request, keeping nothing: (process, port)."""
    port = free_port()
    folder = os.path.join(work, "nginx-202")
    os.makedirs(folder, exist_ok=True)
    conf = os.path.join(folder, "nginx.conf")
    with open(conf, "w") as f:
        f.write("""daemon off; worker_processes auto; pid %s/nginx.pid; error_log %s/error.log;
events { worker_connections 1024; }
http { access_log off; client_body_temp_path %s; client_max_body_size 10m; keepalive_requests 1000000;
  server { listen 127.0.0.1:%d; location / { return 202; } } }
""" % (folder, folder, folder, port))
    process = subprocess.Popen(["nginx", "-c", conf, "-p", folder], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_url("http://127.0.0.1:%d/" % port)
    return process, port


def serve_postgres(args, work, dq_ingest, on_sqlite, python):
    """14a on a PostgreSQL queue (scripts/postgres.sh), beside the SQLite figures of the same run."""
    folder = tempfile.mkdtemp(prefix="dq-bench-pg-")
    os.chmod(folder, 0o755)  # the server runs as nobody when make runs as root
    cluster = os.path.join(folder, "cluster")
    try:
        url = run([os.path.join(ROOT, "scripts", "postgres.sh"), "start", cluster, str(free_port())]).stdout.strip()
    except SystemExit as error:
        print("  14a on PostgreSQL skipped: %s" % str(error).splitlines()[0])
        shutil.rmtree(folder, ignore_errors=True)
        return
    try:
        with open(os.path.join(cluster, "password")) as f:
            password = f.read().strip()
        env = dict(os.environ, PGPASSWORD=password)
        host, port = url.split("@", 1)[1].split("/", 1)[0].split(":")
        results = []
        for index in range(args.repeat):
            name = "serve_%d_%d" % (os.getpid(), index)
            run(["psql", "-h", host, "-p", port, "-U", "dq", "-d", "dq", "-qc", "CREATE DATABASE " + name], env=env)
            database = "postgres://dq@%s:%s/%s?sslmode=disable" % (host, port, name)
            results.append(dq_ingest(store_env={"PGPASSWORD": password}, database=database))
        value = statistics.median(r["per_second"] for r in results)
        case = "14a dq serve ingest, PostgreSQL store (items/s)"
        row(case, value, "items/s", "the same on SQLite (above)", on_sqlite, "report")
        row(case, value, "items/s", "Python receiver (above)", python, "report",
            "(p50 %.1f ms, p99 %.1f ms)" % (statistics.median(r["p50_ms"] for r in results),
                                             statistics.median(r["p99_ms"] for r in results)))
    finally:
        run([os.path.join(ROOT, "scripts", "postgres.sh"), "stop", cluster], check=False)
        shutil.rmtree(folder, ignore_errors=True)


def case_serve(args, work):
    """14: dq serve, the C3-PRO receiver: durable ingest against a Python receiver and nginx, envelopes opened per
    second against openssl's RSA private-key operations, and a backlog forwarded to sekmet-fhir against its own
    ingest of the same resources as Bundles."""
    print("14. dq serve (C3-PRO receiver)", flush=True)
    missing = [tool for tool in ("wrk", "nginx") if not shutil.which(tool)]
    if missing:
        print("  skipped: %s not installed (make bench installs them)" % ", ".join(missing))
        return
    bench_python = os.path.join(ROOT, ".peers", "bench", "bin", "python")
    rig = ServeBench(args, work)
    one, _ = rig.envelopes("serve-one", 1)
    body = os.path.join(work, "serve-envelope.json")
    with open(one) as f, open(body, "w") as out:
        out.write(f.readline().rstrip("\n"))
    size = os.path.getsize(body)
    seconds = 3 if args.quick else 10
    down = "http://127.0.0.1:%d/fhir" % free_port()  # nothing listens there: every envelope stays queued

    # 14a: durable ingest from 64 keep-alive connections, dq, the Python receiver and nginx in turns.
    def dq_ingest(store_env=None, database=None):
        port = free_port()
        process = rig.start(down, database or os.path.join(work, "ingest-%f.sqlite" % time.time()), port,
                            extra_env=store_env)
        try:
            token = rig.token(port)
            result = wrk_run(args, work, port, body, token, seconds)
            result["opened"] = rig.metrics(port)[1]
            if store_env is None:
                # The same process answering its cheapest endpoint: what its HTTP stack does with no work at all.
                result["stack"] = wrk_run(args, work, port, None, None, seconds, path="/healthz")["per_second"]
            return result
        finally:
            stop(process)

    def edge_ingest():
        """14a on an edge (--role edge, no key), its inside receiver down: every envelope stays on the edge."""
        port = free_port()
        process = rig.start(None, os.path.join(work, "edge-ingest-%f.sqlite" % time.time()), port,
                            edge=("http://127.0.0.1:%d" % free_port(), "edge", "unused"))
        try:
            return wrk_run(args, work, port, body, rig.token(port), seconds)
        finally:
            stop(process)

    def python_ingest():
        port = free_port()
        token = "bench-token-%d" % port
        process = subprocess.Popen([bench_python, SERVE_PEERS, "receiver", os.path.join(work, "py-%f.sqlite" % time.time()),
                                    str(port), token], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_url("http://127.0.0.1:%d/" % port)
            return wrk_run(args, work, port, body, token, seconds)
        finally:
            stop(process)

    nginx, nginx_port = start_nginx_202(work)
    try:
        rounds = [[dq_ingest(), python_ingest(), wrk_run(args, work, nginx_port, body, "none", seconds), edge_ingest()]
                  for _ in range(args.repeat)]
    finally:
        stop(nginx)

    def med(index, key):
        return statistics.median(r[index][key] for r in rounds)

    case = "14a dq serve ingest, %d B envelopes, 64 conns (items/s)" % size
    row(case, med(0, "per_second"), "items/s", "Python receiver: uvicorn + sqlite3, 1 commit/request",
        med(1, "per_second"), ">= 3", "(lowest round %.2f)" % min(r[0]["per_second"] / r[1]["per_second"] for r in rounds))
    row(case, med(0, "per_second"), "items/s", "nginx answering 202, keeping nothing", med(2, "per_second"), ">= 0.3")
    row("14a dq serve answering GET /healthz, no work (req/s)", med(0, "stack"), "req/s", "nginx answering 202, keeping nothing",
        med(2, "per_second"), "report", "(the HTTP stack's own ceiling here)")
    row(case, med(0, "per_second"), "items/s", "the same dq serve answering GET /healthz", med(0, "stack"), "report")
    for key, label in (("p50_ms", "p50"), ("p99_ms", "p99")):
        row("14a dq serve ingest, %s latency (ms)" % label, med(0, key), "ms", "Python receiver %s" % label, med(1, key), "-")
        row("14a dq serve ingest, %s latency (ms)" % label, med(0, key), "ms", "nginx 202 %s" % label, med(2, key), "-")
    row("14a edge (--role edge, no key) ingest (items/s)", med(3, "per_second"), "items/s",
        "Python receiver (above)", med(1, "per_second"), ">= 3", "(p50 %.1f ms, p99 %.1f ms)" % (med(3, "p50_ms"), med(3, "p99_ms")))
    row("14a edge (--role edge, no key) ingest (items/s)", med(3, "per_second"), "items/s", "one dq serve (above)",
        med(0, "per_second"), "report")
    print("    (envelopes opened by dq during the ingest, server down: %s)" % [r[0]["opened"] for r in rounds], flush=True)
    serve_postgres(args, work, dq_ingest, med(0, "per_second"), med(1, "per_second"))

    # 14b: opening. A backlog drained into a sink that costs nothing, in Bundles of 500: opening is the cost.
    n = max(2000, args.scale(5000))  # the first Bundle's 500 are not timed
    envelopes, _ = rig.envelopes("serve-open", n)
    sink_port = free_port()
    sink_server = "http://127.0.0.1:%d/fhir" % sink_port
    backlog = os.path.join(work, "open-backlog.sqlite")
    rig.fill(sink_server, backlog, envelopes)
    sink = subprocess.Popen([sys.executable, SERVE_PEERS, "sink", str(sink_port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_url(sink_server + "/metadata")
        drains = [rig.drain(sink_server, backlog, n, 500) for _ in range(args.repeat)]
    finally:
        stop(sink)
    out = run(["openssl", "speed", "-seconds", "3" if args.quick else "5", "rsa2048"]).stdout
    sign = float(re.search(r"rsa 2048 bits\s+[\d.]+s\s+[\d.]+s\s+([\d.]+)", out).group(1))
    opened = statistics.median(d[0] for d in drains)
    row("14b dq serve opens a backlog of %d into a sink (env/s)" % n, opened, "env/s",
        "openssl speed rsa2048 private-key ops/s", sign, ">= 0.8", "(opened: %s)" % [int(d[1]) for d in drains])
    # The same envelopes opened by dq's opener alone on every core (swift-crypto's BoringSSL, no queue, no network):
    # how much of the physical limit of dq's crypto the drain reaches.
    crypto = statistics.median(bench_json(args, "open", rig.key, envelopes)["per_second"] for _ in range(args.repeat))
    row("14b dq serve opens a backlog of %d into a sink (env/s)" % n, opened, "env/s",
        "dq's opener alone on every core (BoringSSL)", crypto, "report")

    # 14c: forwarding. A backlog drained to sekmet-fhir in Bundles of 100, against sekmet's own ingest of the same
    # resources as Bundles of 100 (case 10's reference), in turns.
    n = max(1000, args.scale(5000))
    envelopes, lines = rig.envelopes("serve-forward", n)
    fhir_port = free_port()
    fhir_base = "http://127.0.0.1:%d/fhir" % fhir_port
    backlog = os.path.join(work, "forward-backlog.sqlite")
    rig.fill(fhir_base, backlog, envelopes)
    server, _, _ = start_sekmet(work, "serve-fhir", port=fhir_port)
    try:

        rounds = []  # (dq, reference) of each round, for the spread

        def drain():
            rounds.append([rig.drain(fhir_base, backlog, n, 100)[0]])
            return rounds[-1][0]

        def python_bundles():
            out = run([bench_python, os.path.join(ROOT, "Benchmarks", "peers_bundles.py"), fhir_base, lines, "100"]).stdout
            rounds[-1].append(float(out.strip().splitlines()[-1]))
            return rounds[-1][1]

        forwarded, ingest = interleaved([drain, python_bundles], args.repeat)
    finally:
        stop(server)
    row("14c dq serve forwards a backlog of %d to sekmet-fhir (items/s)" % n, forwarded, "items/s",
        "server ingest: Python Bundles of 100", ingest, ">= 0.8",
        "(ratio in each round: %s)" % ", ".join("%.2f" % (d / r) for d, r in rounds))

    # 14d: split trust. The same backlog queued on an edge (no key) while its inside receiver is down, then drained
    # edge -> inside (--role decrypt) -> sekmet-fhir, against the single process's drain of it, in turns.
    inside_port = free_port()
    inside_database = os.path.join(work, "inside.sqlite")
    inside = rig.start(fhir_base, inside_database, inside_port)
    try:
        client_id, secret = rig.register(inside_port)
    finally:
        stop(inside)
    edge_backlog = os.path.join(work, "edge-backlog.sqlite")
    rig.fill(None, edge_backlog, envelopes, edge=("http://127.0.0.1:%d" % inside_port, client_id, secret))
    server, _, _ = start_sekmet(work, "serve-fhir-split", port=fhir_port)
    try:
        inside_split = (inside_database, inside_port, client_id, secret)
        single, split = interleaved([lambda: rig.drain(fhir_base, backlog, n, 100)[0],
                                     lambda: rig.drain(fhir_base, edge_backlog, n, 100, split=inside_split)[0]], args.repeat)
    finally:
        stop(server)
    row("14d edge -> decrypt -> sekmet-fhir, backlog of %d (items/s)" % n, split, "items/s",
        "one dq serve (14c's drain, same run)", single, ">= 0.7")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dq", default=os.path.join(ROOT, ".build", "release", "dq"))
    parser.add_argument("--bench", default=os.path.join(ROOT, ".build", "release", "dq-bench"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tenth of the sizes")
    parser.add_argument("--cases", default="1,4,5,6,7,8,9,10,11,12,13,14")
    parser.add_argument("--out", default=os.path.join(ROOT, "Benchmarks", "results.md"))
    args = parser.parse_args()
    factor = 0.1 if args.quick else 1.0
    args.scale = lambda n: max(1, int(n * factor))
    cases = {"1": case_enqueue, "4": case_flush_sink, "5": case_flush_fhir, "6": case_seal, "7": case_memory,
             "8": case_startup, "9": case_peers, "10": case_drain_latency,
             "11": case_service, "12": case_postgres, "13": case_at_rest, "14": case_serve}
    work = tempfile.mkdtemp(prefix="dq-bench-")
    try:
        for key in args.cases.split(","):
            cases[key](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    machine = "%s, %d cores, %s" % (platform.machine(), os.cpu_count(), platform.platform())
    if os.path.realpath(args.dq) != os.path.realpath(os.path.join(ROOT, ".build", "release", "dq")):
        machine += "; dq: %s" % args.dq
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
