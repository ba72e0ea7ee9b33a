#!/usr/bin/env python3
"""make torture: crash, fault, concurrency, exhaustion and bad-input runs against the real FHIR server.

Every run ends by comparing what the server holds with what was enqueued: lost, duplicated, out of order.
Loops are bounded in count and time, use loopback only, and stop every process they start.

  scripts/torture.py [--quick] [--seed N]
"""
import argparse
import json
import os
import random
import resource as rlimit
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, ".peers", "venv")
DQ = os.environ.get("DQ_BIN", os.path.join(ROOT, ".build", "debug", "dq"))
BENCH = os.environ.get("DQ_BENCH_BIN", os.path.join(os.path.dirname(DQ), "dq-bench"))
# Set by make sanitize: ThreadSanitizer's runtime dies with SIGBUS under any RLIMIT_FSIZE before dq's code
# runs (`ulimit -f 150; dq version` crashes too), so the file-size-limit runs are left to the plain and
# AddressSanitizer builds there.
SANITIZER = os.environ.get("DQ_SANITIZER", "")
CHILDREN = []
TABLE = []
FAILURES = []


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def spawn(cmd, **kw):
    process = subprocess.Popen(cmd, **kw)
    CHILDREN.append(process)
    return process


def stop_all():
    for process in CHILDREN:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_http(url, seconds=60):
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except Exception:
            time.sleep(0.1)
    raise SystemExit("not ready: " + url)


