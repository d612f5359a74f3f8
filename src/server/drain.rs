//! Graceful drain: the open connections, and the signal that tells them to finish their
//! current requests and close.

use crate::sync::Locked;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

/// The open connections, and the signal that tells them to finish.
///
/// hyper-util's `GracefulShutdown` does the same with a watch channel that every connection
/// polls on every wake-up (callgrind: about 400 instructions of a proxied GET). Here a
/// connection registers its task's waker once, on its first poll, and each poll reads one flag.
#[derive(Default)]
pub(super) struct Drain {
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
    pub(super) fn enter(self: &Arc<Self>) -> Entry {
        let mut open = self.open.locked();
        let id = open.next;
        open.next += 1;
        open.wakers.insert(id, None);
        Entry {
            drain: Arc::clone(self),
            id,
        }
    }

    pub(super) fn count(&self) -> usize {
        self.open.locked().wakers.len()
    }

    /// Tells every open connection to finish its current request and close (HTTP/1 keep-alive
    /// off, HTTP/2 GOAWAY), and waits until all have.
    pub(super) async fn shutdown(&self) {
        self.draining.store(true, Ordering::Release);
        // Taken under the lock, woken after it: a connection registering now either is in
        // this list or, registering after it, reads the flag set above.
        let wakers: Vec<Waker> = {
            let mut open = self.open.locked();
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
pub(super) struct Entry {
    drain: Arc<Drain>,
    id: u64,
}

impl Entry {
    /// `conn`, told to finish (by `finish`) once the drain starts.
    pub(super) fn watch<C: Future>(self, conn: C, finish: fn(Pin<&mut C>)) -> Watched<C> {
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
pub(super) struct Watched<C> {
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
                let mut open = this.entry.drain.open.locked();
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

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
}
