//! The toy ledger: the protected downstream. It trusts whatever reaches it (it does no token
//! check of its own) and appends every committed write to its log, one serial log per
//! resource (like a row lock: a slow commit delays the later writes of its resource), in
//! arrival order. A write is committed once its body has fully arrived, even if the client
//! has gone away meanwhile: a commit slower than the proxy's upstream timeout still lands.
//! Each commit records the `Idempotency-Key` the write carried, so that a key applied twice
//! shows in the log.

use std::collections::HashMap;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencegate::body::ProxyBody;
use fencegate::server::{serve, ServerSettings};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};

use crate::checker::{Commit, Micros};
use crate::clock::Clock;

/// A write handed to a resource's committer.
struct Job {
    resource: String,
    token: u64,
    writer: String,
    op: String,
    key: Option<String>,
    /// Committed only after this delay (the slow-upstream fault).
    slow: Option<Duration>,
    done: oneshot::Sender<u64>,
}

/// The next `remaining` arrivals (on resources starting with `only`, if set) commit after
/// `delay`.
#[derive(Default)]
struct SlowPlan {
    remaining: usize,
    delay: Duration,
    only: Option<String>,
}

pub struct Ledger {
    pub addr: SocketAddr,
    state: Arc<State>,
}

struct State {
    clock: Clock,
    /// Per resource, the committer's queue.
    queues: Mutex<HashMap<String, mpsc::UnboundedSender<Job>>>,
    log: Mutex<Vec<(Commit, Micros)>>,
    /// When each op's full request arrived (an upper bound of its admission by the fence).
    arrivals: Mutex<HashMap<String, Micros>>,
    /// Bumped on every commit, for waiters.
    committed: watch::Sender<u64>,
    slow: Mutex<SlowPlan>,
    /// Slow writes arrived (their commit is under way) and committed, so far.
    slow_arrived: watch::Sender<usize>,
    slow_done: watch::Sender<usize>,
    slow_delay: Duration,
    file: Mutex<std::fs::File>,
}

impl Ledger {
    pub async fn start(clock: Clock, slow_delay: Duration, log_path: &std::path::Path) -> Ledger {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State {
            clock,
            queues: Mutex::default(),
            log: Mutex::default(),
            arrivals: Mutex::default(),
            committed: watch::channel(0).0,
            slow: Mutex::default(),
            slow_arrived: watch::channel(0).0,
            slow_done: watch::channel(0).0,
            slow_delay,
            file: Mutex::new(std::fs::File::create(log_path).unwrap()),
        });
        let handler_state = Arc::clone(&state);
        tokio::spawn(serve(
            listener,
            ServerSettings {
                tls: None,
                header_read: Duration::from_secs(5),
                max_header_bytes: 64 * 1024,
                max_headers: 100,
                max_connections: 4096,
                drain: Duration::from_secs(1),
            },
            move |req, _peer| {
                let state = Arc::clone(&handler_state);
                async move { Ok(state.handle(req).await) }
            },
            std::future::pending(),
        ));
        Ledger { addr, state }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The commit log so far: commits with their commit instants.
    pub fn log(&self) -> Vec<(Commit, Micros)> {
        self.state.log.lock().unwrap().clone()
    }

    pub fn arrivals(&self) -> HashMap<String, Micros> {
        self.state.arrivals.lock().unwrap().clone()
    }

    /// Commits the next `n` arriving writes only after the slow delay.
    pub fn arm_slow(&self, n: usize) -> usize {
        self.arm_slow_on(n, self.state.slow_delay, None).1
    }

    /// Commits the next `n` writes arriving on resources that start with `only` (any, if
    /// `None`) after `delay`. Returns the slow writes arrived and committed so far.
    pub fn arm_slow_on(&self, n: usize, delay: Duration, only: Option<&str>) -> (usize, usize) {
        *self.state.slow.lock().unwrap() = SlowPlan {
            remaining: n,
            delay,
            only: only.map(str::to_owned),
        };
        (
            *self.state.slow_arrived.borrow(),
            *self.state.slow_done.borrow(),
        )
    }

    /// Waits until `target` slow writes have arrived in total (their commit is under way),
    /// bounded.
    pub async fn slow_arrivals_reach(&self, target: usize, within: Duration) -> bool {
        let mut rx = self.state.slow_arrived.subscribe();
        let reached = tokio::time::timeout(within, rx.wait_for(|&n| n >= target))
            .await
            .is_ok();
        reached
    }

