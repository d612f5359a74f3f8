//! Accept loop shared by the proxy and admin listeners.
//!
//! `serve(listener, ..., shutdown)` takes a bound listener and a shutdown future (tests bind
//! port 0). On shutdown the listener is closed at once, open connections are told to finish
//! their current requests (HTTP/1 keep-alive off, HTTP/2 GOAWAY), and the call returns when
//! they are done or when `drain` has passed, whichever is first.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

use crate::body::ProxyBody;
use crate::timer::Kept;

/// Connection-level settings.
#[derive(Clone)]
pub struct ServerSettings {
    pub tls: Option<TlsAcceptor>,
    /// Time allowed for the TLS handshake and for each request head.
    pub header_read: Duration,
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub max_connections: usize,
    /// Bound on the graceful drain after shutdown.
    pub drain: Duration,
}

/// Serves `handler` on `listener` until `shutdown` resolves, then drains.
pub async fn serve<H, F>(
    listener: TcpListener,
    settings: ServerSettings,
    handler: H,
    shutdown: impl Future<Output = ()>,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<Response<ProxyBody>, Infallible>> + Send + 'static,
{
    // Connections are served by hyper's HTTP/1 or HTTP/2 connection, as ALPN or, in
    // cleartext, their first bytes say ([`sniff`]); plain ones whose first bytes do not tell
    // yet by hyper-util's builder, which reads them itself and replays them to the connection.
    // Serving directly spares every read that replay wrapper, and a connection that sends
    // nothing is closed after `header_read` (the builder would wait for its first bytes for
    // ever). The header-read timer is per connection ([`HeadTimer`]), set on each
    // connection's copy of the builder.
    //
    // hyper's builders and hyper-util's take the same settings through different types.
    macro_rules! http1_settings {
        ($builder:expr) => {
            $builder
                .header_read_timeout(settings.header_read)
                .writev(false)
                .max_buf_size(settings.max_header_bytes.max(8192))
                .max_headers(settings.max_headers)
        };
    }
    macro_rules! http2_settings {
        ($builder:expr) => {
            $builder
                .timer(TokioTimer::new())
                .max_header_list_size(u32::try_from(settings.max_header_bytes).unwrap_or(u32::MAX))
                .max_concurrent_streams(256)
                // Bounds the rapid-reset pattern (CVE-2023-44487): too many resets close the
                // connection.
                .max_pending_accept_reset_streams(50)
                .max_local_error_reset_streams(256)
        };
    }
    let mut http1 = http1::Builder::new();
    http1_settings!(http1);
    let mut http2 = http2::Builder::new(TokioExecutor::new());
    http2_settings!(http2);
    let mut auto = auto::Builder::new(TokioExecutor::new());
    http1_settings!(auto.http1());
    http2_settings!(auto.http2());
    let builders = Arc::new(Builders { http1, http2, auto });
    let drain = Arc::new(Drain::default());
    let slots = Arc::new(Semaphore::new(settings.max_connections));
    tokio::pin!(shutdown);
    let mut backoff = Duration::from_millis(5);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = Arc::clone(&slots).acquire_owned() => permit.expect("never closed"),
        };
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    // Usually EMFILE: back off instead of spinning or dying.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            },
        };
        backoff = Duration::from_millis(5);
        let _ = stream.set_nodelay(true);
        let builders = Arc::clone(&builders);
        let entry = drain.enter();
        let handler = handler.clone();
        let settings_tls = settings.tls.clone();
        let handshake_limit = settings.header_read;
        tokio::spawn(async move {
            let _permit = permit;
            let service = service_fn(move |req| handler(req, peer));
            match settings_tls {
                None => match tokio::time::timeout(handshake_limit, sniff(&stream)).await {
                    Ok(Ok(Sniffed::Http1)) => {
                        let conn = builders
                            .http1()
                            .serve_connection(TokioIo::new(stream), service);
                        let _ = entry.watch(conn, |conn| conn.graceful_shutdown()).await;
                    }
                    Ok(Ok(Sniffed::Http2)) => {
                        let conn = builders
                            .http2
                            .serve_connection(TokioIo::new(stream), service);
                        let _ = entry.watch(conn, |conn| conn.graceful_shutdown()).await;
                    }
                    Ok(Ok(Sniffed::NotYet)) => {
                        let mut auto = builders.auto.clone();
                        auto.http1().timer(HeadTimer::default());
                        let conn = auto.serve_connection(TokioIo::new(stream), service);
                        let _ = entry.watch(conn, |conn| conn.graceful_shutdown()).await;
                    }
                    // Closed, failed, or silent for as long as a head may take.
                    Ok(Err(_)) | Err(_) => {}
                },
                Some(acceptor) => {
                    let tls = match tokio::time::timeout(handshake_limit, acceptor.accept(stream))
                        .await
                    {
                        Ok(Ok(tls)) => tls,
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "TLS handshake timed out");
                            return;
                        }
                    };
                    // Over TLS the version is negotiated (ALPN), never sniffed (RFC 9113 §3.3).
                    if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
                        let conn = builders.http2.serve_connection(TokioIo::new(tls), service);
                        let _ = entry.watch(conn, |conn| conn.graceful_shutdown()).await;
                    } else {
                        let conn = builders
                            .http1()
                            .serve_connection(TokioIo::new(tls), service);
                        let _ = entry.watch(conn, |conn| conn.graceful_shutdown()).await;
                    }
                }
            }
        });
    }
    let addr = listener.local_addr().ok();
    drop(listener);
    tracing::info!(
        addr = addr.map(tracing::field::display),
        open = drain.count(),
        "listener closed; draining connections"
    );
    tokio::select! {
        () = drain.shutdown() => {}
        () = tokio::time::sleep(settings.drain) => {
            tracing::warn!(
                addr = addr.map(tracing::field::display),
                open = drain.count(),
                drain = %crate::duration::display(settings.drain),
                "connections still open after the drain timeout; closing them"
            );
        }
    }
}

