#!/usr/bin/env python3
"""Turns the raw data of one bench/run (its work directory) into the Markdown summary.

Usage: python3 bench/summarize.py WORK_DIR > RESULTS.md
Reads meta.txt, throughput.tsv, fixed.tsv, memory.tsv and profile/ from WORK_DIR.
"""

import csv
import os
import sys

from workdir import med, read_meta, read_tsv

WORK = sys.argv[1]
TARGETS = [
    "direct",
    "direct-halt",
    "nginx",
    "haproxy",
    "hyper-floor",
    "fg-memory",
    "fg-embedded",
    "fg-redis",
    "fg-postgres",
    "fg-etcd",
    "fg2-memory",
    "fg2-embedded",
    "fg2-redis",
    "fg2-postgres",
    "fg2-etcd",
]
# The shared stores, each with the name of its server.
SHARED = {
    "fg-redis": "redis-server",
    "fg2-redis": "redis-server",
    "fg-postgres": "PostgreSQL",
    "fg2-postgres": "PostgreSQL",
    "fg-etcd": "etcd",
    "fg2-etcd": "etcd",
}
NAMES = {
    "direct": "direct (no proxy)",
    "direct-halt": "direct, cores left to halt (the embedded store's reference)",
    "nginx": "nginx",
    "haproxy": "haproxy",
    "hyper-floor": "hyper-floor (hyper, forwarding only)",
    "fg-memory": "fencegate, memory store",
    "fg-embedded": "fencegate, embedded store",
    "fg-redis": "fencegate, redis store",
    "fg-postgres": "fencegate, postgres store",
    "fg-etcd": "fencegate, etcd store",
    "fg2-memory": "fencegate (--compare binary), memory store",
    "fg2-embedded": "fencegate (--compare binary), embedded store",
    "fg2-redis": "fencegate (--compare binary), redis store",
    "fg2-postgres": "fencegate (--compare binary), postgres store",
    "fg2-etcd": "fencegate (--compare binary), etcd store",
}
WORKLOADS = {
    "get": "GET pass-through (unmatched path, forwarded unfenced)",
    "put": "fenced PUT, 10,000 resources, rising tokens (every write an admitted raise)",
}


def fmt(v, digits=0, suffix=""):
    if v is None:
        return "-"
    return f"{v:,.{digits}f}{suffix}"


meta = read_meta(WORK)
clk = float(meta.get("clk_tck", "100"))
out = []
p = out.append

