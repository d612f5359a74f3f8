//! HTTP/2 (h2c, prior knowledge), frames written by hand.

use super::*;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HPACK, literal without indexing, indexed name (RFC 7541 §6.2.2); values shorter than 127.
fn literal(name_index: u8, value: &str) -> Vec<u8> {
    let mut out = vec![name_index, value.len() as u8];
    out.extend_from_slice(value.as_bytes());
    out
}

/// `PUT /accounts/1` over http with authority `x`, no token.
fn put_block() -> Vec<u8> {
    let mut block = literal(2, "PUT");
    block.push(0x86); // :scheme http
    block.extend(literal(4, "/accounts/1"));
    block.extend(literal(1, "x"));
    block
}

/// Connects with the h2c preface and an empty SETTINGS frame.
async fn h2c(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(PREFACE).await.unwrap();
    s.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    s
}

/// Reads frames until GOAWAY (returns its error code) or the connection closes (`None`).
async fn until_goaway(stream: &mut TcpStream, within: Duration) -> Option<u32> {
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        while buf.len() >= 9 {
            let len =
                (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            if buf[3] == GOAWAY && len >= 8 {
                return Some(u32::from_be_bytes(buf[13..17].try_into().unwrap()));
            }
            buf.drain(..9 + len);
        }
        let read = tokio::time::timeout_at(deadline, stream.read(&mut chunk))
            .await
            .unwrap_or_else(|_| panic!("no GOAWAY and no close within {within:?}"));
        match read {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Reads frames until a HEADERS frame on `stream` (a response) arrives; false on close.
async fn until_headers(s: &mut TcpStream, stream: u32, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 16384];
    loop {
        while buf.len() >= 9 {
            let len =
                (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            let id = u32::from_be_bytes(buf[5..9].try_into().unwrap()) & 0x7fff_ffff;
            if buf[3] == HEADERS && id == stream {
                return true;
            }
            buf.drain(..9 + len);
        }
        let read = tokio::time::timeout_at(deadline, s.read(&mut chunk))
            .await
            .unwrap_or_else(|_| panic!("no response within {within:?}"));
        match read {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

async fn real_fencegate(up: &Upstream, dir: &std::path::Path) -> crate::process::Process {
    let config = dir.join("fencegate.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:0\nadmin: 127.0.0.1:0\nupstream: {}\nstore: {{ kind: memory }}\n{ACCOUNTS}",
            up.url()
        ),
    )
    .unwrap();
    crate::process::Process::start(&config).await
}

#[tokio::test]
async fn h2_rapid_reset_gets_goaway_and_the_server_stays_healthy() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut p = real_fencegate(&up, dir.path()).await;
    let mut s = h2c(p.proxy).await;
    let block = put_block();
    let mut burst = Vec::new();
    for i in 0..1000u32 {
        let id = 2 * i + 1;
        burst.extend(frame(HEADERS, END_HEADERS, id, &block));
        burst.extend(frame(RST_STREAM, 0, id, &8u32.to_be_bytes())); // CANCEL
    }
    // The server may close while we are still writing: that is the expected outcome too.
    let _ = s.write_all(&burst).await;
    let code = until_goaway(&mut s, Duration::from_secs(10)).await;
    println!("rapid reset: GOAWAY {code:?}");
    assert!(
        code.is_none() || code == Some(0xb),
        "expected ENHANCE_YOUR_CALM or a close, got GOAWAY {code:?}"
    );
    assert_eq!(up.count(), 0);
    // Still healthy, over HTTP/1 and over a fresh HTTP/2 connection.
    assert_eq!(crate::process::put_to(p.proxy, "1", "5").await.status, 200);
    let mut s = h2c(p.proxy).await;
    s.write_all(&frame(HEADERS, END_HEADERS | END_STREAM, 1, &put_block()))
        .await
        .unwrap();
    assert!(
        until_headers(&mut s, 1, Duration::from_secs(5)).await,
        "a fresh HTTP/2 connection got no response"
    );
    p.child.start_kill().unwrap();
}

#[tokio::test]
async fn h2_continuation_flood_is_cut_off_with_bounded_memory() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut p = real_fencegate(&up, dir.path()).await;
    let pid = p.child.id().unwrap();
    let before = rss_kib(pid);
    let mut s = h2c(p.proxy).await;
    // HEADERS without END_HEADERS, then CONTINUATION frames of fresh literal headers, never
    // ending: 64 MiB offered in all.
    s.write_all(&frame(HEADERS, 0, 1, &put_block()))
        .await
        .unwrap();
    let mut piece = Vec::new();
    while piece.len() < 16_000 {
        // literal without indexing, new name (0x00), 10-byte name, 100-byte value
        piece.push(0x00);
        piece.push(10);
        piece.extend_from_slice(format!("x-f{:07}", piece.len()).as_bytes());
        piece.push(100);
        piece.extend_from_slice(&[b'v'; 100]);
    }
    let continuation = frame(CONTINUATION, 0, 1, &piece);
    let mut written = 0usize;
    let mut reset = false;
    for _ in 0..4096 {
        match tokio::time::timeout(Duration::from_secs(5), s.write_all(&continuation)).await {
            Ok(Ok(())) => written += continuation.len(),
            // Reset or broken pipe: the server closed the connection.
            Ok(Err(_)) => {
                reset = true;
                break;
            }
            // The server stopped reading: it must now say GOAWAY or close.
            Err(_) => break,
        }
    }
    if reset {
        println!("CONTINUATION flood: connection reset after {written} bytes");
    } else {
        // Panics unless the server sends GOAWAY or closes within the bound.
        let code = until_goaway(&mut s, Duration::from_secs(10)).await;
        println!("CONTINUATION flood: GOAWAY {code:?} after {written} bytes");
    }
    let after = rss_kib(pid);
    assert!(
        after < before + 32 * 1024,
        "RSS grew from {before} KiB to {after} KiB after {written} bytes of CONTINUATION"
    );
    assert_eq!(up.count(), 0);
    assert_eq!(crate::process::put_to(p.proxy, "1", "5").await.status, 200);
    p.child.start_kill().unwrap();
}