    /// Waits until `target` slow commits have been made in total, bounded.
    pub async fn slow_commits_reach(&self, target: usize, within: Duration) -> bool {
        let mut rx = self.state.slow_done.subscribe();
        let reached = tokio::time::timeout(within, rx.wait_for(|&n| n >= target))
            .await
            .is_ok();
        reached
    }

    /// Waits until a commit satisfying `pred` exists, bounded. Explicit signal: every commit
    /// bumps a watch channel.
    pub async fn wait_commit(&self, within: Duration, pred: impl Fn(&Commit) -> bool) -> bool {
        let mut rx = self.state.committed.subscribe();
        let found = tokio::time::timeout(within, async {
            loop {
                if self.state.log.lock().unwrap().iter().any(|(c, _)| pred(c)) {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        });
        found.await.is_ok()
    }
}

impl State {
    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<ProxyBody> {
        let reply = |status: StatusCode, text: String| {
            let mut r = Response::new(ProxyBody::local(text));
            *r.status_mut() = status;
            r
        };
        let Some(id) = req.uri().path().strip_prefix("/accounts/") else {
            return reply(StatusCode::NOT_FOUND, "no such path\n".into());
        };
        let resource = format!("account:{id}");
        let header = |name: &str| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let token = header("fencing-token").and_then(|t| t.parse::<u64>().ok());
        let (writer, op) = (header("x-writer"), header("x-op"));
        let key = header("idempotency-key");
        let (Some(token), Some(writer), Some(op)) = (token, writer, op) else {
            return reply(
                StatusCode::BAD_REQUEST,
                "token, writer and op are required\n".into(),
            );
        };
        // Committed only once the whole body is here.
        if req.into_body().collect().await.is_err() {
            return reply(StatusCode::BAD_REQUEST, "incomplete body\n".into());
        }
        let (done, committed) = oneshot::channel();
        let slow = {
            let mut plan = self.slow.lock().unwrap();
            let applies =
                plan.remaining > 0 && plan.only.as_deref().is_none_or(|p| resource.starts_with(p));
            applies.then(|| {
                plan.remaining -= 1;
                plan.delay
            })
        };
        if slow.is_some() {
            self.slow_arrived.send_modify(|n| *n += 1);
        }
        {
            // Arrival and enqueue under one lock: the queue order is the arrival order.
            let mut queues = self.queues.lock().unwrap();
            self.arrivals
                .lock()
                .unwrap()
                .insert(op.clone(), self.clock.now());
            let queue = queues.entry(resource.clone()).or_insert_with(|| {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(Arc::clone(&self).committer(rx));
                tx
            });
            let _ = queue.send(Job {
                resource,
                token,
                writer,
                op,
                key,
                slow,
                done,
            });
        }
        match committed.await {
            Ok(seq) => reply(StatusCode::OK, format!("committed #{seq}\n")),
            Err(_) => reply(StatusCode::INTERNAL_SERVER_ERROR, "lost\n".into()),
        }
    }

    /// Applies one resource's writes, one at a time, in arrival order.
    async fn committer(self: Arc<Self>, mut jobs: mpsc::UnboundedReceiver<Job>) {
        while let Some(job) = jobs.recv().await {
            if let Some(delay) = job.slow {
                // The fault itself: an upstream slower than the proxy's timeout (or, for the
                // stalled store, than the writer's patience).
                tokio::time::sleep(delay).await;
            }
            let seq = {
                let mut log = self.log.lock().unwrap();
                let seq = log.len() as u64;
                let commit = Commit {
                    seq,
                    resource: job.resource,
                    token: job.token,
                    writer: job.writer,
                    op: job.op,
                    key: job.key,
                };
                let _ = writeln!(
                    self.file.lock().unwrap(),
                    "{}\t{}\t{}\t{}\t{}\t{}",
                    commit.seq,
                    commit.resource,
                    commit.token,
                    commit.writer,
                    commit.op,
                    commit.key.as_deref().unwrap_or("-")
                );
                log.push((commit, self.clock.now()));
                seq
            };
            if job.slow.is_some() {
                self.slow_done.send_modify(|n| *n += 1);
            }
            self.committed.send_modify(|n| *n += 1);
            let _ = job.done.send(seq);
        }
    }
}
