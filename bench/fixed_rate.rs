//! Fixed-rate HTTP/1.1 load generator for `bench/run --fixed-rate RATE` (wrk2 is not in Debian).
//!
//! Standard library only, so `bench/run` compiles it with plain `rustc -O` and Cargo.toml is
//! untouched. Build: `rustc -O --edition 2021 bench/fixed_rate.rs -o fixed_rate`.
//!
//! Open-loop schedule, as wrk2 does it: request `i` is due at `start + i / rate`, and
//! connection `k` owns requests `i ≡ k (mod C)`, one blocking thread per keep-alive connection.
//! Latency is coordinated-omission free: when the connection is still busy with the previous
//! response at a request's due time (the server under test fell behind), the request is timed
//! from its *due* time, so the queueing the server caused is counted. When the connection was
//! idle, it is timed from the moment it was actually written, so the generator's own timer
//! slack (a sleeping thread wakes 50-100 µs late) is not charged to the server.
//!
//! Usage: fixed_rate ADDR RATE SECONDS WARMUP_SECONDS CONNECTIONS get|put [RESOURCES TOKEN_BASE
//!        [ROUTES last|spread]]
//!   get: `GET /items/42`; put: `PUT /accounts/{i % RESOURCES}` with `Fencing-Token: TOKEN_BASE+i`.
//!   With ROUTES (bench/growth's route table of ROUTES routes), put writes to
//!   `/r{k}/accounts/{i % RESOURCES}` instead: k is the last route (ROUTES-1) for `last`, or
//!   `i * 7919 % ROUTES` for `spread` (a stride, so consecutive writes land far apart in the table).
//! Prints one line: `RESULT sent=.. ok=.. non2xx=.. errors=.. late=.. p50_us=.. p90_us=..
//! p99_us=.. p999_us=.. max_us=.. svc_p50_us=.. svc_p99_us=.. total=..` (`svc_*`: service time
//! from the write, not corrected; `late`: requests that found their connection busy; `total`:
//! every request sent, warm-up included).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Args {
    addr: SocketAddr,
    rate: f64,
    seconds: f64,
    warmup: f64,
    connections: usize,
    put: bool,
    resources: u64,
    token_base: u64,
    /// Routes of bench/growth's table (0: the plain `/accounts/{id}` path).
    routes: u64,
    /// Every write to the last route, or spread over the table.
    spread: bool,
}

fn parse_args() -> Args {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 7 {
        eprintln!(
            "usage: {} ADDR RATE SECONDS WARMUP CONNECTIONS get|put [RESOURCES TOKEN_BASE [ROUTES last|spread]]",
            a[0]
        );
        std::process::exit(2);
    }
    Args {
        addr: a[1].parse().expect("ADDR is host:port"),
        rate: a[2].parse().expect("RATE is a number"),
        seconds: a[3].parse().expect("SECONDS is a number"),
        warmup: a[4].parse().expect("WARMUP is a number"),
        connections: a[5].parse().expect("CONNECTIONS is a number"),
        put: a[6] == "put",
        resources: a.get(7).map_or(10_000, |s| s.parse().expect("RESOURCES")),
        token_base: a.get(8).map_or(1, |s| s.parse().expect("TOKEN_BASE")),
        routes: a.get(9).map_or(0, |s| s.parse().expect("ROUTES")),
        spread: a.get(10).is_some_and(|s| s == "spread"),
    }
}

#[derive(Default)]
struct Sample {
    /// Coordinated-omission corrected latency, ns.
    corrected: Vec<u64>,
    /// Service time from the write, ns.
    service: Vec<u64>,
    ok: u64,
    non2xx: u64,
    errors: u64,
    late: u64,
    sent: u64,
    /// Every request sent, warm-up included (for CPU per request over the whole run).
    total: u64,
}