p("# fencegate benchmark results")
p("")
p("Question: is fencegate, doing the fence check, cheaper than nginx doing plain proxying?")
p("")
p("Command (from the repository root):")
p("")
p("```console")
p(f"$ {meta.get('command', 'bench/run')}")
p("```")
p("")
p(
    f"Run {meta.get('date')} on {meta.get('host_cpus')} cores ({meta.get('cpu_model')}), "
    f"kernel {meta.get('kernel')}; fencegate {meta.get('fencegate')}, nginx {meta.get('nginx')}, "
    f"haproxy {meta.get('haproxy')}, wrk {meta.get('wrk')}, rustc {meta.get('rustc')}. "
    f"Total time {meta.get('elapsed', '?')} s."
    + (
        f" `fencegate` is {meta.get('fencegate_bin')}; `--compare binary` is {meta.get('compare_bin')}."
        if meta.get("compare_bin")
        else ""
    )
)
p("")
p("Setup, all on loopback:")
p("")
p(
    f"- Upstream: nginx (1 worker) answering `200 ok` to every method and path, on core "
    f"{meta.get('upstream_core')}. It is a fixed, cheap cost that every target pays equally."
)
p(
    f"- Load generators (wrk `-t1 -c{meta.get('connections')}`, and bench/fixed_rate.rs) on core "
    f"{meta.get('loadgen_core')}; the proxy under test on core {meta.get('proxy_core')}"
    + (
        ", sharing it with the upstream (as a sidecar shares its pod's CPU with the app), so "
        "req/s is set by proxy cost + the same upstream cost. Sharing also means the upstream, "
        "when woken by the proxy's write, preempts the proxy: `ctx switches/req` shows how often."
        if meta.get("upstream_core") == meta.get("proxy_core")
        else "; the upstream shares the load generator's core."
    )
    + " Servers and generators run at nice -15 (the machine is shared with other jobs)."
)
p(
    "- nginx: 1 worker, keep-alive pool to the upstream, `proxy_http_version 1.1`, access log "
    "off, sets X-Forwarded-For/Proto/Host like fencegate. haproxy: `nbthread 1`, http mode, "
    "keep-alive, `http-reuse always`, `option forwardfor`. hyper-floor (bench/hyper-floor): "
    "the least a proxy built on hyper can do, on hyper's HTTP/1 server and client with "
    "fencegate's flat-buffer writes, its runtime and allocator: one upstream connection per client connection, every request and "
    "response passed on as it came (no route, token, header rewriting, timer, metric or log), "
    "so it marks what hyper itself costs. fencegate: `taskset` to the proxy core, "
    "where it runs its single-thread runtime (one usable CPU); route `/accounts/{id}` -> "
    "`account:{id}`, `unmatched: forward`, `token.equal: allow`, log level warn. Embedded store: "
    "a fresh temp directory (disk, fsync on) per run. "
    f"fdatasync of one 4 KiB page on that filesystem: {meta.get('fsync_before', '?')} before the "
    f"runs, {meta.get('fsync_after', '?')} after (it varies a lot on this shared disk; every "
    "admitted raise with the embedded store waits for one group commit)."
)
if meta.get("store_prefix"):
    servers = []
    if meta.get("redis"):
        servers.append(
            f"`kind: redis`: a redis-server {meta['redis']} started for the run in its work directory, "
            "durable (`--appendonly yes --appendfsync always`, `--save \"\"`: every write fsync'd to the "
            "append-only file before the reply)"
        )
    if meta.get("postgres"):
        servers.append(
            f"`kind: postgres`: the machine's PostgreSQL {meta['postgres']} "
            f"({meta.get('postgres_settings', '')})"
            + (
                ", its postmaster and backends moved to that core and nice level for the run"
                if meta.get("postgres_pinned") == "1"
                else ", left where it ran (it could not be moved to that core)"
            )
        )
    if meta.get("etcd"):
        servers.append(f"`kind: etcd`: a one-member etcd {meta['etcd']} started for the run in its work directory")
    p(
        f"- Shared stores (fenced PUT only: a GET on an unmatched path never reaches the store): "
        + "; ".join(servers)
        + f". Store prefix `{meta.get('store_prefix')}`, kept across the target's restarts (the "
        f"PUT tokens, the clock in microseconds, keep rising). Each server runs on core "
        f"{meta.get('store_core')}, with the load generators: in production it is another "
        "machine, and on 2 cores it cannot have its own. `store CPU us/req` is the server's "
        "utime+stime (with its children, and those that ended) over the run, divided by the "
        "requests; PostgreSQL's includes its background processes and any other session on "
        "this shared machine. Their fixed-rate runs leave the cores to halt, as the embedded "
        "store's do: every admitted raise waits for the server's sync on the same disk."
    )
p(
    f"- Throughput: {meta.get('rounds')} rounds x targets x workloads, target order rotated each "
    f"round, every target restarted per run; {meta.get('warmup')} s warm-up then "
    f"{meta.get('duration')} s measured. Numbers are the median over rounds (req/s shows the "
    "min-max too). CPU us/req is the proxy process's utime+stime from /proc/<pid>/stat "
    "(all threads; nginx master+worker) over the measured run, divided by the requests wrk "
    "completed; `best round` is its lowest value (the least disturbed round). `core busy` is "
    "the share of the proxy core in use (from /proc/stat), `unattributed` the part of it not "
    "charged to the proxy or the upstream (other jobs on this shared machine, or kernel network "
    "work that ran on an otherwise idle core), and `steal` what the hypervisor took from it."
)
p("")

# ---------------------------------------------------------------- throughput
rows = read_tsv(WORK, "throughput.tsv")
summary = {}


def store_cpu(target, rs, requests):
    """The median over runs of the shared store server's CPU us per request; None for a target
    without one, or a server whose CPU was not measured (a PostgreSQL not on this machine)."""
    if target not in SHARED or (target.endswith("-postgres") and meta.get("postgres_measured") == "0"):
        return None
    return med(
        [
            float(r.get("store_ticks") or 0) / clk * 1e6 / float(r[requests])
            for r in rs
            if r.get(requests) and float(r[requests]) > 0
        ]
    )