/// The connection builders, configured once.
struct Builders {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
    /// For plain connections whose first bytes do not tell the version yet.
    auto: auto::Builder<TokioExecutor>,
}

impl Builders {
    /// The HTTP/1 builder, with a header-read timer of the connection's own.
    fn http1(&self) -> http1::Builder {
        let mut http1 = self.http1.clone();
        http1.timer(HeadTimer::default());
        http1
    }
}

/// What a plain connection's first bytes say it speaks.
#[derive(Debug, PartialEq)]
enum Sniffed {
    Http1,
    /// The HTTP/2 connection preface (prior knowledge, RFC 9113 §3.3).
    Http2,
    /// A beginning of the preface, but not all of it yet.
    NotYet,
}

/// The HTTP/2 connection preface.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Tells HTTP/1 from HTTP/2 by the first bytes that arrive, without taking them from the
/// socket: the HTTP/1 or HTTP/2 connection then reads the stream as it came. An error for a
/// connection closed before it sent anything.
async fn sniff(stream: &tokio::net::TcpStream) -> std::io::Result<Sniffed> {
    let mut first = [0u8; PREFACE.len()];
    let n = stream.peek(&mut first).await?;
    Ok(match n {
        0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
        _ if first[..n] != PREFACE[..n] => Sniffed::Http1,
        _ if n == PREFACE.len() => Sniffed::Http2,
        _ => Sniffed::NotYet,
    })
}

/// The open connections, and the signal that tells them to finish.
///
/// hyper-util's `GracefulShutdown` does the same with a watch channel that every connection
/// polls on every wake-up (callgrind: about 400 instructions of a proxied GET). Here a
/// connection registers its task's waker once, on its first poll, and each poll reads one flag.
#[derive(Default)]
struct Drain {
    draining: AtomicBool,
    open: Mutex<Open>,
    /// Told when the last connection closes while draining.
    closed: tokio::sync::Notify,
}