fn request_bytes(args: &Args, i: u64) -> Vec<u8> {
    let host = args.addr;
    if args.put {
        let body = b"{\"balance\":100}\n";
        let prefix = match (args.routes, args.spread) {
            (0, _) => String::new(),
            (n, false) => format!("/r{}", n - 1),
            (n, true) => format!("/r{}", i.wrapping_mul(7919) % n),
        };
        let mut r = format!(
            "PUT {prefix}/accounts/{} HTTP/1.1\r\nHost: {host}\r\nFencing-Token: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            i % args.resources,
            args.token_base + i,
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(body);
        r
    } else {
        format!("GET /items/42 HTTP/1.1\r\nHost: {host}\r\n\r\n").into_bytes()
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Reads one response (Content-Length or chunked body). Returns the status code.
fn read_response(stream: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<u16> {
    let mut chunk = [0u8; 16384];
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_owned());
    let head_end = loop {
        if let Some(p) = find(buf, b"\r\n\r\n") {
            break p + 4;
        }
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(bad("connection closed"));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| bad("head not utf-8"))?;
    let status: u16 = head
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("no status"))?;
    let mut length = None;
    let mut chunked = false;
    for line in head.split("\r\n").skip(1) {
        if let Some((k, v)) = line.split_once(':') {
            let k = k.trim();
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse::<usize>().ok();
            } else if k.eq_ignore_ascii_case("transfer-encoding")
                && v.to_ascii_lowercase().contains("chunked")
            {
                chunked = true;
            }
        }
    }
    let mut pos = head_end;
    if chunked {
        loop {
            // Chunk size line.
            let line_end = loop {
                if let Some(p) = find(&buf[pos..], b"\r\n") {
                    break pos + p;
                }
                let n = stream.read(&mut chunk)?;
                if n == 0 {
                    return Err(bad("closed in chunk"));
                }
                buf.extend_from_slice(&chunk[..n]);
            };
            let size_text = std::str::from_utf8(&buf[pos..line_end]).map_err(|_| bad("chunk"))?;
            let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| bad("chunk size"))?;
            let need = line_end + 2 + size + 2;
            while buf.len() < need {
                let n = stream.read(&mut chunk)?;
                if n == 0 {
                    return Err(bad("closed in chunk"));
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            pos = need;
            if size == 0 {
                break;
            }
        }
    } else {
        let need = head_end + length.unwrap_or(0);
        while buf.len() < need {
            let n = stream.read(&mut chunk)?;
            if n == 0 {
                return Err(bad("closed in body"));
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        pos = need;
    }
    buf.drain(..pos);
    Ok(status)
}

fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let s = TcpStream::connect(addr)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    Ok(s)
}

fn worker(args: Arc<Args>, k: usize, start: Instant, measure_from: Instant, end: Instant) -> Sample {
    let mut out = Sample::default();
    let mut stream = match connect(args.addr) {
        Ok(s) => Some(s),
        Err(_) => None,
    };
    let mut buf = Vec::with_capacity(16384);
    let interval = 1.0 / args.rate;
    let c = args.connections as u64;
    let mut i = k as u64;
    let mut prev_done = start;
    loop {
        let due = start + Duration::from_secs_f64(i as f64 * interval);
        if due >= end {
            break;
        }
        let now = Instant::now();
        let busy = prev_done > due;
        if due > now {
            std::thread::sleep(due - now);
        }
        let req = request_bytes(&args, i);
        let written = Instant::now();
        if stream.is_none() {
            stream = connect(args.addr).ok();
        }
        let result = match stream.as_mut() {
            Some(s) => s
                .write_all(&req)
                .and_then(|()| read_response(s, &mut buf)),
            None => Err(std::io::Error::other("no connection")),
        };
        let done = Instant::now();
        prev_done = done;
        let failed = result.is_err();
        out.total += 1;
        if due >= measure_from {
            out.sent += 1;
            match result {
                Ok(status) => {
                    if (200..300).contains(&status) {
                        out.ok += 1;
                    } else {
                        out.non2xx += 1;
                    }
                    let from = if busy { due } else { written };
                    if busy {
                        out.late += 1;
                    }
                    out.corrected.push((done - from).as_nanos() as u64);
                    out.service.push((done - written).as_nanos() as u64);
                }
                Err(_) => out.errors += 1,
            }
        }
        if failed {
            // The connection may be out of sync: reconnect for the next request.
            stream = None;
            buf.clear();
        }
        i += c;
    }
    out
}

fn pct(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let idx = ((p / 100.0) * (sorted.len() as f64 - 1.0)).round() as usize;
    sorted[idx.min(sorted.len() - 1)] / 1000
}

fn main() {
    let args = Arc::new(parse_args());
    let start = Instant::now() + Duration::from_millis(100);
    let measure_from = start + Duration::from_secs_f64(args.warmup);
    let end = measure_from + Duration::from_secs_f64(args.seconds);
    let handles: Vec<_> = (0..args.connections)
        .map(|k| {
            let args = Arc::clone(&args);
            std::thread::spawn(move || worker(args, k, start, measure_from, end))
        })
        .collect();
    let mut all = Sample::default();
    for h in handles {
        let s = h.join().expect("worker panicked");
        all.corrected.extend(s.corrected);
        all.service.extend(s.service);
        all.ok += s.ok;
        all.non2xx += s.non2xx;
        all.errors += s.errors;
        all.late += s.late;
        all.sent += s.sent;
        all.total += s.total;
    }
    all.corrected.sort_unstable();
    all.service.sort_unstable();
    let c = &all.corrected;
    println!(
        "RESULT sent={} ok={} non2xx={} errors={} late={} rate={:.1} p50_us={} p90_us={} p99_us={} p999_us={} max_us={} svc_p50_us={} svc_p99_us={} total={}",
        all.sent,
        all.ok,
        all.non2xx,
        all.errors,
        all.late,
        all.sent as f64 / args.seconds,
        pct(c, 50.0),
        pct(c, 90.0),
        pct(c, 99.0),
        pct(c, 99.9),
        c.last().copied().unwrap_or(0) / 1000,
        pct(&all.service, 50.0),
        pct(&all.service, 99.0),
        all.total,
    );
}