for workload in WORKLOADS:
    for target in TARGETS:
        rs = [r for r in rows if r["workload"] == workload and r["target"] == target]
        if not rs:
            continue
        rps = [float(r["rps"]) for r in rs]
        cpu = [
            float(r["proxy_ticks"]) / clk * 1e6 / float(r["requests"])
            for r in rs
            if target != "direct" and float(r["requests"]) > 0
        ]
        up = [
            float(r["upstream_ticks"]) / clk * 1e6 / float(r["requests"])
            for r in rs
            if float(r["requests"]) > 0
        ]
        summary[(workload, target)] = {
            "rps": med(rps),
            "rps_min": min(rps),
            "rps_max": max(rps),
            "p50": med([float(r["p50_us"]) for r in rs]),
            "p99": med([float(r["p99_us"]) for r in rs]),
            "cpu": med(cpu) if cpu else None,
            "cpu_best": min(cpu) if cpu else None,
            "up": med(up),
            "busy": med([float(r["core1_busy"]) for r in rs]),
            "steal": med([float(r["core1_steal"]) for r in rs]),
            "other": med([float(r.get("core1_other", 0) or 0) for r in rs]),
            "gen": med([float(r["core0_busy"]) for r in rs]),
            "non2xx": sum(int(r["status_errors"]) for r in rs),
            "sockerr": sum(int(r["socket_errors"]) for r in rs),
            "cs": med([(float(r.get("proxy_vcs", 0) or 0) + float(r.get("proxy_ivcs", 0) or 0)) / float(r["requests"]) for r in rs]) if target != "direct" else None,
            "ics": med([float(r.get("proxy_ivcs", 0) or 0) / float(r["requests"]) for r in rs]) if target != "direct" else None,
            "rss": med([float(r["proxy_rss_kb"]) / 1024 for r in rs]) if target != "direct" else None,
            "n": len(rs),
            "store": store_cpu(target, rs, "requests"),
        }