#[derive(Default)]
struct Open {
    next: u64,
    /// The open connections' task wakers (none before a connection's first poll).
    wakers: HashMap<u64, Option<Waker>>,
}

impl Drain {
    /// A new connection's place; the connection is open until the [`Entry`] is dropped.
    fn enter(self: &Arc<Self>) -> Entry {
        let mut open = self.open.lock().expect("drain lock poisoned");
        let id = open.next;
        open.next += 1;
        open.wakers.insert(id, None);
        Entry {
            drain: Arc::clone(self),
            id,
        }
    }

    fn count(&self) -> usize {
        self.open.lock().expect("drain lock poisoned").wakers.len()
    }

    /// Tells every open connection to finish its current request and close (HTTP/1 keep-alive
    /// off, HTTP/2 GOAWAY), and waits until all have.
    async fn shutdown(&self) {
        self.draining.store(true, Ordering::Release);
        // Taken under the lock, woken after it: a connection registering now either is in
        // this list or, registering after it, reads the flag set above.
        let wakers: Vec<Waker> = {
            let mut open = self.open.lock().expect("drain lock poisoned");
            open.wakers.values_mut().filter_map(Option::take).collect()
        };
        for waker in wakers {
            waker.wake();
        }
        loop {
            let closed = self.closed.notified();
            tokio::pin!(closed);
            closed.as_mut().enable();
            if self.count() == 0 {
                return;
            }
            closed.await;
        }
    }
}

/// One open connection, counted by its [`Drain`] until dropped.
struct Entry {
    drain: Arc<Drain>,
    id: u64,
}

impl Entry {
    /// `conn`, told to finish (by `finish`) once the drain starts.
    fn watch<C: Future>(self, conn: C, finish: fn(Pin<&mut C>)) -> Watched<C> {
        Watched {
            conn: Box::pin(conn),
            entry: self,
            finish,
            registered: false,
            told: false,
        }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let Ok(mut open) = self.drain.open.lock() else {
            return;
        };
        open.wakers.remove(&self.id);
        if open.wakers.is_empty() && self.drain.draining.load(Ordering::Acquire) {
            self.drain.closed.notify_waiters();
        }
    }
}

/// A connection future watched by a [`Drain`].
struct Watched<C> {
    conn: Pin<Box<C>>,
    entry: Entry,
    finish: fn(Pin<&mut C>),
    /// Its task's waker is with the drain.
    registered: bool,
    /// It has been told to finish.
    told: bool,
}

impl<C: Future> Future for Watched<C> {
    type Output = C::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let this = &mut *self;
        if !this.told {
            if !this.registered {
                // The connection's own task polls it, so this waker stays the one to wake.
                let mut open = this.entry.drain.open.lock().expect("drain lock poisoned");
                open.wakers.insert(this.entry.id, Some(cx.waker().clone()));
                this.registered = true;
            }
            if this.entry.drain.draining.load(Ordering::Acquire) {
                (this.finish)(this.conn.as_mut());
                this.told = true;
            }
        }
        this.conn.as_mut().poll(cx)
    }
}

type IdleSleep = Arc<Mutex<Option<Kept>>>;

/// hyper's timer for one connection's request heads (`timeouts.header_read`).
///
/// hyper asks its timer for a new sleep for every request head and drops it once the head is
/// in. With tokio's own timer that is a timer-wheel entry registered and removed per request,
/// each under the timer driver's lock. This timer keeps one tokio sleep per connection, not
/// moved to each head's later deadline ([`crate::timer`]), and not polled again while it is
/// registered with the connection's waker. So a head costs no timer work at all, where moving
/// the deadline and polling would cost about 300 instructions (callgrind, fixed 1,000
/// GET/s), and a new sleep per head about 700.
#[derive(Default)]
struct HeadTimer(IdleSleep);

/// The sleep hyper holds while it reads one head; the tokio sleep under it goes back to the
/// connection when hyper drops it.
struct HeadSleep {
    kept: Option<Kept>,
    deadline: tokio::time::Instant,
    home: IdleSleep,
}

