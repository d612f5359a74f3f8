//! Slow or abandoned clients: header and body timeouts, a hang-up mid-write.

use super::*;

/// An upstream and a fencegate in front of it that gives a request head 300 ms.
async fn with_header_read_300ms() -> (Upstream, fencegate::app::Server) {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        &format!("timeouts: {{ header_read: 300ms }}\n{ACCOUNTS}"),
    )
    .await;
    (up, fg)
}

#[tokio::test]
async fn slow_headers_are_cut_off_after_header_read() {
    let (up, fg) = with_header_read_300ms().await;
    // Slowloris: a request head that never ends.
    let mut stream = TcpStream::connect(fg.listen).await.unwrap();
    stream
        .write_all(b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\n")
        .await
        .unwrap();
    let (answer, after) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    assert!(
        after >= Duration::from_millis(250),
        "closed after {after:?}"
    );
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );

    // Dribbling one header byte at a time does not reset the clock.
    let mut stream = TcpStream::connect(fg.listen).await.unwrap();
    let started = Instant::now();
    let head = b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut closed_after = None;
    for byte in head {
        if stream.write_all(&[*byte]).await.is_err() {
            closed_after = Some(started.elapsed());
            break;
        }
        // The attacker's pacing (not a synchronisation): one byte every 50ms.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let after = match closed_after {
        Some(after) => after,
        None => {
            read_until_closed(&mut stream, Duration::from_secs(5))
                .await
                .1
                + started.elapsed()
        }
    };
    assert!(
        after < Duration::from_secs(3),
        "dribbled head kept for {after:?}"
    );
    assert_eq!(up.count(), 0);
    assert_eq!(recorded(&fg, "account:1").await, None);
    // The server still serves.
    assert_eq!(put(&fg, "1", "5").await.status, 200);
}

/// A connection that never sends a byte holds a connection slot only for `header_read`.
#[tokio::test]
async fn a_connection_that_sends_nothing_is_closed_after_header_read() {
    let (_up, fg) = with_header_read_300ms().await;
    let mut stream = TcpStream::connect(fg.listen).await.unwrap();
    let (answer, after) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    assert!(answer.is_empty(), "{}", String::from_utf8_lossy(&answer));
    assert!(
        after >= Duration::from_millis(250) && after < Duration::from_secs(3),
        "closed after {after:?}"
    );
    assert_eq!(put(&fg, "1", "5").await.status, 200);
}

/// On a kept-alive connection the header-read clock starts again for every head (the
/// connection's timer is reused from head to head): a second head that never ends is cut off
/// after `header_read` counted from the end of the first exchange, not from the first head's
/// start.
#[tokio::test]
async fn a_slow_second_head_on_a_kept_alive_connection_is_cut_off() {
    let (up, fg) = with_header_read_300ms().await;
    let mut stream = TcpStream::connect(fg.listen).await.unwrap();
    // The first head takes 200 ms (within its 300 ms), so its deadline falls 100 ms after it
    // is answered: a timer left at that deadline would cut the second head short.
    stream
        .write_all(b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // The client's pacing (not a synchronisation).
    tokio::time::sleep(Duration::from_millis(200)).await;
    stream
        .write_all(b"Fencing-Token: 5\r\nContent-Length: 0\r\n\r\n")
        .await
        .unwrap();
    let first = read_response(&mut stream).await;
    let answered = Instant::now();
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    stream
        .write_all(b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 6\r\n")
        .await
        .unwrap();
    let (answer, _) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    let after = answered.elapsed();
    assert!(
        after >= Duration::from_millis(250) && after < Duration::from_secs(3),
        "second head cut off {after:?} after the first answer"
    );
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
        "{answer}"
    );
    assert_eq!(up.count(), 1);
    assert_eq!(recorded(&fg, "account:1").await, Some(5));
}

/// A body that never completes: the write was admitted when its head arrived (the token is
/// raised, docs/guarantees.md: never undone), the upstream never gets a complete request, and the client
/// gets 504 once `timeouts.upstream` passes.
#[tokio::test]
async fn slow_body_times_out_and_never_completes_upstream() {
    let up = Upstream::start().await;
    let fg = fencegate(
        &up.url(),
        &format!("timeouts: {{ upstream: 400ms }}\n{ACCOUNTS}"),
    )
    .await;
    let mut stream = TcpStream::connect(fg.listen).await.unwrap();
    stream
        .write_all(b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 5\r\nContent-Length: 100\r\n\r\npartial")
        .await
        .unwrap();
    let (answer, after) = read_until_closed(&mut stream, Duration::from_secs(10)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 504"), "{answer}");
    assert!(
        answer.contains("urn:fencegate:upstream-timeout"),
        "{answer}"
    );
    assert!(after >= Duration::from_millis(350), "{after:?}");
    assert_eq!(up.count(), 0, "an incomplete body completed upstream");
    assert_eq!(recorded(&fg, "account:1").await, Some(5));
    assert_eq!(put(&fg, "1", "5").await.status, 200);
}

/// A client that hangs up mid-write must not open the `ordering: serialize` barrier while its
/// write is still in flight upstream: a higher token has to wait for the lower one to finish
/// (docs/guarantees.md), here until `barrier_timeout`, then 503.
#[tokio::test]
async fn hanging_up_does_not_open_the_serialize_barrier() {
    let up = Upstream::gated().await;
    let fg = fencegate(
        &up.url(),
        "routes:\n  - { name: a, path: '/accounts/{id}', resource: 'account:{id}', ordering: serialize, barrier_timeout: 1s }\n",
    )
    .await;
    let mut first = TcpStream::connect(fg.listen).await.unwrap();
    first
        .write_all(
            b"PUT /accounts/1 HTTP/1.1\r\nHost: x\r\nFencing-Token: 1\r\nContent-Length: 0\r\n\r\n",
        )
        .await
        .unwrap();
    assert_eq!(up.arrival().await.token(), Some(1));
    drop(first);
    let mut second = tokio::spawn({
        let url = format!("http://{}/accounts/1", fg.listen);
        async move { send("PUT", &url, &[("fencing-token", "2")], "").await }
    });
    tokio::select! {
        seen = up.arrival() => panic!(
            "token {:?} reached the upstream while token 1 was still in flight there",
            seen.token()
        ),
        reply = &mut second => {
            reply.unwrap().assert_problem(503, "urn:fencegate:barrier-timeout");
        }
    }
    up.release(2);
}