verdict_at = len(out)
if rows:
    p("## Throughput (wrk, closed loop)")
    p("")
    for workload, title in WORKLOADS.items():
        if not any(k[0] == workload for k in summary):
            continue
        p(f"### {title}")
        p("")
        # A column for the shared stores' servers, when one of them ran this workload.
        with_store = any((workload, t) in summary for t in SHARED)
        p(
            "| target | req/s (median) | min-max | p50 | p99 | proxy CPU us/req (median) | best round | "
            + ("store CPU us/req | " if with_store else "")
            + "x direct | x nginx | ctx switches/req (involuntary) | core busy | unattributed | steal | non-2xx | RSS MB |"
        )
        p("|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if with_store else "") + "---:|---:|---:|---:|---:|---:|---:|---:|")
        direct = summary.get((workload, "direct"), {}).get("rps")
        nginx = summary.get((workload, "nginx"), {})
        for target in TARGETS:
            s = summary.get((workload, target))
            if not s:
                continue
            xd = fmt(s["rps"] / direct, 2) if direct else "-"
            xn = fmt(s["rps"] / nginx["rps"], 2) if nginx.get("rps") else "-"
            cpu = fmt(s["cpu"], 1)
            if s["cpu"] is not None and nginx.get("cpu"):
                cpu += f" ({s['cpu'] / nginx['cpu']:.2f}x nginx)"
            errs = str(s["non2xx"]) + (f" (+{s['sockerr']} socket errors)" if s["sockerr"] else "")
            store = f"{fmt(s['store'], 1)} | " if with_store else ""
            p(
                f"| {NAMES[target]} | {fmt(s['rps'])} | {fmt(s['rps_min'])}-{fmt(s['rps_max'])} | "
                f"{fmt(s['p50'])} us | {fmt(s['p99'])} us | {cpu} | {fmt(s['cpu_best'], 1)} | {store}{xd} | {xn} | "
                f"{fmt(s['cs'], 2)} ({fmt(s['ics'], 2)}) | "
                f"{fmt(s['busy'] * 100)}% | {fmt(s['other'] * 100)}% | {fmt(s['steal'] * 100, 1)}% | {errs} | {fmt(s['rss'], 1)} |"
            )
        p("")
        up = [summary[(workload, t)]["up"] for t in TARGETS if (workload, t) in summary]
        p(
            f"Upstream nginx CPU: {fmt(med(up), 1)} us/req (median over targets); load-generator "
            f"core busy {fmt(med([summary[(workload, t)]['gen'] for t in TARGETS if (workload, t) in summary]) * 100)}%."
        )
        p("")

# ---------------------------------------------------------------- fixed rate
fixed = read_tsv(WORK, "fixed.tsv")
fsum = {}


def fixed_reference(workload, target):
    """The direct run a target's added latency is measured against: the one run the same way
    (with the idle-priority busy loops or without)."""
    if target.startswith("direct"):
        return fsum.get((workload, target))
    halt = fsum.get((workload, "direct-halt"))
    if halt and not fsum[(workload, target)]["spun"]:
        return halt
    return fsum.get((workload, "direct"))


if fixed:
    spun = any(r.get("idle_spin") == "1" for r in fixed)
    not_spun = spun and any(r.get("idle_spin") == "0" for r in fixed)
    halted_targets = {r["target"] for r in fixed if r.get("idle_spin") == "0"}
    halted = " and ".join(
        kind
        for kind, ran in (
            ("embedded-store", any(t.endswith("embedded") for t in halted_targets)),
            ("shared-store", any(t in SHARED for t in halted_targets)),
        )
        if ran
    )
    p(f"## Fixed-rate latency ({meta.get('fixed_rate')} req/s, open loop)")
    p("")
    p(
        f"bench/fixed_rate.rs: {meta.get('fixed_connections')} keep-alive connections, request i "
        f"due at start + i/rate, {meta.get('fixed_rounds')} rounds x {meta.get('fixed_duration')} s "
        "per target (after 1 s warm-up), target order rotated; medians over rounds. Latency is "
        "coordinated-omission free (timed from the due time when the connection was still busy, "
        "else from the write). `added` = target minus direct. `proxy CPU us/req` is measured over "
        "the whole fixed-rate run (warm-up included): the cost per request of a proxy that is "
        "mostly idle, as a sidecar usually is. "
        + (
            "Each core ran an idle-priority busy loop (SCHED_IDLE) during these runs, so no "
            "virtual CPU halted between requests: the hypervisor's wake-ups, which otherwise move "
            "a target's p50 by tens of us from one round to the next, are not in these figures. "
            + (
                f"The {halted} targets ran without the loops (their raises wait for the disk, "
                "which this VM emulates in a host thread that the loops slowed), so their figures "
                "include those wake-ups"
                + (
                    ", and their `added` is against a direct run made the same way (`direct, "
                    "cores left to halt`). "
                    if "direct-halt" in halted_targets
                    else ". "
                )
                if not_spun
                else ""
            )
            if spun
            else "The cores were left to halt between requests (--no-idle-spin): every figure "
            "includes the hypervisor's wake-ups of idle virtual CPUs, which move a target's p50 by "
            "tens of us from one round to the next. "
        )
        + "On this shared machine the p99 and p99.9 of a short run are set by scheduling noise "
        "(other jobs, timer wake-ups) and swing from round to round, even for direct; the p50 is "
        "the stable figure."
    )
    p("")
    for workload, title in WORKLOADS.items():
        for target in TARGETS:
            rs = [r for r in fixed if r["workload"] == workload and r["target"] == target]
            if not rs:
                continue
            fsum[(workload, target)] = {
                "spun": any(r.get("idle_spin") == "1" for r in rs),
                "p50": med([float(r["p50_us"]) for r in rs]),
                "p50_lo": min(float(r["p50_us"]) for r in rs),
                "p50_hi": max(float(r["p50_us"]) for r in rs),
                "p90": med([float(r["p90_us"]) for r in rs]),
                "p99": med([float(r["p99_us"]) for r in rs]),
                "p999": med([float(r["p999_us"]) for r in rs]),
                "rate": med([float(r["rate"]) for r in rs]),
                "late": sum(int(r["late"]) for r in rs),
                "sent": sum(int(r["sent"]) for r in rs),
                "bad": sum(int(r["non2xx"]) + int(r["errors"]) for r in rs),
                "cpu": med(
                    [
                        float(r["proxy_ticks"]) / clk * 1e6 / float(r["total"])
                        for r in rs
                        if r.get("total") and float(r["total"]) > 0
                    ]
                )
                if not target.startswith("direct")
                else None,
                "store": store_cpu(target, rs, "total"),
            }
        if not any(k[0] == workload for k in fsum):
            continue
        p(f"### {title}")
        p("")
        with_store = any((workload, t) in fsum for t in SHARED)
        p(
            "| target | achieved req/s | p50 | p50 min-max | p90 | p99 | p99.9 | added p50 | added p99 | proxy CPU us/req | "
            + ("store CPU us/req | " if with_store else "")
            + "late | non-2xx+errors |"
        )
        p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if with_store else "") + "---:|---:|")
        for target in TARGETS:
            s = fsum.get((workload, target))
            if not s:
                continue
            d = fixed_reference(workload, target)
            a50 = fmt(s["p50"] - d["p50"], 0, " us") if d else "-"
            a99 = fmt(s["p99"] - d["p99"], 0, " us") if d else "-"
            p(
                f"| {NAMES[target]} | {fmt(s['rate'])} | {fmt(s['p50'])} us | {fmt(s['p50_lo'])}-{fmt(s['p50_hi'])} us | {fmt(s['p90'])} us | "
                f"{fmt(s['p99'])} us | {fmt(s['p999'])} us | {a50} | {a99} | {fmt(s['cpu'], 1)} | "
                + (f"{fmt(s['store'], 1)} | " if with_store else "")
                + f"{s['late']}/{s['sent']} | {s['bad']} |"
            )
        p("")

