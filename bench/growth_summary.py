#!/usr/bin/env python3
"""Tables of bench/growth's runs, as markdown on stdout: `growth_summary.py WORK_DIR`.

Reads meta.txt and growth-{routes,start,idle,body}.tsv from WORK_DIR. Every figure is the median
over the rounds (over the three starts for start-up); CPU is the proxy process's utime+stime
(nginx's worker included) from /proc/<pid>/stat over the measured wrk run.
"""
import sys

from workdir import med, read_meta, read_tsv

WORK = sys.argv[1]
meta = read_meta(WORK)
HZ = float(meta.get("clk_tck", "100"))


def rows(name):
    return read_tsv(WORK, name)


def fmt(v, digits=0):
    if v is None:
        return "–"
    return f"{v:,.{digits}f}"


def ratio(a, b, digits=2):
    if a is None or not b:
        return "–"
    return f"{a / b:.{digits}f}x"


out = []
p = out.append
p("## How cost grows")
p("")
p(
    f"`bench/growth` ({meta.get('growth_rounds')} rounds, target order rotated each round): wrk "
    f"-t1 and bench/fixed_rate.rs on core {meta.get('loadgen_core')}, the proxy and the upstream "
    f"on core {meta.get('proxy_core')}. Medians over the rounds; proxy CPU from /proc/<pid>/stat."
)
p("")

# ------------------------------------------------------------------ routes
routes = rows("growth-routes.tsv")
if routes:
    rate = meta.get("growth_rate")
    p(f"### Routes: fenced PUTs over a table of N routes")
    p("")
    p(
        "fencegate: N routes `/r{i}/accounts/{id}` -> `r{i}:{id}`, memory store, every PUT an "
        "admitted raise. nginx: N prefix locations `location /r{i}/accounts/` (and `location /`), "
        f"plain proxying. wrk -c{meta.get('connections')} for req/s and CPU; at a fixed {rate} "
        "req/s the p50 / p99 added over a direct run of the same requests. *last*: every write to "
        "the last route declared; *spread*: consecutive writes 7,919 routes apart (mod N)."
    )
    p("")
    p(
        "| routes, writes | fencegate req/s | fencegate CPU µs/req | nginx req/s | nginx CPU µs/req "
        "| CPU, fencegate / nginx | added p50 / p99, fencegate | added p50 / p99, nginx |"
    )
    p("|---|---:|---:|---:|---:|---:|---:|---:|")
    keys = []
    for r in routes:
        k = (int(r["routes"]), r["mode"])
        if k not in keys:
            keys.append(k)

    def stat(n, mode, target):
        rs = [r for r in routes if int(r["routes"]) == n and r["mode"] == mode and r["target"] == target]
        cpu = med(
            [int(r["proxy_ticks"]) / HZ * 1e6 / int(r["requests"]) for r in rs if r["requests"]]
        )
        return {
            "rps": med([r["rps"] for r in rs]),
            "cpu": cpu,
            "p50": med([r["fixed_p50_us"] for r in rs]),
            "p99": med([r["fixed_p99_us"] for r in rs]),
            "bad": sum(int(r["status_errors"] or 0) + int(r["fixed_non2xx"] or 0) + int(r["fixed_errors"] or 0) for r in rs),
        }

    bad = 0
    for n, mode in keys:
        f, g, d = stat(n, mode, "fencegate"), stat(n, mode, "nginx"), stat(n, mode, "direct")
        bad += f["bad"] + g["bad"] + d["bad"]

        def added(s):
            if s["p50"] is None or d["p50"] is None:
                return "–"
            return f"{s['p50'] - d['p50']:+,.0f} / {s['p99'] - d['p99']:+,.0f} µs"

        p(
            f"| {n:,}, {mode} | {fmt(f['rps'])} | {fmt(f['cpu'], 1)} | {fmt(g['rps'])} | "
            f"{fmt(g['cpu'], 1)} | {ratio(f['cpu'], g['cpu'])} | {added(f)} | {added(g)} |"
        )
    p("")
    base_f, base_g = stat(1, "last", "fencegate"), stat(1, "last", "nginx")
    growth = []
    for n, mode in keys:
        if n == 1:
            continue
        f, g = stat(n, mode, "fencegate"), stat(n, mode, "nginx")
        growth.append(
            f"{n:,} {mode}: fencegate {ratio(f['cpu'], base_f['cpu'])}, nginx {ratio(g['cpu'], base_g['cpu'])}"
        )
    p("CPU per request against 1 route: " + "; ".join(growth) + ".")
    p(f"Non-2xx answers and socket errors over every run: {bad}.")
    p("")