class FHIR:
    def __init__(self, work, tokens=None):
        self.port = free_port()
        # A directory of its own: a port handed out again (after an earlier server here stopped) must neither
        # collide with that server's directory nor serve its data.
        self.dir = tempfile.mkdtemp(prefix="fhir-%d-" % self.port, dir=work)
        auth = "  types: [bearer]\n  tokens: [%s]\n" % ", ".join(tokens) if tokens else "  types: [none]\n"
        with open(os.path.join(self.dir, "settings.yaml"), "w") as f:
            f.write("host: 127.0.0.1\nport: %d\nbase_url: http://127.0.0.1:%d/fhir\ndata_dir: %s/data\n"
                    "log_inbound: false\nsimulator: {enabled: false}\nserver_auth:\n%s"
                    % (self.port, self.port, self.dir, auth))
        self.base = "http://127.0.0.1:%d/fhir" % self.port
        self.process = None
        self.start()

    def start(self):
        self.process = spawn([os.path.join(VENV, "bin", "sekmet"), "serve", "-c", os.path.join(self.dir, "settings.yaml")],
                             cwd=self.dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_http(self.base + "/metadata")

    def get(self, path, token=None):
        request = urllib.request.Request(self.base + path)
        if token:
            request.add_header("Authorization", "Bearer " + token)
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.load(r)

    def kill(self):
        self.process.kill()
        self.process.wait()

    def values(self, rtype, system, token=None):
        """Identifier values of `system` on the server, oldest first."""
        found, offset = [], 0
        while True:
            page = self.get("/%s/_history?_count=500&_offset=%d" % (rtype, offset), token)
            entries = page.get("entry", [])
            if not entries:
                break
            for entry in entries:
                for ident in entry.get("resource", {}).get("identifier", []):
                    if ident.get("system") == system:
                        found.append(ident["value"])
            offset += len(entries)
        return list(reversed(found))


def observation(system, value):
    return json.dumps({"resourceType": "Observation", "status": "final",
                       "identifier": [{"system": system, "value": value}], "code": {"text": "torture " + value}})


def dq(args, env, timeout=120, **kw):
    return subprocess.run([DQ] + args, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def env_for(work, server, db="queue.sqlite", idempotent=True, timeout=None, batch=None):
    """idempotent: True or False sets DQ_IDEMPOTENT; None leaves the default ("auto")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DQ_")}
    env.update({"DQ_SERVER": server, "DQ_DATABASE": os.path.join(work, db), "HOME": work})
    if idempotent is not None:
        env["DQ_IDEMPOTENT"] = "true" if idempotent else "false"
    if batch is not None:
        env["DQ_BATCH_SIZE"] = str(batch)
    return env


def batching(batch):
    return "one by one" if batch == 1 else "Bundles of %d" % batch


def flush_until_done(env, extra=(), attempts=200):
    for _ in range(attempts):
        result = dq(["flush", "--now", "--wait", "30"] + list(extra), env)
        if result.returncode == 0:
            return True
        time.sleep(0.05)
    return False


def check(name, runs, kills, faults, expected, actual, extra_ok=True, note="", groups=None, may_miss=(), copies=1):
    """expected: values in the order they must appear; actual: values on the server, oldest first.
    groups: lists of values whose order must hold within each list (order between lists is free).
    may_miss: expected values that may be absent (never acknowledged to their producer).
    copies: how many copies of one value may arrive before it counts as a failure (the table shows every copy
    beyond the first: a run that allows a second copy of the request on the wire still reports it)."""
    seen = {}
    for value in actual:
        seen[value] = seen.get(value, 0) + 1
    optional = set(may_miss)
    lost = sum(1 for value in expected if value not in seen and value not in optional)
    duplicated = sum(count - 1 for count in seen.values() if count > 1)
    unexpected = sum(1 for value in seen if value not in set(expected))
    out_of_order = 0
    for group in (groups or [expected]):
        positions = {value: i for i, value in enumerate(group)}
        order = [positions[v] for v in dict.fromkeys(actual) if v in positions]
        out_of_order += sum(1 for a, b in zip(order, order[1:]) if b < a)
    TABLE.append((name, runs, kills, faults, len(expected), len(seen), lost, duplicated + unexpected, out_of_order, note))
    too_many = sum(1 for count in seen.values() if count > copies)
    ok = lost == 0 and too_many == 0 and unexpected == 0 and out_of_order == 0 and extra_ok
    if not ok:
        FAILURES.append(name)
    print("  %s: %s" % (name, "ok" if ok else "FAILED"), flush=True)


def integrity(path):
    con = sqlite3.connect(path)
    result = con.execute("PRAGMA integrity_check").fetchone()[0]
    con.close()
    return result == "ok"


# ---------------------------------------------------------------------------------------------------------

def crash_loop(work, iterations, rng, batch, at_rest=False):
    sealed = ", sealed at rest" if at_rest else ""
    print("crash loop (%s%s): %d iterations of enqueue and flush killed with SIGKILL" % (batching(batch), sealed, iterations),
          flush=True)
    fhir = FHIR(work)
    db = "crash-%d%s.sqlite" % (batch, "-sealed" if at_rest else "")
    env = env_for(work, fhir.base, db, batch=batch)
    if at_rest:
        key = os.path.join(work, "crash-%d.key" % batch)
        made = dq(["keygen", "--at-rest", "--out", key], env)
        if made.returncode != 0:
            raise SystemExit("dq keygen --at-rest failed: " + made.stderr)
        env["DQ_AT_REST_KEY_FILE"] = key
    system = "urn:torture:crash:%d" % rng.randrange(1 << 30)
    committed, uncertain, kills = [], [], 0
    chunk_file = os.path.join(work, "chunk.ndjson")
    for iteration in range(iterations):
        values = ["%05d-%d" % (iteration, i) for i in range(rng.randint(1, 6))]
        with open(chunk_file, "w") as f:
            f.write("\n".join(observation(system, v) for v in values) + "\n")
        enqueue = spawn([DQ, "enqueue", "--ndjson", chunk_file], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        flush = spawn([DQ, "flush", "--now", "--wait", "5"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0, 0.12))
        victims = [p for p in (enqueue, flush) if rng.random() < 0.7]
        for p in victims:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                kills += 1
        code = enqueue.wait()
        flush.wait()
        (committed if code == 0 else uncertain).append(values)
    # Sealed at rest: no item left plain by a kill mid-enqueue or mid-flush, and the resources' identifier system
    # (in every one of them) in no byte of the database, its WAL or its SHM.
    sealed_ok, sealed_note = True, ""
    if at_rest:
        status = dq(["status", "--json"], env)
        rest = json.loads(status.stdout).get("at_rest", {}) if status.returncode == 0 else {}
        files = [os.path.join(work, db) + suffix for suffix in ("", "-wal", "-shm")]
        leaked = [f for f in files if os.path.exists(f) and system.encode() in open(f, "rb").read()]
        sealed_ok = status.returncode == 0 and rest.get("plain") == 0 and not leaked
        sealed_note = ", sealed: %s items under the key, %s plain, readable in %s" % (
            sum((rest.get("items") or {}).values()), rest.get("plain"), [os.path.basename(f) for f in leaked] or "no file")
    ok = flush_until_done(env)
    actual = fhir.values("Observation", system)
    present = set(actual)
    # A killed enqueue committed all of its chunk or none of it (one transaction).
    expected = []
    atomic = True
    for iteration_values in sorted(committed + uncertain, key=lambda v: v[0]):
        hits = sum(1 for v in iteration_values if v in present)
        if iteration_values in committed or hits:
            expected.extend(iteration_values)
        if hits not in (0, len(iteration_values)):
            atomic = False
    good = ok and atomic and sealed_ok and integrity(os.path.join(work, db))
    check("crash loop (SIGKILL enqueue + flush), %s%s" % (batching(batch), sealed), iterations, kills, 0, expected, actual, good,
          ("integrity_check ok" if good else "integrity/atomicity/sealing FAILED") + sealed_note)
    fhir.kill()


def c3pro_envelope(public_key, key_id, resource):
    """An envelope as a C3-PRO app makes it: AES-256-CBC, zero IV, PKCS#7; the key RSA-OAEP-SHA1 wrapped."""
    import base64
    from cryptography.hazmat.primitives import hashes, padding
    from cryptography.hazmat.primitives.asymmetric import padding as asymmetric
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    key = os.urandom(32)
    padder = padding.PKCS7(128).padder()
    data = padder.update(resource.encode()) + padder.finalize()
    encryptor = Cipher(algorithms.AES(key), modes.CBC(b"\0" * 16)).encryptor()
    message = encryptor.update(data) + encryptor.finalize()
    wrapped = public_key.encrypt(key, asymmetric.OAEP(mgf=asymmetric.MGF1(hashes.SHA1()), algorithm=hashes.SHA1(), label=None))
    return json.dumps({"key_id": key_id, "symmetric_key": base64.b64encode(wrapped).decode(),
                       "message": base64.b64encode(message).decode(), "version": "3.0.0"})


class ServeRig:
    """dq serve's surroundings for a run: a key pair, the Antispam secret, an at-rest key, a config file; start()
    runs a receiver on a port; register() and token() speak as a C3-PRO app."""

    def __init__(self, work, name, fhir, database_env=None):
        from cryptography.hazmat.primitives import serialization
        self.keys = os.path.join(work, name + "-keys")
        os.makedirs(self.keys, exist_ok=True)
        subprocess.run(["openssl", "genrsa", "-out", os.path.join(self.keys, "k1.pem"), "2048"], check=True, capture_output=True)
        with open(os.path.join(self.keys, "k1.pem"), "rb") as f:
            self.public_key = serialization.load_pem_private_key(f.read(), password=None).public_key()
        self.env = env_for(work, fhir.base, name + ".sqlite", idempotent=None)
        self.env.update(database_env or {})
        at_rest = os.path.join(work, name + "-at-rest.key")
        if dq(["keygen", "--at-rest", "--out", at_rest], self.env).returncode != 0:
            raise SystemExit("dq keygen --at-rest failed")
        with open(os.path.join(work, name + "-antispam"), "w") as f:
            f.write("torture-antispam\n")
        self.config = os.path.join(work, name + ".json")
        with open(self.config, "w") as f:
            json.dump({"server": fhir.base, "at_rest": {"key_file": at_rest},
                       "serve": {"antispam_file": os.path.join(work, name + "-antispam"), "keys_dir": self.keys,
                                 "default_key_id": "k1"}}, f)
        self.log = open(os.path.join(work, name + ".log"), "ab")

    def start(self, port):
        process = spawn([DQ, "serve", "--config", self.config, "--listen", "127.0.0.1:%d" % port, "--poll-interval", "0.1"],
                        env=self.env, stdout=self.log, stderr=self.log)
        wait_http("http://127.0.0.1:%d/readyz" % port)
        return process

    @staticmethod
    def post(port, path, body, headers):
        request = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=body.encode(), headers=headers,
                                         method="POST")
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()

    def register_and_token(self, register_port, token_port):
        import base64
        _, body = self.post(register_port, "/c3pro/register", json.dumps({"sandbox": False, "receipt-data": "NO-APP-RECEIPT"}),
                            {"Antispam": "torture-antispam", "Content-Type": "application/json"})
        client = json.loads(body)
        basic = base64.b64encode(("%s:%s" % (client["client_id"], client["client_secret"])).encode()).decode()
        _, body = self.post(token_port, "/c3pro/oauth", "grant_type=client_credentials",
                            {"Authorization": "Basic " + basic, "Content-Type": "application/x-www-form-urlencoded"})
        return json.loads(body)["access_token"]

    def send(self, port, token, envelope):
        """True when the envelope was answered 202; False when not answered (the receiver died) or refused."""
        try:
            status, _ = self.post(port, "/c3pro/encfhir/Observation", envelope,
                                  {"Authorization": "Bearer " + token, "Content-Type": "application/json"})
            return status == 202
        except Exception:
            return False

    def quarantined(self):
        listed = dq(["quarantine", "list", "--json", "--config", self.config], self.env)
        return json.loads(listed.stdout) if listed.returncode == 0 else None


def wait_delivered(fhir, system, acknowledged, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline and not set(acknowledged) <= set(fhir.values("Observation", system)):
        time.sleep(0.5)


def serve_crash(work, iterations, rng):
    """dq serve SIGKILLed while a device posts envelopes: every envelope answered 202 reaches the server once,
    in the order it was acknowledged, across the restarts; one token serves across all of them."""
    print("serve crash loop: %d runs of dq serve SIGKILLed while a device posts envelopes" % iterations, flush=True)
    fhir = FHIR(work)
    rig = ServeRig(work, "serve", fhir)
    port = free_port()
    server = rig.start(port)
    token = rig.register_and_token(port, port)
    system = "urn:torture:serve:%d" % rng.randrange(1 << 30)
    acknowledged, uncertain, kills = [], [], 0
    for iteration in range(iterations):
        if server is None:
            server = rig.start(port)
        values = ["%05d-%d" % (iteration, i) for i in range(rng.randint(1, 8))]
        envelopes = [c3pro_envelope(rig.public_key, "k1", observation(system, v)) for v in values]

        def device():
            for value, envelope in zip(values, envelopes):
                if not rig.send(port, token, envelope):
                    return  # killed mid-request: never acknowledged (a device would send it again; not here)
                acknowledged.append(value)
        thread = threading.Thread(target=device)
        thread.start()
        time.sleep(rng.uniform(0, 0.15))
        server.send_signal(signal.SIGKILL)
        server.wait()
        kills += 1
        server = None
        thread.join()
        uncertain.extend(v for v in values if v not in acknowledged)
    server = rig.start(port)
    wait_delivered(fhir, system, acknowledged)
    server.send_signal(signal.SIGTERM)
    stopped = server.wait(timeout=60) == 0
    actual = fhir.values("Observation", system)
    check("serve crash loop (SIGKILL after 202s)", iterations, kills, 0, sorted(acknowledged + uncertain), actual,
          stopped and rig.quarantined() == [] and integrity(os.path.join(work, "serve.sqlite")),
          "%d acknowledged, %d unanswered; one token across every restart; integrity_check ok; nothing quarantined"
          % (len(acknowledged), len(uncertain)), may_miss=uncertain)
    fhir.kill()


def serve_shared(work, count, rng):
    """Two dq serve on one PostgreSQL queue, a device alternating between them with one token (registered at one,
    its token from the other); one receiver SIGKILLed mid-stream and started again: every envelope answered 202
    reaches the server once, in the device's order."""
    print("serve shared (PostgreSQL): 2 receivers, %d envelopes, receivers killed mid-stream" % count, flush=True)
    fhir = FHIR(work)
    root = tempfile.mkdtemp(prefix="dq-torture-pg-")
    os.chmod(root, 0o755)
    pg_dir = os.path.join(root, "cluster")
    url = postgres_start(pg_dir, free_port())
    with open(os.path.join(pg_dir, "password")) as f:
        password = f.read().strip()
    rig = ServeRig(work, "serve-shared", fhir,
                   {"DQ_DATABASE": url + "?sslmode=disable", "PGPASSWORD": password, "DQ_LEASE_SECONDS": "3"})
    ports = [free_port(), free_port()]
    receivers = [rig.start(port) for port in ports]
    token = rig.register_and_token(ports[0], ports[1])
    system = "urn:torture:serve-shared:%d" % rng.randrange(1 << 30)
    acknowledged, uncertain, kills = [], [], 0
    for index in range(count):
        value = "%05d" % index
        which = index % 2
        running = [i for i, process in enumerate(receivers) if process is not None]
        if len(running) == 2 and rng.random() < 0.08:
            # One receiver dies (with whatever it was doing); the other goes on taking the device's envelopes.
            victim = rng.choice(running)
            receivers[victim].send_signal(signal.SIGKILL)
            receivers[victim].wait()
            kills += 1
            receivers[victim] = None
        if receivers[which] is None:
            if rng.random() < 0.5:
                receivers[which] = rig.start(ports[which])
            else:
                which = 1 - which
                if receivers[which] is None:
                    receivers[which] = rig.start(ports[which])
        envelope = c3pro_envelope(rig.public_key, "k1", observation(system, value))
        (acknowledged if rig.send(ports[which], token, envelope) else uncertain).append(value)
    for index, process in enumerate(receivers):
        if process is None:
            receivers[index] = rig.start(ports[index])
    wait_delivered(fhir, system, acknowledged)
    stopped = True
    for process in receivers:
        process.send_signal(signal.SIGTERM)
        stopped = process.wait(timeout=60) == 0 and stopped
    actual = fhir.values("Observation", system)
    check("serve shared (2 receivers, PostgreSQL)", count, kills, 0, acknowledged + uncertain, actual,
          stopped and rig.quarantined() == [] and not uncertain,
          "%d acknowledged, %d unanswered; one token at both receivers; nothing quarantined" % (len(acknowledged), len(uncertain)),
          may_miss=uncertain)
    fhir.kill()
    postgres_stop(pg_dir)
    shutil.rmtree(root, ignore_errors=True)


def held_answers(work, iterations, rng):
    """Exactly once with default settings (issue 42, item 5): 60 resources queued at a time, and each flush
    SIGKILLed after the server committed its transaction Bundle and before dq journaled it. Every other
    iteration a proxy holds the server's answer until the flush is killed (every time: with idempotent false,
    60 of 60 arrived twice); the others kill the flush at 0.1-0.3 s (under load: 120 of 60 stored). Nothing
    sets idempotent or batch_size: the default, "auto", sends conditional creates for the types sekmet
    declares."""
    print("held answers (default settings): %d flushes SIGKILLed after the server committed their Bundle" % iterations,
          flush=True)
    fhir = FHIR(work)
    port = free_port()
    spawn([sys.executable, os.path.join(ROOT, "scripts", "faultproxy.py"), "--listen", str(port),
           "--upstream", "http://127.0.0.1:%d" % fhir.port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    control = "http://127.0.0.1:%d/__proxy/" % port
    wait_http(control + "stats")

    def proxy(path, body=None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(control + path, data=data, method="GET" if data is None else "POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            text = r.read()
        return json.loads(text) if text else None

    def holding(count, seconds=60):
        deadline = time.time() + seconds
        while time.time() < deadline:
            if proxy("stats")["holding"] == count:
                return True
            time.sleep(0.02)
        return False

    env = env_for(work, "http://127.0.0.1:%d/fhir" % port, "held.sqlite", idempotent=None)
    system = "urn:torture:held:%d" % rng.randrange(1 << 30)
    path = os.path.join(work, "held.ndjson")
    expected, kills, holds, reached = [], 0, 0, True
    for iteration in range(iterations):
        values = ["%03d-%02d" % (iteration, i) for i in range(60)]
        with open(path, "w") as f:
            f.write("\n".join(observation(system, v) for v in values) + "\n")
        if dq(["enqueue", "--ndjson", path], env).returncode != 0:
            raise SystemExit("held answers: dq enqueue failed")
        expected.extend(values)
        held = iteration % 2 == 0
        if held:
            proxy("faults", ["hold"])
        flush = spawn([DQ, "flush", "--now", "--wait", "30"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if held:
            reached = holding(1) and reached
        else:
            time.sleep(rng.uniform(0.1, 0.3))
        if flush.poll() is None:
            flush.send_signal(signal.SIGKILL)
            kills += 1
        flush.wait()
        if held:
            holds += 1
            proxy("release", {})
            reached = holding(0) and reached
            proxy("reset", {})
    ok = flush_until_done(env) and reached
    check("held answers (flush SIGKILLed after the server committed), default settings", iterations, kills, holds, expected,
          fhir.values("Observation", system), ok, "%d answers held by the proxy, %d kills at 0.1-0.3 s; idempotent auto" % (
              holds, kills - holds))
    fhir.kill()


def network_faults(work, count, rng, seed, batch):
    print("network faults (%s): %d resources through a fault-injecting proxy" % (batching(batch), count), flush=True)
    fhir = FHIR(work)
    port = free_port()
    spawn([sys.executable, os.path.join(ROOT, "scripts", "faultproxy.py"), "--listen", str(port),
           "--upstream", "http://127.0.0.1:%d" % fhir.port, "--random", "0.2", "--seed", str(seed), "--stall", "2.5"],
          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http("http://127.0.0.1:%d/__proxy/stats" % port)
    env = env_for(work, "http://127.0.0.1:%d/fhir" % port, "faults-%d.sqlite" % batch, batch=batch)
    system = "urn:torture:faults:%d" % rng.randrange(1 << 30)
    values = ["%06d" % i for i in range(count)]
    path = os.path.join(work, "faults.ndjson")
    with open(path, "w") as f:
        f.write("\n".join(observation(system, v) for v in values) + "\n")
    assert dq(["enqueue", "--ndjson", path], env).returncode == 0
    ok = flush_until_done(env, ["--timeout", "1.5"], attempts=max(200, count))
    with urllib.request.urlopen("http://127.0.0.1:%d/__proxy/stats" % port) as r:
        stats = json.load(r)
    faults = sum(stats["faults"].values())
    check("network faults (503, drops, latency, stalls), %s" % batching(batch), 1, 0, faults, values,
          fhir.values("Observation", system), ok,
          ", ".join("%s %d" % kv for kv in sorted(stats["faults"].items())))
    fhir.kill()


def daemon_faults(work, rng, count):
    """dq run under what an operator's machine does to it: its flush lock file deleted while cron flushes run
    beside it (every item at most once), and its database deleted under it (it must stop, not flush an unlinked
    file while new items wait)."""
    print("daemon faults: lock file deleted beside cron flushes; database deleted under dq run", flush=True)
    fhir = FHIR(work)
    # Each request held 30 ms by a proxy, so that most deletions land while dq run has a request on the wire:
    # a cron flush that got in then would send that item again.
    port = free_port()
    spawn([sys.executable, os.path.join(ROOT, "scripts", "faultproxy.py"), "--listen", str(port),
           "--upstream", "http://127.0.0.1:%d" % fhir.port, "--latency", "30"],
          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http("http://127.0.0.1:%d/__proxy/stats" % port)
    env = env_for(work, "http://127.0.0.1:%d/fhir" % port, "daemon.sqlite", idempotent=False, batch=1)
    system = "urn:torture:daemon:%d" % rng.randrange(1 << 30)
    values = ["%05d" % i for i in range(count)]
    path = os.path.join(work, "daemon.ndjson")
    with open(path, "w") as f:
        f.write("\n".join(observation(system, v) for v in values) + "\n")
    assert dq(["enqueue", "--ndjson", path, "--durability", "normal"], env).returncode == 0
    run_log = open(os.path.join(work, "daemon-run.log"), "w")
    run = spawn([DQ, "run", "--poll-interval", "0.05"], env=dict(env, DQ_LOG_LEVEL="info"), stdout=subprocess.DEVNULL,
                stderr=run_log)
    # The lock files deleted every 20 ms by one thread while cron flushes run one after another: both dq run and
    # the cron flushes lose their lock files while they hold them, again and again.
    deletions, deadline, done = [0], time.time() + 60, threading.Event()

    def delete():
        while not done.wait(0.02):
            for name in os.listdir(work):
                if name.startswith("daemon.sqlite.flush-") and name.endswith(".lock"):
                    try:
                        os.unlink(os.path.join(work, name))
                        deletions[0] += 1
                    except FileNotFoundError:
                        pass

    deleter = threading.Thread(target=delete)
    deleter.start()
    codes, last_errors = {}, []
    try:
        while time.time() < deadline and len(set(fhir.values("Observation", system))) < count:
            started = time.time()
            result = dq(["flush", "--now"], env, timeout=60)
            codes[result.returncode] = codes.get(result.returncode, 0) + 1
            if result.returncode != 0:
                last_errors = (last_errors + ["%.1fs exit %d: %s" % (time.time() - started, result.returncode,
                                                                     result.stderr.strip()[-200:])])[-5:]
    finally:
        done.set()
        deleter.join()
    deletions = deletions[0]
    run.send_signal(signal.SIGTERM)
    run.wait(timeout=60)
    # A holder whose lock file is deleted moves to the new file at its next send, or stops if it cannot (another
    # flusher holds or has used the new file), so on a loaded machine a storm of deletions may still hold some
    # delivery back while it lasts: what must hold is that nothing is sent twice meanwhile, and that everything
    # arrives once the deletions stop. How many arrived during the storm is reported.
    during = len(set(fhir.values("Observation", system)))
    drained = flush_until_done(env)
    run_log.close()
    name = "flush lock file deleted under dq run, cron flushes beside it"
    check(name, 1, 0, deletions, values, fhir.values("Observation", system), drained,
          note="%d deletions; %d of %d delivered while they went on; cron exits %s" % (
              deletions, during, count, ", ".join("%s: %d" % kv for kv in sorted(codes.items()))))
    if name in FAILURES or during < count:
        # What the flushers said, for the next person to read (the work folder goes when the run ends).
        print("  cron flushes' last errors:\n    " + "\n    ".join(last_errors), flush=True)
        with open(os.path.join(work, "daemon-run.log"), errors="replace") as f:
            print("  dq run's last lines:\n    " + "\n    ".join(f.read().splitlines()[-25:]), flush=True)

    # The database deleted under dq run: it stops with an error (exit 74) instead of flushing the unlinked file.
    later = ["%05d" % i for i in range(count, count + 5)]
    port = free_port()
    run = spawn([DQ, "run", "--poll-interval", "0.05", "--metrics-address", "127.0.0.1:%d" % port], env=env,
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # Deleted once dq run has its queue open (a fixed second was not always enough on a loaded machine: deleted
    # before the open, the file is made anew and dq run rightly goes on).
    wait_group_runs(port)
    time.sleep(0.3)  # dq run has looked at its files (it notes its -wal and -shm while they are its own)
    # The database alone, as an operator's rm does: its -wal and -shm stay, and must not be replayed into the next.
    os.unlink(os.path.join(work, "daemon.sqlite"))
    try:
        code = run.wait(timeout=30)
        message = run.stderr.read()
    except subprocess.TimeoutExpired:
        run.kill()
        code, message = None, "still running 30 s after its database was deleted"
    with open(path, "w") as f:
        f.write("\n".join(observation(system, v) for v in later) + "\n")
    assert dq(["enqueue", "--ndjson", path], env).returncode == 0
    ok = flush_until_done(env)
    stopped = code == 74 and "deleted" in message
    left = [n for n in os.listdir(work) if n.startswith("daemon.sqlite-") and (".deleted-" in n or ".orphaned-" in n)]
    sound = integrity(os.path.join(work, "daemon.sqlite"))
    check("database deleted under dq run (it exits 74, moves its -wal and -shm aside; the new file's items flush)",
          1, 0, 1, values + later, fhir.values("Observation", system), ok and stopped and bool(left) and sound,
          "exit %s; %d file(s) moved aside; integrity %s" % (code, len(left), "ok" if sound else "FAILED"))
    fhir.kill()


def wait_group_runs(port, seconds=60):
    """Waits until the dq run serving metrics on `port` has its service group running (its /readyz no longer says
    it is starting): its queue is open and it delivers. True when it does."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            body = urllib.request.urlopen("http://127.0.0.1:%d/readyz" % port, timeout=2).read()
        except urllib.error.HTTPError as e:
            body = e.read()
        except Exception:
            body = b"starting"
        if b"starting" not in body:
            return True
        time.sleep(0.05)
    return False


def wait_for_line(path, needle, seconds):
    """Waits until the file at `path` holds `needle`; True when it does."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        with open(path, errors="replace") as f:
            if needle in f.read():
                return True
        time.sleep(0.05)
    return False


def write_faults(work, rng, quick):
    """dq run when its database stops taking writes (issue: it re-sent the first item in a loop and said
    nothing). A journal write that fails stops the flush at once, is logged, and nothing is sent until writes
    work again: each item reaches the server at most twice (the request on the wire when the write failed),
    none after the error is logged, and dq exits cleanly on SIGTERM."""
    print("write faults: a file-size limit and an immutable database under dq run", flush=True)
    fhir = FHIR(work)
    settle = 4 if quick else 15
    config = os.path.join(work, "writes.json")
    with open(config, "w") as f:
        json.dump({"retry": {"initial_seconds": 0.2, "maximum_seconds": 1}}, f)

    def run_under(name, env, fault, lift, preexec=None, system=None):
        """Starts dq run, applies `fault`, and checks what reached the server before and after it was logged."""
        log = os.path.join(work, name + ".log")
        port = free_port()
        with open(log, "w") as out:
            run = spawn([DQ, "run", "--config", config, "--poll-interval", "0.05", "--metrics-address",
                         "127.0.0.1:%d" % port], env=env, stdout=out, stderr=out, preexec_fn=preexec)
        # The fault once the queue is open, so that it meets a flush, not the open.
        wait_group_runs(port)
        values = fault(env)
        reported = wait_for_line(log, "flush failed", 30)
        at_report = len(fhir.values("Observation", system))
        time.sleep(settle)
        after = len(fhir.values("Observation", system))
        run.send_signal(signal.SIGTERM)
        try:
            code = run.wait(timeout=60)
        except subprocess.TimeoutExpired:
            run.kill()
            code = None
        lift()
        ok = flush_until_done(env)
        with open(log, errors="replace") as f:
            text = f.read()
        quiet = after == at_report and text.count("flush failed") == 1
        if not (reported and quiet and code == 0 and ok):
            # What dq run said, so that a failure on a loaded machine names its cause.
            print("  %s: reported %s, sent after the line %d, 'flush failed' lines %d, exit %s, flushed after %s; its log:\n%s"
                  % (name, reported, after - at_report, text.count("flush failed"), code, ok, text[-4000:]), flush=True)
        check("%s under dq run (logged, nothing sent after; clean SIGTERM)" % name.replace("-", " "), 1, 0, 1, values,
              fhir.values("Observation", system), reported and quiet and code == 0 and ok,
              "exit %s; %d sent while failing, %d after the log line" % (code, at_report, after - at_report), copies=2)

    # A file-size limit dq run hits once another process has made the WAL larger than it.
    if SANITIZER == "thread":
        print("  file-size limit: not under ThreadSanitizer (its runtime dies under RLIMIT_FSIZE)", flush=True)
    else:
        file_size_limit(work, rng, fhir, config, run_under)
    immutable_database(work, rng, fhir, run_under)
    fhir.kill()


def file_size_limit(work, rng, fhir, config, run_under):
    system = "urn:torture:fsize:%d" % rng.randrange(1 << 30)
    env = env_for(work, fhir.base, "fsize.sqlite", idempotent=False)
    small = os.path.join(work, "fsize-first.json")
    with open(small, "w") as f:
        f.write(observation(system, "warm"))
    assert dq(["enqueue", small], env).returncode == 0
    assert flush_until_done(env)
    system = "urn:torture:fsize:%d" % rng.randrange(1 << 30)
    limit = 150 * 1024

    def cap():
        rlimit.setrlimit(rlimit.RLIMIT_FSIZE, (limit, limit))

    def grow(env):
        values = []
        for i in range(6):
            value = "%02d" % i
            path = os.path.join(work, "fsize-%d.json" % i)
            with open(path, "w") as f:
                f.write(json.dumps({"resourceType": "Observation", "status": "final", "code": {"text": "x" * 50_000},
                                    "identifier": [{"system": system, "value": value}]}))
            assert dq(["enqueue", path], env).returncode == 0
            values.append(value)
        return values

    run_under("file-size-limit", env, grow, lambda: None, preexec=cap, system=system)


def immutable_database(work, rng, fhir, run_under):
    # Database files made immutable (chattr +i, which binds root too) while items wait for a server that is down.
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        print("  immutable database: needs root and chattr; not run", flush=True)
        return
    system = "urn:torture:immutable:%d" % rng.randrange(1 << 30)
    env = env_for(work, fhir.base, "immutable.sqlite", idempotent=False)
    # Not the -shm: SQLite writes it through a shared memory map, and on ext4 a write to a mapped page of an
    # immutable file ends the process with SIGBUS once the kernel has written that page back (ext4_page_mkwrite
    # refuses it), in dq or in the sqlite3 shell alike. Freezing the database and its WAL makes every write fail.
    files = [os.path.join(work, "immutable.sqlite" + suffix) for suffix in ("", "-wal")]

    def freeze(env):
        fhir.kill()
        values = ["%02d" % i for i in range(3)]
        path = os.path.join(work, "immutable.ndjson")
        with open(path, "w") as f:
            f.write("\n".join(observation(system, v) for v in values) + "\n")
        assert dq(["enqueue", "--ndjson", path], env).returncode == 0
        time.sleep(1)
        subprocess.run(["chattr", "+i"] + [p for p in files if os.path.exists(p)], check=True)
        fhir.start()
        return values

    def thaw():
        subprocess.run(["chattr", "-i"] + [p for p in files if os.path.exists(p)], check=True)

    try:
        run_under("immutable-database", env, freeze, thaw, system=system)
    finally:
        subprocess.run(["chattr", "-i"] + [p for p in files if os.path.exists(p)])


def refused_token(work, rng, quick):
    """dq run with a bearer token the server refuses (issue: 40 POSTs and 20 identical log lines in 20 s):
    it backs off like a transient failure, says so once, and says once that it works when the token does."""
    print("refused token: dq run against a server that refuses its bearer token, then accepts a new one", flush=True)
    fhir = FHIR(work, tokens=["good-token"])
    port = free_port()
    spawn([sys.executable, os.path.join(ROOT, "scripts", "faultproxy.py"), "--listen", str(port),
           "--upstream", "http://127.0.0.1:%d" % fhir.port], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_http("http://127.0.0.1:%d/__proxy/stats" % port)
    system = "urn:torture:token:%d" % rng.randrange(1 << 30)
    env = env_for(work, "http://127.0.0.1:%d/fhir" % port, "token.sqlite", idempotent=False)
    config = os.path.join(work, "token.json")
    with open(config, "w") as f:
        json.dump({"auth": {"bearer_token": "wrong-token"}}, f)
    os.chmod(config, 0o600)
    values = ["%02d" % i for i in range(3)]
    path = os.path.join(work, "token.ndjson")
    with open(path, "w") as f:
        f.write("\n".join(observation(system, v) for v in values) + "\n")
    assert dq(["enqueue", "--ndjson", path], env).returncode == 0
    log = os.path.join(work, "token.log")
    seconds = 8 if quick else 20
    started = time.time()
    with open(log, "w") as out:
        run = spawn([DQ, "run", "--config", config, "--poll-interval", "0.05"], env=env, stdout=out, stderr=out)
    # SIGTERM no sooner than its first refusal is logged: then its service group runs (a loaded machine can take
    # longer than the window to open the queue, and the row is of refusals under dq run).
    wait_for_line(log, "delivery stopped", 60)
    time.sleep(max(0.0, seconds - (time.time() - started)))
    with urllib.request.urlopen("http://127.0.0.1:%d/__proxy/stats" % port) as r:
        requests = json.load(r)["requests"]
    run.send_signal(signal.SIGTERM)
    code = run.wait(timeout=60)
    with open(log, errors="replace") as f:
        text = f.read()
    lines = [line for line in text.splitlines() if "delivery stopped" in line]
    # Each refusal is a request and one retry with the token again; backoff from 1 s doubling keeps it to a few.
    calm = requests <= 2 * 6 and len(lines) == 1 and "wrong-token" not in text
    with open(config, "w") as f:
        json.dump({"auth": {"bearer_token": "good-token"}}, f)
    ok = flush_until_done(env, ["--config", config])
    check("refused bearer token under dq run (backs off, says so once)", 1, 0, 1, values,
          fhir.values("Observation", system, "good-token"), calm and code == 0 and ok,
          "%d requests in %d s, %d log line(s) about it" % (requests, seconds, len(lines)))
    fhir.kill()


def concurrency(work, producers, per_producer, rng):
    print("concurrency: %d enqueue + %d flush processes and an in-process library user" % (producers, producers), flush=True)
    fhir = FHIR(work)
    env = env_for(work, fhir.base, "conc.sqlite")
    system = "urn:torture:conc:%d" % rng.randrange(1 << 30)
    processes, expected_by_producer = [], []
    for producer in range(producers):
        values = ["p%d-%05d" % (producer, i) for i in range(per_producer)]
        expected_by_producer.append(values)
        path = os.path.join(work, "p%d.ndjson" % producer)
        with open(path, "w") as f:
            f.write("\n".join(observation(system, v) for v in values) + "\n")
    for producer in range(producers):
        processes.append(spawn([DQ, "enqueue", "--ndjson", os.path.join(work, "p%d.ndjson" % producer)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        processes.append(spawn([DQ, "flush", "--wait", "60"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    library_values = ["lib-%05d" % i for i in range(per_producer)]
    if os.path.exists(BENCH):
        processes.append(spawn([BENCH, "library-user", os.path.join(work, "conc.sqlite"), fhir.base, system,
                                str(per_producer)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        expected_by_producer.append(library_values)
    codes = [p.wait() for p in processes]
    ok = flush_until_done(env) and all(c in (0, 75) for c in codes)
    actual = fhir.values("Observation", system)
    everything = [v for values in expected_by_producer for v in values]
    # Order holds per producer; interleaving between producers is free.
    check("concurrency (enqueue x%d, flush x%d, library)" % (producers, producers), 1, 0, 0, everything, actual, ok,
          "order checked per producer", groups=expected_by_producer)
    fhir.kill()


def postgres_start(directory, port):
    result = subprocess.run([os.path.join(ROOT, "scripts", "postgres.sh"), "start", directory, str(port)],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise SystemExit("PostgreSQL did not start: " + result.stderr[-2000:])
    return result.stdout.strip()


def postgres_stop(directory, mode="stop"):
    subprocess.run([os.path.join(ROOT, "scripts", "postgres.sh"), mode, directory], capture_output=True, timeout=120)


def postgres_script(*arguments):
    result = subprocess.run([os.path.join(ROOT, "scripts", "postgres.sh")] + [str(a) for a in arguments],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise SystemExit("postgres.sh %s failed: %s" % (arguments[0], result.stderr[-2000:]))
    return result.stdout.strip()


def shared_queue(work, rng, per_producer, events, failover=False):
    """Three producers and two `dq run` flushers on one PostgreSQL queue, with SIGKILLs of flushers and of
    producers' enqueues, a PostgreSQL restart, and a flusher paused (SIGSTOP) past its lease, then resumed.

    failover: the queue is reached through PgBouncer (transaction mode) in front of a primary with a
    synchronous streaming standby; instead of a restart, the primary is killed, the standby promoted and
    PgBouncer pointed at it (as a failover manager would)."""
    print("%s (PostgreSQL): 3 producers x %d, 2 dq run, %d disruptions"
          % ("failover" if failover else "shared queue", per_producer, events), flush=True)
    fhir = FHIR(work)
    # Its own folder, which the server's user (nobody, when run as root) can reach.
    root = tempfile.mkdtemp(prefix="dq-torture-pg-")
    os.chmod(root, 0o755)
    pg_dir = os.path.join(root, "cluster")
    pg_port = free_port()
    url = postgres_start(pg_dir, pg_port)
    if failover:
        standby_dir, bouncer_dir = os.path.join(root, "standby"), os.path.join(root, "bouncer")
        standby_port = free_port()
        postgres_script("standby", standby_dir, standby_port, pg_dir, pg_port)
        os.makedirs(bouncer_dir)
        shutil.copy(os.path.join(pg_dir, "password"), os.path.join(bouncer_dir, "password"))
        bouncer_port = free_port()
        url = postgres_script("bouncer", bouncer_dir, bouncer_port, pg_port)
    env = env_for(work, fhir.base)
    env["DQ_DATABASE"] = url + "?sslmode=disable"
    with open(os.path.join(pg_dir, "password")) as f:
        env["PGPASSWORD"] = f.read().strip()
    env["DQ_LEASE_SECONDS"] = "3"
    system = "urn:torture:shared:%d" % rng.randrange(1 << 30)
    runners = [None, None]
    ports = [free_port(), free_port()]
    kills = faults = 0

    started_at = time.time()
    timeline = []  # (seconds, what): disruptions and acknowledgements, printed when the run fails

    def start_runner(index):
        log = open(os.path.join(root, "runner-%d.log" % index), "a")
        runners[index] = spawn([DQ, "run", "--poll-interval", "0.3", "--verbose", "--metrics-address",
                                "127.0.0.1:%d" % ports[index]], env=env, stdout=subprocess.DEVNULL, stderr=log)
        log.close()

    for index in range(2):
        start_runner(index)
    attempted = [[] for _ in range(3)]
    acknowledged = [set() for _ in range(3)]
    producers_done = [False] * 3
    import threading

    def produce(producer):
        for i in range(per_producer):
            value = "s%d-%05d" % (producer, i)
            path = os.path.join(work, "s-%s.json" % value)
            with open(path, "w") as f:
                f.write(observation(system, value))
            attempted[producer].append(value)
            process = spawn([DQ, "enqueue", path], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # Now and then the producer is killed mid-enqueue: that value was never acknowledged.
            if rng.random() < 0.05:
                time.sleep(rng.random() * 0.05)
                process.kill()
            if process.wait() == 0:
                acknowledged[producer].add(value)
                timeline.append((time.time() - started_at, "acknowledged %s" % value))
            else:
                # Not acknowledged (killed, or the database restarting): a real producer retries the same value.
                for _ in range(100):
                    retry = spawn([DQ, "enqueue", path], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    if retry.wait() == 0:
                        acknowledged[producer].add(value)
                        timeline.append((time.time() - started_at, "acknowledged %s on retry" % value))
                        break
                    time.sleep(0.2)
        producers_done[producer] = True

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(3)]
    for thread in threads:
        thread.start()
    plan = ["kill-runner"] * max(1, events - 2) + ["failover" if failover else "restart-postgres", "pause-runner"]
    rng.shuffle(plan)
    for event in plan:
        time.sleep(0.5 + rng.random())
        timeline.append((time.time() - started_at, "begin " + event))
        if event == "kill-runner":
            index = rng.randrange(2)
            runners[index].kill()
            runners[index].wait()
            kills += 1
            start_runner(index)
        elif event == "failover":
            postgres_stop(pg_dir, "kill")
            postgres_script("promote", standby_dir)
            postgres_script("bouncer", bouncer_dir, bouncer_port, standby_port)
            faults += 1
        elif event == "restart-postgres":
            postgres_stop(pg_dir, "kill")
            faults += 1
            time.sleep(1)
            postgres_start(pg_dir, int(url.rsplit(":", 1)[1].split("/")[0]))
        else:
            index = rng.randrange(2)
            runners[index].send_signal(signal.SIGSTOP)
            time.sleep(5)  # past the 3 s lease: the other runner takes over
            runners[index].send_signal(signal.SIGCONT)
            faults += 1
        timeline.append((time.time() - started_at, "end " + event))
    for thread in threads:
        thread.join()
    # Let the runners drain, then stop them.
    deadline = time.time() + 120
    drained = False
    while time.time() < deadline:
        status = dq(["status", "--json"], env)
        if status.returncode == 0 and json.loads(status.stdout).get("pending") == 0:
            drained = True
            break
        time.sleep(0.5)
    # Each runner stopped once its service group runs (one restarted late may still be opening its queue; a SIGTERM
    # then would stop it before delivery began, with nothing of the row's to judge).
    for port in ports:
        wait_group_runs(port)
    for runner in runners:
        runner.send_signal(signal.SIGTERM)
    codes = [runner.wait(timeout=60) for runner in runners]
    actual = fhir.values("Observation", system)
    expected = [v for values in attempted for v in values]
    never_acked = [v for producer in range(3) for v in attempted[producer] if v not in acknowledged[producer]]
    missing = [v for v in expected if v not in set(actual) and v not in set(never_acked)]
    if missing:
        # Say where the missing values went: the queue's counts, its items, the runners' logs and when each
        # missing value was acknowledged relative to the disruptions. The folder is kept for a post-mortem.
        print("  missing: %s; drained: %s; runner exits: %s" % (", ".join(missing), drained, codes), flush=True)
        print("  status: %s" % dq(["status", "--json"], env).stdout.strip(), flush=True)
        print("  queue: %s" % dq(["list", "--json"], env).stdout.strip()[:4000], flush=True)
        for seconds, what in sorted(timeline):
            if not what.startswith("acknowledged") or any(v in what for v in missing):
                print("  %7.2f s %s" % (seconds, what), flush=True)
        print("  runner logs and clusters kept in %s" % root, flush=True)
    if failover:
        check("failover to a synchronous standby (3 producers, 2 dq run, via PgBouncer)", len(plan), kills, faults,
              expected, actual, all(c == 0 for c in codes),
              "primary killed, standby promoted, PgBouncer repointed; a runner paused past its lease; order per producer",
              groups=attempted, may_miss=never_acked)
        postgres_stop(bouncer_dir)
        postgres_stop(standby_dir)
    else:
        check("shared PostgreSQL queue (3 producers, 2 dq run)", len(plan), kills, faults, expected, actual,
              all(c == 0 for c in codes), "PostgreSQL restarted once, a runner paused past its lease once; order per producer",
              groups=attempted, may_miss=never_acked)
    postgres_stop(pg_dir)
    if any(c != 0 for c in codes):
        # A runner that did not exit 0 on SIGTERM: say which, with the end of its log (the folder is kept).
        for index, code in enumerate(codes):
            if code != 0:
                with open(os.path.join(root, "runner-%d.log" % index), errors="replace") as f:
                    tail = f.read()[-3000:]
                print("  runner %d exited %s; the end of its log:\n%s" % (index, code, tail), flush=True)
        print("  runner logs and clusters kept in %s" % root, flush=True)
    elif not missing:
        shutil.rmtree(root, ignore_errors=True)
    fhir.kill()


def exhaustion(work):
    print("resource exhaustion: file-size limit during enqueue", flush=True)
    if SANITIZER == "thread":
        print("  not under ThreadSanitizer (its runtime dies under RLIMIT_FSIZE)", flush=True)
        return
    env = env_for(work, "http://127.0.0.1:9/fhir", "full.sqlite", idempotent=False)
    small = os.path.join(work, "small.json")
    with open(small, "w") as f:
        f.write(observation("urn:torture:full", "first"))
    assert dq(["enqueue", small], env).returncode == 0
    db = os.path.join(work, "full.sqlite")
    before = sqlite3.connect(db).execute("SELECT count(*) FROM item").fetchone()[0]
    big = os.path.join(work, "big.ndjson")
    with open(big, "w") as f:
        for i in range(3000):
            f.write(json.dumps({"resourceType": "Observation", "status": "final", "code": {"text": "x" * 1500},
                                "identifier": [{"system": "urn:torture:full", "value": str(i)}]}) + "\n")
    limit = os.path.getsize(db) + 256 * 1024

    def cap():
        rlimit.setrlimit(rlimit.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run([DQ, "enqueue", "--ndjson", big], env=env, capture_output=True, text=True, preexec_fn=cap,
                            timeout=120)
    clear = result.returncode == 74 and "nothing was written" in result.stderr
    after = sqlite3.connect(db).execute("SELECT count(*) FROM item").fetchone()[0]
    again = dq(["enqueue", "--ndjson", big], env)
    final = sqlite3.connect(db).execute("SELECT count(*) FROM item").fetchone()[0]
    ok = clear and after == before and again.returncode == 0 and final == before + 3000 and integrity(db)
    TABLE.append(("disk/file-size limit during enqueue", 1, 0, 1, 3001, final, 0 if final == 3001 else 3001 - final, 0, 0,
                  "exit %d %r; unchanged: %s; works after: %s" % (result.returncode, result.stderr.strip()[:60],
                                                                   after == before, again.returncode == 0)))
    if not ok:
        FAILURES.append("exhaustion")
    print("  exhaustion: %s" % ("ok" if ok else "FAILED"), flush=True)


def bad_inputs(work, rng, count, fuzz_seconds):
    print("bad input: %d malformed inputs, corrupt envelopes, %ds of fuzzing" % (count, fuzz_seconds), flush=True)
    env = env_for(work, "http://127.0.0.1:9/fhir", "bad.sqlite", idempotent=False)
    good = os.path.join(work, "good.json")
    with open(good, "w") as f:
        f.write(observation("urn:torture:bad", "kept"))
    assert dq(["enqueue", good], env).returncode == 0
    db = os.path.join(work, "bad.sqlite")
    snapshot = lambda: sqlite3.connect(db).execute("SELECT group_concat(uuid) FROM item").fetchone()[0]
    before = snapshot()
    valid = observation("urn:torture:bad", "x").encode()
    generators = [
        lambda: valid[: rng.randrange(1, len(valid) - 1)],                              # truncated
        lambda: b'{"resourceType":"Patient","a":' + b"[" * 200000 + b"]" * 200000 + b"}",  # deeply nested
        lambda: b'{"resourceType":"Patient","n":1' + b"0" * 100000 + b"}",               # huge number
        lambda: b'{"resourceType":"Patient","n":1e999999}',
        lambda: valid.replace(b"torture", bytes([0xC3, 0x28])),                         # invalid UTF-8
        lambda: b'{"resourceType":%d}' % rng.randrange(1000),                           # wrong type
        lambda: b'{"resourceType":["Patient"]}',
        lambda: bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))),        # binary
        lambda: b"[" + valid + b"]",
        lambda: b"\xef\xbb\xbf" + b'{"resourceType":"Pat ient"}',
        lambda: b'{"resourceType":"Patient","id":"' + b"a" * 100 + b'"}',
        lambda: b"",
    ]
    crashes = hangs = wrong = 0
    notes = []  # what went wrong, to find its cause: the input kind, the exit status, the end of stderr
    for i in range(count):
        data = generators[i % len(generators)]()
        path = os.path.join(work, "bad-%d.json" % i)
        with open(path, "wb") as f:
            f.write(data)
        try:
            result = dq(["enqueue", path], env, timeout=20)
        except subprocess.TimeoutExpired:
            hangs += 1
            continue
        if result.returncode < 0:
            crashes += 1
            notes.append("enqueue of input kind %d (%s): signal %d: %s" % (
                i % len(generators), path, -result.returncode, result.stderr[-300:].strip()))
        elif result.returncode != 65 or "bad-%d.json:" % i not in result.stderr:
            wrong += 1
            notes.append("enqueue of input kind %d (%s): exit %d: %s" % (
                i % len(generators), path, result.returncode, result.stderr[-300:].strip()))
    # Corrupt envelopes for dq decrypt.
    key = os.path.join(work, "k.pem")
    subprocess.run(["openssl", "genrsa", "-out", key, "2048"], capture_output=True, check=True)
    envelopes = [b"", b"{}", b"[]", b'{"key_id":"k","symmetric_key":"AAAA","message":"AAAA","version":"1"}',
                 b'{"key_id":"k","symmetric_key":"!!","message":"","version":"1"}', b"\x00\x01\x02",
                 b'{"key_id":1,"symmetric_key":"","message":"","version":""}',
                 b'{"key_id":"k","symmetric_key":"","message":"","version":"","alg":"none"}']
    for i, data in enumerate(envelopes):
        path = os.path.join(work, "env-%d.json" % i)
        with open(path, "wb") as f:
            f.write(data)
        result = dq(["decrypt", "--key", key, path], env, timeout=20)
        if result.returncode < 0:
            crashes += 1
            notes.append("decrypt of envelope %d: signal %d: %s" % (i, -result.returncode, result.stderr[-300:].strip()))
        elif result.returncode != 65:
            wrong += 1
            notes.append("decrypt of envelope %d: exit %d: %s" % (i, result.returncode, result.stderr[-300:].strip()))
    fuzz_runs = fuzz_crashes = 0
    if os.path.exists(BENCH) and fuzz_seconds > 0:
        fuzz = subprocess.run([BENCH, "fuzz", str(rng.randrange(1 << 30)), str(fuzz_seconds), key], capture_output=True,
                              text=True, timeout=fuzz_seconds + 60)
        if fuzz.returncode != 0:
            fuzz_crashes = 1
            notes.append("fuzz: exit %d: %s" % (fuzz.returncode, (fuzz.stdout + fuzz.stderr)[-600:].strip()))
        else:
            fuzz_runs = json.loads(fuzz.stdout.strip().splitlines()[-1])["count"]
    unchanged = snapshot() == before
    ok = crashes == 0 and hangs == 0 and wrong == 0 and unchanged and fuzz_crashes == 0
    TABLE.append(("bad input (%d files, %d envelopes, fuzz)" % (count, len(envelopes)), count + len(envelopes) + fuzz_runs,
                  0, 0, 1, 1, 0 if unchanged else 1, 0, 0,
                  "crashes %d, hangs %d, wrong exit %d, fuzz inputs %d" % (crashes + fuzz_crashes, hangs, wrong, fuzz_runs)))
    if not ok:
        FAILURES.append("bad input")
    for note in notes:
        print("    " + note, flush=True)
    print("  bad input: %s" % ("ok" if ok else "FAILED"), flush=True)


def security(work):
    print("security: file modes, TLS verification", flush=True)
    problems = []
    for name in os.listdir(work):
        if name.endswith((".sqlite", ".sqlite-wal", ".sqlite-shm", ".lock")):
            mode = os.stat(os.path.join(work, name)).st_mode & 0o777
            if mode != 0o600:
                problems.append("%s is %o" % (name, mode))
    # TLS: a self-signed server is refused (no way to turn verification off), accepted with its CA as ca_bundle.
    cert, key = os.path.join(work, "tls.crt"), os.path.join(work, "tls.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"], capture_output=True, check=True)
    fhir = FHIR(work)
    port = free_port()
    spawn([sys.executable, os.path.join(ROOT, "scripts", "faultproxy.py"), "--listen", str(port), "--upstream",
           "http://127.0.0.1:%d" % fhir.port, "--tls-cert", cert, "--tls-key", key],
          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    env = env_for(work, "https://127.0.0.1:%d/fhir" % port, "tls.sqlite", idempotent=False)
    sample = os.path.join(work, "tls.json")
    with open(sample, "w") as f:
        f.write(observation("urn:torture:tls", "1"))
    refused = dq(["send", sample], env)
    if refused.returncode != 75:
        problems.append("self-signed TLS was not refused (exit %d)" % refused.returncode)
    env["DQ_CA_BUNDLE"] = cert
    accepted = dq(["flush", "--now"], env)
    if accepted.returncode != 0:
        problems.append("TLS with ca_bundle failed: %s" % accepted.stderr[-200:])
    fhir.kill()
    TABLE.append(("security (0600 files, TLS verify)", 1, 0, 0, 1, 1 if accepted.returncode == 0 else 0, 0, 0, 0,
                  "; ".join(problems) or "all files 0600; self-signed refused; ca_bundle accepted"))
    if problems:
        FAILURES.append("security")
    print("  security: %s" % ("ok" if not problems else "FAILED: " + "; ".join(problems)), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", type=lambda text: text.split(","), default=[],
                        help="comma-separated runs: crash, held, network, concurrency, daemon, writes, token, shared, failover, "
                             "exhaustion, bad-input, security, serve, serve-shared")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="dq-torture-")
    started = time.time()
    print("torture: seed %d, %s" % (args.seed, "quick" if args.quick else "full"), flush=True)
    try:
        # Every promise holds with and without Bundles.
        runs = [
            ("crash", lambda: [crash_loop(work, 25 if args.quick else 200, rng, batch) for batch in (1, 8)]
             + [crash_loop(work, 25 if args.quick else 200, rng, 8, at_rest=True)]),
            ("held", lambda: held_answers(work, 4 if args.quick else 12, rng)),
            ("network", lambda: [network_faults(work, 150 if args.quick else 1000, rng, args.seed, batch) for batch in (1, 25)]),
            ("concurrency", lambda: concurrency(work, 3, 40 if args.quick else 300, rng)),
            ("daemon", lambda: daemon_faults(work, rng, 30 if args.quick else 200)),
            ("writes", lambda: write_faults(work, rng, args.quick)),
            ("token", lambda: refused_token(work, rng, args.quick)),
            ("shared", lambda: shared_queue(work, rng, 30 if args.quick else 200, 4 if args.quick else 12)),
            ("failover", lambda: shared_queue(work, rng, 30 if args.quick else 200, 4 if args.quick else 12, failover=True)),
            ("exhaustion", lambda: exhaustion(work)),
            ("bad-input", lambda: bad_inputs(work, rng, 60 if args.quick else 600, 5 if args.quick else 60)),
            ("security", lambda: security(work)),
            ("serve", lambda: serve_crash(work, 10 if args.quick else 60, rng)),
            ("serve-shared", lambda: serve_shared(work, 60 if args.quick else 400, rng)),
        ]
        unknown = set(args.only) - {name for name, _ in runs}
        if unknown:
            parser.error("unknown run(s) %s; the runs are %s" % (", ".join(sorted(unknown)), ", ".join(n for n, _ in runs)))
        for name, body in runs:
            if not args.only or name in args.only:
                body()
    finally:
        stop_all()
        if not os.environ.get("TORTURE_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
        else:
            print("torture: kept " + work)
    header = "| run | runs | kills | faults | enqueued | delivered | lost | duplicated | out of order | notes |"
    lines = ["", "Torture (seed %d, %s, %.0f s):" % (args.seed, "quick" if args.quick else "full", time.time() - started), "",
             header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in TABLE:
        lines.append("| %s | %d | %d | %d | %d | %d | %d | %d | %d | %s |" % r)
    print("\n".join(lines))
    if args.out:
        # The text above the last run's table (what each run proves) is kept; only the table is replaced.
        kept = ""
        if os.path.exists(args.out):
            with open(args.out) as f:
                text = f.read()
            at = text.find("\nTorture (seed")
            kept = text[:at + 1] if at >= 0 else ""
        with open(args.out, "w") as f:
            f.write(kept + "\n".join(lines).strip() + "\n")
    print("torture: %d passed, %d failed" % (len(TABLE) - len(FAILURES), len(FAILURES)))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        stop_all()