# ---------------------------------------------------------------- shared stores
shared = [t for t in SHARED if ("put", t) in summary or ("put", t) in fsum]
if shared:
    p("## Shared stores: the fenced PUT against nginx's plain PUT and the memory store")
    p("")
    ng = summary.get(("put", "nginx"), {})
    mem = summary.get(("put", "fg-memory"), {})
    fng = fsum.get(("put", "nginx"))
    fmem = fsum.get(("put", "fg-memory"))

    def ratio(a, b):
        return f"{a / b:.2f}x" if a is not None and b else "-"

    for target in shared:
        s = summary.get(("put", target))
        parts = []
        if s:
            parts.append(
                f"{s['rps']:,.0f} req/s, {ratio(s['rps'], ng.get('rps'))} nginx's plain PUT and "
                f"{ratio(s['rps'], mem.get('rps'))} the memory store's"
            )
            parts.append(
                f"fencegate uses {ratio(s['cpu'], ng.get('cpu'))} nginx's CPU per request and "
                f"{ratio(s['cpu'], mem.get('cpu'))} the memory store's (median {fmt(s['cpu'], 1)} vs "
                f"{fmt(ng.get('cpu'), 1)} and {fmt(mem.get('cpu'), 1)} us)"
            )
            if s["store"] is not None:
                both = s["cpu"] + s["store"]
                parts.append(
                    f"{SHARED[target]} {s['store']:.1f} us more per request (fencegate and its store "
                    f"together {both:.1f} us, {ratio(both, ng.get('cpu'))} nginx's, "
                    f"{ratio(both, mem.get('cpu'))} the memory store's)"
                )
            parts.append(
                f"core {meta.get('loadgen_core')} (load generator and store) {s['gen'] * 100:.0f}% busy, "
                f"core {meta.get('proxy_core')} (fencegate and upstream) {s['busy'] * 100:.0f}%"
            )
        f = fsum.get(("put", target))
        if f:
            refs = [
                f"{name} {r['p50']:,.0f} / {r['p99']:,.0f}"
                for name, r in (("nginx", fng), ("memory store", fmem))
                if r
            ]
            parts.append(
                f"at {meta.get('fixed_rate')} req/s, p50 / p99 {f['p50']:,.0f} / {f['p99']:,.0f} us"
                + (f" ({', '.join(refs)})" if refs else "")
            )
        p(f"- Fenced PUT, {NAMES[target]}: " + "; ".join(parts) + ".")
    p("")

# ---------------------------------------------------------------- memory
mem = read_tsv(WORK, "memory.tsv")
msum = {}
if mem:
    p("## Memory")
    p("")
    p(
        "wrk (`-c64`, bench/fill.lua) sends one fenced PUT per resource `/accounts/0..N-1` "
        "(token 1) through a fresh fencegate; VmRSS from /proc/<pid>/status before (after one "
        "request) and 1 s after the last response. `resources` is "
        "`fencegate_fencing_token_increments_total` (one per first sight)."
    )
    p("")
    p("| store | resources | fill time | fill req/s | non-2xx | RSS before | RSS after | peak (VmHWM) | bytes/resource | db file |")
    p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in mem:
        n = int(r["increments"]) or int(r["resources"])
        before = float(r["rss_start_kb"]) / 1024
        after = float(r["rss_kb"]) / 1024
        msum[r["target"]] = {"after": after, "n": n}
        per = (float(r["rss_kb"]) - float(r["rss_start_kb"])) * 1024 / n if n else 0
        db = float(r["db_bytes"]) / 1024 / 1024
        p(
            f"| {NAMES[r['target']]} | {n:,} | {r['seconds']} s | {fmt(float(r['rps']))} | {r['status_errors']} | "
            f"{before:.1f} MB | {after:.1f} MB | {float(r['hwm_kb']) / 1024:.1f} MB | {per:.0f} | "
            f"{fmt(db, 1, ' MB') if db else '-'} |"
        )
    p("")

