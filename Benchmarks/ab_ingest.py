#!/usr/bin/env python3
"""Case 14a for two dq builds in one run, in turns: durable ingest of 2 KiB envelopes from 64 keep-alive connections
and the same process answering GET /healthz, A then B in each round. A change to dq serve's ingest is judged by the
ratio B/A of each round's pair, not against a figure from another day (run-to-run spread on this machine is larger
than the differences looked for).

    python3 Benchmarks/ab_ingest.py --a /path/to/before/dq --b .build/release/dq --rounds 5

A build that does not know a setting run.py gives (the per-client limits, added later) is started without it.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as bench  # noqa: E402


def cpu_seconds(pid):
    """The user and system CPU time a process has used so far, in seconds (/proc/PID/stat)."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _strings_contain(path, needle):
    with open(path, "rb") as f:
        return needle in f.read()


class Rig(bench.ServeBench):
    """ServeBench for one build: its own dq, and the per-client limits only where the build knows them."""

    def __init__(self, args, work, dq, limits):
        self.limits = limits
        shared = argparse.Namespace(**vars(args))
        shared.dq = dq
        super().__init__(shared, work)

    def start(self, server, database, port, batch=None, extra_env=None, edge=None):
        config = os.path.join(self.work, "serve-%f.json" % time.time())
        serve = {"antispam_file": self.antispam, "keys_dir": self.keys, "default_key_id": "k1", "plain_fhir": False,
                 "auth_requests_per_minute": 1000000}
        if self.limits:
            serve.update({"max_waiting_per_client": 100000000, "max_waiting_bytes_per_client": 1 << 50,
                          "max_connections_per_address": 1024})
        with open(config, "w") as f:
            json.dump({"server": server, "serve": serve}, f)
        env = dict(bench.dq_env(self.work, server), DQ_DATABASE=database)
        log = open(os.path.join(self.work, "serve.log"), "ab")
        process = subprocess.Popen([self.args.dq, "serve", "--config", config, "--listen", "127.0.0.1:%d" % port,
                                    "--poll-interval", "0.1"], env=env, stdout=log, stderr=log)
        bench.wait_url("http://127.0.0.1:%d/healthz" % port)
        return process


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True, help="the reference dq build (before)")
    parser.add_argument("--b", default=os.path.join(bench.ROOT, ".build", "release", "dq"), help="the build judged")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=int, default=10)
    args = parser.parse_args()
    args.quick = False
    work = tempfile.mkdtemp(prefix="dq-ab-")
    try:
        rigs = {}
        for name, dq in (("A", args.a), ("B", args.b)):
            rig = Rig(args, os.path.join(work, name), dq, _strings_contain(dq, b"max_waiting_per_client"))
            os.makedirs(rig.work, exist_ok=True)
            rigs[name] = rig
        # One envelope, sealed for A's key; B's rig gets the same key so both open nothing and store the same bytes.
        shutil.copy(rigs["A"].key, rigs["B"].key)
        one, _ = rigs["A"].envelopes("ab-one", 1)
        body = os.path.join(work, "envelope.json")
        with open(one) as f, open(body, "w") as out:
            out.write(f.readline().rstrip("\n"))
        down = "http://127.0.0.1:%d/fhir" % bench.free_port()
        results = {"A": [], "B": []}
        for round_index in range(args.rounds):
            order = ("A", "B") if round_index % 2 == 0 else ("B", "A")
            for name in order:
                rig = rigs[name]
                port = bench.free_port()
                process = rig.start(down, os.path.join(rig.work, "ingest-%f.sqlite" % time.time()), port)
                try:
                    token = rig.token(port)
                    before = cpu_seconds(process.pid)
                    ingest = bench.wrk_run(args, rig.work, port, body, token, args.seconds)
                    # CPU per request: steadier than the rate on a shared machine, where the disk's fsyncs and
                    # wrk's own threads move the rate by 15-25% between runs of one build.
                    ingest["cpu_us"] = (cpu_seconds(process.pid) - before) / ingest["requests"] * 1e6
                    health = bench.wrk_run(args, rig.work, port, None, None, args.seconds, path="/healthz")
                finally:
                    bench.stop(process)
                results[name].append((ingest["per_second"], health["per_second"], ingest["p50_ms"], ingest["p99_ms"],
                                      ingest["cpu_us"]))
                print("round %d %s: ingest %.0f/s (p50 %.1f ms, p99 %.1f ms, %.1f us CPU per request), /healthz %.0f/s"
                      % (round_index + 1, name, ingest["per_second"], ingest["p50_ms"], ingest["p99_ms"], ingest["cpu_us"],
                         health["per_second"]), flush=True)
        ratios = [b[0] / a[0] for a, b in zip(results["A"], results["B"])]
        health = [b[1] / a[1] for a, b in zip(results["A"], results["B"])]
        print("ingest B/A per round: %s, median %.3f" % (" ".join("%.3f" % r for r in ratios), statistics.median(ratios)))
        cpu = [b[4] / a[4] for a, b in zip(results["A"], results["B"])]
        print("ingest CPU per request B/A per round: %s, median %.3f" % (" ".join("%.3f" % r for r in cpu),
                                                                         statistics.median(cpu)))
        print("/healthz B/A per round: %s, median %.3f" % (" ".join("%.3f" % r for r in health), statistics.median(health)))
        for name in ("A", "B"):
            rows = results[name]
            print("%s median: ingest %.0f/s (%.1f us CPU per request), /healthz %.0f/s, ingest/healthz %.3f" % (
                name, statistics.median(r[0] for r in rows), statistics.median(r[4] for r in rows),
                statistics.median(r[1] for r in rows), statistics.median(r[0] / r[1] for r in rows)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