impl hyper::rt::Timer for HeadTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep_until(self.now() + duration)
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        let deadline = tokio::time::Instant::from_std(deadline);
        let idle = self.0.lock().map(|mut idle| idle.take()).unwrap_or(None);
        let kept = match idle {
            Some(mut kept) => {
                kept.no_later_than(deadline);
                kept
            }
            None => Kept::new(deadline),
        };
        Box::pin(HeadSleep {
            kept: Some(kept),
            deadline,
            home: Arc::clone(&self.0),
        })
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: std::time::Instant) {
        if let Some(head) = sleep.as_mut().downcast_mut_pin::<HeadSleep>() {
            let head = head.get_mut();
            head.deadline = tokio::time::Instant::from_std(new_deadline);
            if let Some(kept) = head.kept.as_mut() {
                kept.no_later_than(head.deadline);
            }
        }
    }

    fn now(&self) -> std::time::Instant {
        // tokio's clock, so that a paused test clock governs the deadlines too.
        tokio::time::Instant::now().into_std()
    }
}

impl Future for HeadSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        match this.kept.as_mut() {
            Some(kept) => kept.poll_until(this.deadline, cx),
            None => Poll::Ready(()),
        }
    }
}

impl hyper::rt::Sleep for HeadSleep {}

impl Drop for HeadSleep {
    fn drop(&mut self) {
        if let (Some(kept), Ok(mut home)) = (self.kept.take(), self.home.lock()) {
            *home = Some(kept);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::rt::Timer;
    use std::future::poll_fn;

    fn pending(sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        sleep.as_mut().poll(&mut cx).is_pending()
    }

    async fn fires(sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>) {
        poll_fn(|cx| sleep.as_mut().poll(cx)).await;
    }

    /// Each head gets the deadline it asked for, though the tokio sleep under it is reused.
    #[tokio::test(start_paused = true)]
    async fn a_reused_sleep_fires_at_the_new_deadline_not_the_old() {
        let timer = HeadTimer::default();
        let start = timer.now();
        let mut first = timer.sleep_until(start + Duration::from_secs(10));
        assert!(pending(&mut first));
        drop(first);
        assert!(timer.0.lock().unwrap().is_some(), "the sleep went back");

        tokio::time::advance(Duration::from_secs(4)).await;
        let mut second = timer.sleep_until(timer.now() + Duration::from_secs(10));
        assert!(
            timer.0.lock().unwrap().is_none(),
            "the kept sleep is reused"
        );
        // Past the first deadline (10 s), short of the second (14 s).
        tokio::time::advance(Duration::from_secs(8)).await;
        assert!(pending(&mut second), "fired at the old deadline");
        tokio::time::advance(Duration::from_secs(2)).await;
        fires(&mut second).await;
        assert_eq!(timer.now() - start, Duration::from_secs(14));
    }

    /// A sleep that fired while kept (an upstream slower than `header_read`) is armed again.
    #[tokio::test(start_paused = true)]
    async fn a_kept_sleep_that_fired_is_armed_again() {
        let timer = HeadTimer::default();
        let start = timer.now();
        drop(timer.sleep_until(start + Duration::from_secs(1)));
        tokio::time::advance(Duration::from_secs(5)).await;
        let mut next = timer.sleep_until(timer.now() + Duration::from_secs(1));
        assert!(pending(&mut next), "a fired sleep was handed out as fired");
        fires(&mut next).await;
        assert_eq!(timer.now() - start, Duration::from_secs(6));
    }

    /// A stand-in connection: pending until told to finish, then done at its next poll.
    struct Conn {
        finishing: bool,
        polls: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Future for Conn {
        type Output = ();
        fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::SeqCst);
            if self.finishing {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        }
    }

    fn conn() -> (Conn, Arc<std::sync::atomic::AtomicUsize>) {
        let polls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let conn = Conn {
            finishing: false,
            polls: Arc::clone(&polls),
        };
        (conn, polls)
    }

    /// An idle connection (polled once, waiting) is woken, told to finish, and counted out;
    /// one accepted but never polled yet is told at its first poll; shutdown returns when
    /// both have closed.
    #[tokio::test]
    async fn shutdown_wakes_idle_connections_and_waits_for_them() {
        let drain = Arc::new(Drain::default());
        let (idle, idle_polls) = conn();
        let idle = tokio::spawn(drain.enter().watch(idle, |c| c.get_mut().finishing = true));
        while idle_polls.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        let (late, late_polls) = conn();
        let late = drain.enter().watch(late, |c| c.get_mut().finishing = true);
        assert_eq!(drain.count(), 2);

        let shutdown = {
            let drain = Arc::clone(&drain);
            tokio::spawn(async move { drain.shutdown().await })
        };
        tokio::time::timeout(Duration::from_secs(10), idle)
            .await
            .expect("the idle connection was not woken")
            .unwrap();
        assert_eq!(idle_polls.load(Ordering::SeqCst), 2);
        assert_eq!(drain.count(), 1);
        assert!(!shutdown.is_finished(), "returned with a connection open");
        tokio::time::timeout(Duration::from_secs(10), late)
            .await
            .expect("the late connection was not told to finish");
        assert_eq!(late_polls.load(Ordering::SeqCst), 1);
        tokio::time::timeout(Duration::from_secs(10), shutdown)
            .await
            .expect("shutdown did not return after the last connection closed")
            .unwrap();
        assert_eq!(drain.count(), 0);
    }

    /// Without a drain, polls leave the connection alone.
    #[tokio::test]
    async fn connections_run_on_until_the_drain() {
        let drain = Arc::new(Drain::default());
        let (c, polls) = conn();
        let mut watched = drain.enter().watch(c, |c| c.get_mut().finishing = true);
        for _ in 0..3 {
            assert!(pending_watched(&mut watched));
        }
        assert_eq!(polls.load(Ordering::SeqCst), 3);
        drop(watched);
        assert_eq!(drain.count(), 0);
    }

    fn pending_watched(w: &mut Watched<Conn>) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        Pin::new(w).poll(&mut cx).is_pending()
    }

    /// The first bytes, peeked: the preface is HTTP/2, anything that leaves it is HTTP/1, a
    /// part of it is not decided, a close before any byte is an error; nothing is taken.
    #[tokio::test]
    async fn sniff_tells_the_version_by_the_first_bytes_and_leaves_them() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        for (sent, expected) in [
            (&PREFACE[..], Some(Sniffed::Http2)),
            (&b"GET / HTTP/1.1\r\n"[..], Some(Sniffed::Http1)),
            (&b"PUT /a HTTP/1.1\r\n"[..], Some(Sniffed::Http1)),
            (&b"P"[..], Some(Sniffed::NotYet)),
            (&PREFACE[..23], Some(Sniffed::NotYet)),
            (&b""[..], None),
        ] {
            let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
            let (mut server, _) = listener.accept().await.unwrap();
            client.write_all(sent).await.unwrap();
            if sent.is_empty() {
                client.shutdown().await.unwrap();
            }
            let got = sniff(&server).await.ok();
            assert_eq!(got, expected, "{:?}", String::from_utf8_lossy(sent));
            let mut kept = vec![0u8; sent.len()];
            server.read_exact(&mut kept).await.unwrap();
            assert_eq!(kept, sent, "the bytes stay for the connection");
        }
    }

    /// hyper's `reset` moves the deadline of the sleep it holds.
    #[tokio::test(start_paused = true)]
    async fn reset_moves_the_deadline() {
        let timer = HeadTimer::default();
        let start = timer.now();
        let mut sleep = timer.sleep(Duration::from_secs(1));
        timer.reset(&mut sleep, start + Duration::from_secs(3));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(pending(&mut sleep));
        fires(&mut sleep).await;
        assert_eq!(timer.now() - start, Duration::from_secs(3));
    }
}