emb = read_tsv(WORK, "memory-embedded.tsv")
esum = {}
if emb:
    p("## The embedded store with many resources")
    p("")
    p(
        "The file holds `resources` maxima (`direct`: written by examples/fill_embedded.rs; "
        "`http`: one fenced PUT each through fencegate). fencegate starts on it with the default "
        "`store.cache_size`; *ready* is the time from the start to `/readyz` answering 200. A "
        "stale token (0) for the last resource must be refused (`409`); *ready* is the median "
        "of three starts, *after kill -9* a start after the process was killed (redb then "
        "checks the whole file). Then fenced PUTs with "
        "rising tokens, 32 connections (bench/put_range.lua): *hot* cycles over a working set "
        "within the cache, *cold* walks every resource in a scattered order, so each write finds "
        "its resource uncached (after 150,000 scattered writes that fill the cache). *store* is the mean of `fencegate_store_duration_seconds` per "
        "raise; *pages read/written* are redb's 4 KiB file reads and writes per request "
        "(rchar and wchar of /proc/<pid>/io, which do not count sockets)."
    )
    p("")
    p("| store | resources | fill | db file | ready (3 starts) | after kill -9 | RSS at ready | stale token | peak RSS (VmHWM) |")
    p("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in emb:
        fill = r["fill"] + (f", {float(r['fill_seconds']):.0f} s" if float(r["fill_seconds"]) else "")
        if float(r["rss_fill_kb"]):
            fill += f", RSS after {float(r['rss_fill_kb']) / 1024:.1f} MB"
        esum[r["target"]] = r
        p(
            f"| {NAMES[r['target']]} | {int(r['resources']):,} | {fill} | {float(r['db_bytes']) / 1048576:,.0f} MB | "
            f"{float(r['ready_ms']):.1f} ms ({r['readies_ms'].replace('/', ', ')}) | {float(r['crash_ready_ms']):,.0f} ms | "
            f"{float(r['rss_ready_kb']) / 1024:.1f} MB | {r['stale_status']} | "
            f"{float(r['hwm_kb']) / 1024:.1f} MB |"
        )
    p("")
    p("| store | run | resources | req/s | proxy CPU us/request | store us/raise | pages read/request | pages written/request | RSS after |")
    p("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in emb:
        for run, n in (("hot", int(r["hot_resources"])), ("cold", int(r["resources"]))):
            p(
                f"| {NAMES[r['target']]} | {run} | {n:,} | {fmt(float(r[run + '_rps']))} | {r[run + '_cpu_us']} | "
                f"{r[run + '_store_us']} | {r[run + '_read_pages']} | {r[run + '_write_pages']} | "
                f"{float(r['rss_' + run + '_kb']) / 1024:.1f} MB |"
            )
    p("")

# ---------------------------------------------------------------- bars
p("## Bars")
p("")


def bar(name, ok, detail):
    status = "MET" if ok else ("MISSED" if ok is not None else "NOT MEASURED")
    p(f"- **{status}**: {name}. {detail}")


def get(d, *k):
    cur = d
    for key in k:
        if cur is None:
            return None
        cur = cur.get(key) if isinstance(cur, dict) else None
    return cur


g_fg = summary.get(("get", "fg-memory"))
g_ng = summary.get(("get", "nginx"))
if g_fg and g_ng:
    ok = g_fg["rps"] >= g_ng["rps"] and g_fg["cpu"] <= g_ng["cpu"]
    bar(
        "GET pass-through: fencegate req/s >= nginx and proxy CPU us/request <= nginx",
        ok,
        f"fencegate {g_fg['rps']:,.0f} req/s, {g_fg['cpu']:.1f} us/req vs nginx "
        f"{g_ng['rps']:,.0f} req/s, {g_ng['cpu']:.1f} us/req "
        f"({g_fg['rps'] / g_ng['rps']:.2f}x the req/s, {g_fg['cpu'] / g_ng['cpu']:.2f}x the CPU).",
    )
else:
    bar("GET pass-through vs nginx", None, "")
p_emb = summary.get(("put", "fg-embedded"))
p_mem = summary.get(("put", "fg-memory"))
p_ng = summary.get(("put", "nginx"))
if p_emb and p_ng:
    bar(
        "fenced PUT, embedded store >= 0.9 x nginx's PUT req/s",
        p_emb["rps"] >= 0.9 * p_ng["rps"],
        f"{p_emb['rps']:,.0f} vs 0.9 x {p_ng['rps']:,.0f} = {0.9 * p_ng['rps']:,.0f} req/s "
        f"({p_emb['rps'] / p_ng['rps']:.2f}x nginx; CPU {p_emb['cpu']:.1f} vs {p_ng['cpu']:.1f} us/req).",
    )
if p_mem and p_ng:
    bar(
        "fenced PUT, memory store >= nginx's PUT req/s",
        p_mem["rps"] >= p_ng["rps"],
        f"{p_mem['rps']:,.0f} vs {p_ng['rps']:,.0f} req/s ({p_mem['rps'] / p_ng['rps']:.2f}x; "
        f"CPU {p_mem['cpu']:.1f} vs {p_ng['cpu']:.1f} us/req).",
    )
for workload in WORKLOADS:
    n = fsum.get((workload, "nginx"))
    nd = fixed_reference(workload, "nginx") if n else None
    for target in ("fg-memory", "fg-embedded"):
        f = fsum.get((workload, target))
        d = fixed_reference(workload, target) if f else None
        if not (d and n and nd and f):
            continue
        fa50, fa99 = f["p50"] - d["p50"], f["p99"] - d["p99"]
        na50, na99 = n["p50"] - nd["p50"], n["p99"] - nd["p99"]
        bar(
            f"fixed-rate {workload.upper()}, {NAMES[target]}: added p50 and p99 over direct <= nginx's",
            fa50 <= na50 and fa99 <= na99,
            f"added p50 {fa50:+.0f} us vs nginx {na50:+.0f} us; added p99 {fa99:+.0f} us vs nginx {na99:+.0f} us.",
        )
m = msum.get("fg-memory")
if m:
    scaled = m["after"]
    bar(
        f"{m['n']:,} resources in the memory store <= 150 MB RSS",
        scaled <= 150 if m["n"] >= 1_000_000 else None,
        f"RSS {m['after']:.1f} MB after {m['n']:,} resources"
        + ("" if m["n"] >= 1_000_000 else " (fewer than 1,000,000: run without --quick/--memory)")
        + ".",
    )
e = esum.get("fg-embedded")
if e:
    n = int(e["resources"])
    full = n >= 10_000_000
    peak = float(e["hwm_kb"]) / 1024
    bar(
        f"{n:,} resources in the embedded store: RSS <= 64 MB with the default cache",
        peak <= 64 if full else None,
        f"peak {peak:.1f} MB, {float(e['rss_ready_kb']) / 1024:.1f} MB at ready, "
        f"{float(e['rss_cold_kb']) / 1024:.1f} MB after the cold run"
        + ("" if full else " (fewer than 10,000,000: run without --quick/--memory-embedded)")
        + ".",
    )
    bar(
        f"{n:,} resources in the embedded store: start to ready <= 200 ms",
        float(e["ready_ms"]) <= 200 if full else None,
        f"{float(e['ready_ms']):.1f} ms (median of {e['readies_ms'].replace('/', ', ')} ms) on a "
        f"{float(e['db_bytes']) / 1048576:,.0f} MB file; {float(e['crash_ready_ms']):,.0f} ms after a kill -9.",
    )
p("")

# ---------------------------------------------------------------- profile
prof = os.path.join(WORK, "profile")
instr = []
if os.path.exists(os.path.join(prof, "instructions.tsv")):
    with open(os.path.join(prof, "instructions.tsv")) as f:
        instr = list(csv.DictReader(f, delimiter="\t"))
if instr:
    p("## User-space instructions per request (callgrind, noise-free)")
    p("")
    p(
        "Each proxy under valgrind callgrind (nginx as one process), wrk `-c8`: 2 s warm-up, "
        "counters zeroed, 4 s measured, dumped. Counts user-space instructions only (syscalls "
        "and the kernel's TCP work are not included; they are about equal for all proxies: "
        "2 reads and 2 writes per request). Unlike time, other jobs on the machine do not change "
        "these numbers. The embedded store's count is inflated: under valgrind fewer raises "
        "share each group commit, so each pays a larger share of the commit."
    )
    p("")
    p("| target | workload | requests | instructions/request | x nginx |")
    p("|---|---|---:|---:|---:|")
    per = {}
    for r in instr:
        per[(r["target"], r["workload"])] = float(r["instructions"]) / float(r["requests"])
    for r in instr:
        v = per[(r["target"], r["workload"])]
        n = per.get(("nginx", r["workload"]))
        p(
            f"| {NAMES[r['target']]} | {r['workload'].upper()} | {int(r['requests']):,} | {v:,.0f} | "
            f"{fmt(v / n, 2) if n else '-'} |"
        )
    p("")
for name, title in (
    ("perf-fg-memory-threads.txt", "perf, share of samples by thread and object, fencegate memory store, fenced PUT"),
    ("perf-fg-embedded-threads.txt", "perf, share of samples by thread and object, fencegate embedded store, fenced PUT"),
    ("perf-fg-memory.txt", "perf (cpu-clock, user+kernel, self time), fencegate memory store, fenced PUT"),
    ("perf-fg-embedded.txt", "perf (cpu-clock, user+kernel, self time), fencegate embedded store, fenced PUT"),
    ("callgrind-inclusive.txt", "callgrind (user-space instructions, inclusive), fencegate memory store, fenced PUT"),
):
    path = os.path.join(prof, name)
    if os.path.exists(path):
        p(f"## Profile: {title}")
        p("")
        p("```")
        with open(path) as f:
            lines = [l.rstrip()[:200] for l in f if l.strip()]
        if name.startswith("callgrind"):
            # The function table only, without the runtime frames that wrap everything (>= 90%),
            # each line prefixed with its instructions per request.
            start = next((i for i, l in enumerate(lines) if "file:function" in l), -1)
            lines = [l for l in lines[start + 1 :] if not l.startswith("-")]
            reqs = next(
                (float(r["requests"]) for r in instr if r["target"] == "fg-memory" and r["workload"] == "put"),
                None,
            )
            kept = []
            for l in lines:
                parts = l.split()
                try:
                    ir = float(parts[0].replace(",", ""))
                    share = float(parts[1].strip("(%)"))
                except (IndexError, ValueError):
                    continue
                if share >= 90:
                    continue
                kept.append((f"{ir / reqs:8,.0f}/req  " if reqs else "") + l)
            lines = kept
        p("\n".join(lines[:50]))
        p("```")
        p("")

# ---------------------------------------------------------------- verdict (placed up front)
v = []
for workload, label in (("get", "GET pass-through"), ("put", "fenced PUT")):
    f = summary.get((workload, "fg-memory"))
    n = summary.get((workload, "nginx"))
    if f and n and f.get("cpu") and n.get("cpu"):
        v.append(
            f"{label}: fencegate (memory store) uses {f['cpu'] / n['cpu']:.2f}x nginx's CPU per "
            f"request (median {f['cpu']:.1f} vs {n['cpu']:.1f} us; least disturbed round "
            f"{f['cpu_best']:.1f} vs {n['cpu_best']:.1f} us) and reaches {f['rps'] / n['rps']:.2f}x "
            "its req/s"
        )
for workload, label in (("get", "GET pass-through"), ("put", "PUT")):
    h = summary.get((workload, "hyper-floor"))
    n = summary.get((workload, "nginx"))
    if h and n and h.get("cpu") and n.get("cpu"):
        v.append(
            f"{label}: hyper-floor, which forwards without any check or rewriting, uses "
            f"{h['cpu'] / n['cpu']:.2f}x nginx's CPU per request (median {h['cpu']:.1f} vs "
            f"{n['cpu']:.1f} us) and reaches {h['rps'] / n['rps']:.2f}x its req/s"
        )
if instr:
    for workload in ("get", "put"):
        f = per.get(("fg-memory", workload))
        n = per.get(("nginx", workload))
        h = per.get(("hyper-floor", workload))
        if f and n:
            v.append(
                f"{workload.upper()}: {f:,.0f} vs {n:,.0f} user-space instructions per request "
                f"({f / n:.2f}x, noise-free)"
                + (
                    f"; hyper-floor {h:,.0f} ({h / n:.2f}x), so hyper accounts for "
                    f"{(h - n) / (f - n):.0%} of fencegate's excess over nginx"
                    if h and f > n
                    else ""
                )
            )
if v:
    block = ["## Verdict", ""]
    cheaper = all(
        summary.get((w, "fg-memory"), {}).get("cpu", 1e9) <= summary.get((w, "nginx"), {}).get("cpu", 0)
        for w in ("get", "put")
    )
    block.append(
        ("**Yes**" if cheaper else "**No**")
        + ": on this run fencegate, doing the fence check, is "
        + ("cheaper" if cheaper else "more expensive")
        + " than nginx doing plain proxying."
    )
    block.append("")
    block += [f"- {line}." for line in v]
    block.append("")
    out[verdict_at:verdict_at] = block

p(f"Raw data: {WORK} (throughput.tsv, fixed.tsv, memory.tsv, logs/).")
print("\n".join(out))