start = rows("growth-start.tsv")
if start:
    p("Start to forwarding (exec to the first 200 through the proxy, median of 3 starts) and RSS once forwarding:")
    p("")
    p("| routes | config bytes, fencegate / nginx | fencegate start ms | fencegate RSS MB | nginx start ms | nginx RSS MB (master + worker) |")
    p("|---:|---:|---:|---:|---:|---:|")
    for n in sorted({int(r["routes"]) for r in start}):
        def s(target, field):
            return med([r[field] for r in start if int(r["routes"]) == n and r["target"] == target])
        p(
            f"| {n:,} | {fmt(s('fencegate', 'config_bytes'))} / {fmt(s('nginx', 'config_bytes'))} | "
            f"{fmt(s('fencegate', 'ready_ms'), 1)} | {fmt((s('fencegate', 'rss_kb') or 0) / 1024, 1)} | "
            f"{fmt(s('nginx', 'ready_ms'), 1)} | {fmt((s('nginx', 'rss_kb') or 0) / 1024, 1)} |"
        )
    p("")

# ------------------------------------------------------------------ idle connections
idle = rows("growth-idle.tsv")
if idle:
    n = int(idle[0]["connections"])
    p(f"### Idle keep-alive connections: {n:,}, one GET each, left open")
    p("")
    p(
        f"VmRSS of the proxy (nginx: master + worker) before, with the {n:,} connections open "
        "(1 s after the last answer), and 1 s after the client closed them all. Open files limit "
        f"{meta.get('growth_nofile')}."
    )
    p("")
    p(
        "| proxy | RSS before, MB | RSS with the connections, MB | bytes per connection | against nginx "
        "| against haproxy | RSS after closing, MB | its connections to the upstream | upstream's RSS, bytes per connection |"
    )
    p("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    per = {}
    for target in ["fencegate", "nginx", "haproxy"]:
        rs = [r for r in idle if r["target"] == target]
        if rs:
            per[target] = med([(int(r["rss_open_kb"]) - int(r["rss_before_kb"])) * 1024 / int(r["opened"] or 1) for r in rs])
    for target in ["fencegate", "nginx", "haproxy"]:
        rs = [r for r in idle if r["target"] == target]
        if not rs:
            continue
        opened = min(int(r["opened"] or 0) for r in rs)
        note = "" if opened == n else f" (only {opened:,} opened)"
        p(
            f"| {target}{note} | {fmt(med([r['rss_before_kb'] for r in rs]) / 1024, 1)} | "
            f"{fmt(med([r['rss_open_kb'] for r in rs]) / 1024, 1)} | {fmt(per[target])} | "
            f"{ratio(per[target], per.get('nginx'), 1)} | {ratio(per[target], per.get('haproxy'), 1)} | "
            f"{fmt(med([r['rss_closed_kb'] for r in rs]) / 1024, 1)} | "
            f"{fmt(med([r['upstream_connections'] for r in rs if r['upstream_connections'] != '-']))} | "
            f"{fmt(med([(int(r['upstream_rss_open_kb']) - int(r['upstream_rss_before_kb'])) * 1024 / int(r['opened'] or 1) for r in rs]))} |"
        )
    p("")

# ------------------------------------------------------------------ bodies
body = rows("growth-body.tsv")
if body:
    size = int(meta.get("growth_body_bytes", "1000000"))
    p(f"### Large bodies: PUTs of {size:,} bytes")
    p("")
    p(
        f"wrk -t1 -c{meta.get('growth_body_connections')}, rising tokens (fenced through fencegate: "
        "every PUT an admitted raise, its body streamed). MB = 10^6 bytes of request body. CPU per "
        "MB: the proxy's (and the upstream's) utime+stime over the measured run, per MB sent."
    )
    p("")
    p(
        "| target | MB/s | against direct | proxy CPU ms/MB | upstream CPU ms/MB | p50 / p99 ms per PUT "
        "| non-2xx / socket errors per run |"
    )
    p("|---|---:|---:|---:|---:|---:|---:|")
    names = {
        "direct": "direct (no proxy)",
        "nginx": "nginx, `proxy_request_buffering on` (default: whole body first, to a temp file)",
        "nginx-stream": "nginx, `proxy_request_buffering off` (streamed)",
        "fencegate": "fencegate, fenced route (memory store)",
    }
    mbps = {}
    for target in ["direct", "nginx", "nginx-stream", "fencegate"]:
        rs = [r for r in body if r["target"] == target]
        if rs:
            mbps[target] = med([float(r["rps"]) * size / 1e6 for r in rs])
    for target in ["direct", "nginx", "nginx-stream", "fencegate"]:
        rs = [r for r in body if r["target"] == target]
        if not rs:
            continue

        def per_mb(field):
            return med([int(r[field]) / HZ * 1e3 / (int(r["requests"]) * size / 1e6) for r in rs])

        cpu = "–" if target == "direct" else fmt(per_mb("proxy_ticks"), 2)
        p(
            f"| {names[target]} | {fmt(mbps[target])} | {ratio(mbps[target], mbps.get('direct'))} | "
            f"{cpu} | {fmt(per_mb('upstream_ticks'), 2)} | "
            f"{fmt(med([r['p50_us'] for r in rs]) / 1000, 2)} / {fmt(med([r['p99_us'] for r in rs]) / 1000, 2)} | "
            f"{fmt(med([r['status_errors'] for r in rs]))} / {fmt(med([r['socket_errors'] for r in rs]))} |"
        )
    p("")

print("\n".join(out))
