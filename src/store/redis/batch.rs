//! Compare-and-raises sent together: one script call raises several maxima.
//!
//! Concurrent raises of one fence share the connection already (the multiplexed connection
//! pipelines them), but each is a script call of its own: Redis runs the script once per raise
//! and fencegate encodes, routes and decodes one command per raise, and with `replicas` each
//! admitted raise waits on a `WAIT` of its own. Against one server (or the primary the
//! Sentinels name), raises go through a queue instead: up to [`MAX_IN_FLIGHT`] calls are under
//! way at once, and a raise that finds them all busy waits in the queue, where every raise
//! that arrives meanwhile joins it; the next call takes up to [`MAX_BATCH`] of them. A lone
//! raise is sent at once, as before; under load, one call and one `WAIT` serve many.
//!
//! The script raises each maximum in queue order, each by the rule it would follow alone
//! ([`super::RAISE`]), so two raises of one resource in a batch are decided one after the
//! other, as two pipelined calls were. A batch's keys may lie in different Cluster slots, so a
//! Redis Cluster gets one raise per call, routed to its key's node.
//!
//! A raise whose caller stopped waiting (its `timeouts.store` passed) before its batch was
//! sent is left out of it: it was answered `503` already, so it need not change the maximum.

use std::sync::Arc;

use redis::Script;
use tokio::sync::{mpsc, oneshot, Semaphore};

use super::{unavailable, StoreError};
use crate::conn::redis::{RedisClient, Unconfirmed};

/// Raise script calls under way at once; more raises wait in the queue and share the next.
const MAX_IN_FLIGHT: usize = 4;
/// Raises in one script call at most.
const MAX_BATCH: usize = 64;

/// One compare-and-raise, as the script takes it.
pub(super) struct Raise {
    /// The maximum's key.
    pub key: String,
    /// The token, canonical decimal.
    pub token: String,
    /// The expiry to give a raised maximum, in ms (0: none).
    pub aging_ms: u64,
    /// Write an equal maximum again so that `WAIT` covers it (replicas and equal tokens).
    pub rewrite_equal: bool,
    /// Equal tokens pass: an equal maximum counts as admitted.
    pub equal_passes: bool,
    /// The lowest maximum the token may be raised from (`token.max_step`; '' for none).
    pub floor: String,
}

/// The script's answer to one raise, and for an admitted one what the replicas said.
#[derive(Debug)]
pub(super) struct Answer {
    /// The maximum before ('' for none).
    pub previous: String,
    /// 1 raised, 0 not (the token is at most the maximum), 2 too far above it.
    pub code: u8,
    /// For an admitted raise, whether its replicas acknowledged it.
    pub lag: Result<(), Unconfirmed>,
}

impl Raise {
    fn admitted(&self, previous: &str, code: u8) -> bool {
        code == 1 || (self.equal_passes && previous == self.token)
    }
}

/// Sends `batch` in one script call on the connection of its first key's node, and one `WAIT`
/// after it if any was admitted.
pub(super) async fn send(
    conn: &RedisClient,
    script: &Script,
    batch: &[Raise],
) -> Result<Vec<Answer>, StoreError> {
    let Some(first) = batch.first() else {
        return Ok(Vec::new());
    };
    conn.call(&first.key, |mut s| async move {
        let mut call = script.prepare_invoke();
        for r in batch {
            call.key(&r.key)
                .arg(&r.token)
                .arg(r.aging_ms)
                .arg(if r.rewrite_equal { "1" } else { "0" })
                .arg(&r.floor);
        }
        let replies: Vec<(String, u8)> = call.invoke_async(&mut s.conn).await?;
        let any = batch
            .iter()
            .zip(&replies)
            .any(|(r, (previous, code))| r.admitted(previous, *code));
        let lag = if any { s.replicated().await? } else { Ok(()) };
        Ok((replies, lag))
    })
    .await
    .map_err(unavailable)
    .and_then(|(replies, lag)| {
        if replies.len() != batch.len() {
            return Err(StoreError::corrupt(format!(
                "redis: {} answers to {} raises",
                replies.len(),
                batch.len()
            )));
        }
        Ok(batch
            .iter()
            .zip(replies)
            .map(|(r, (previous, code))| Answer {
                lag: if r.admitted(&previous, code) {
                    lag.clone()
                } else {
                    Ok(())
                },
                previous,
                code,
            })
            .collect())
    })
}

type Waiting = (Raise, oneshot::Sender<Result<Answer, StoreError>>);

/// The queue of one fence's raises to one server, and the task that sends them.
pub(super) struct Batcher {
    queue: mpsc::UnboundedSender<Waiting>,
}

impl Batcher {
    /// Starts the sending task (on the current runtime); it ends when the batcher is dropped
    /// and every call under way has been answered.
    pub(super) fn start(conn: Arc<RedisClient>, script: Script) -> Batcher {
        let (queue, waiting) = mpsc::unbounded_channel();
        tokio::spawn(drive(conn, script, waiting));
        Batcher { queue }
    }

    /// `raise`, sent with whatever raises are waiting when a call is free.
    pub(super) async fn raise(&self, raise: Raise) -> Result<Answer, StoreError> {
        let (answer, answered) = oneshot::channel();
        self.queue
            .send((raise, answer))
            .map_err(|_| StoreError::unreachable("redis: the raise queue has stopped"))?;
        answered
            .await
            .map_err(|_| StoreError::unreachable("redis: the raise queue dropped a raise"))?
    }
}

/// Takes the waiting raises whenever a call is free, up to [`MAX_BATCH`] per call.
async fn drive(
    conn: Arc<RedisClient>,
    script: Script,
    mut waiting: mpsc::UnboundedReceiver<Waiting>,
) {
    let calls = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    loop {
        let Ok(call) = Arc::clone(&calls).acquire_owned().await else {
            return;
        };
        let Some(first) = waiting.recv().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match waiting.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        batch.retain(|(_, answer)| !answer.is_closed());
        if batch.is_empty() {
            continue;
        }
        let (conn, script) = (Arc::clone(&conn), script.clone());
        tokio::spawn(async move {
            let (raises, answers): (Vec<Raise>, Vec<_>) = batch.into_iter().unzip();
            match send(&conn, &script, &raises).await {
                Ok(replies) => {
                    for (answer, reply) in answers.into_iter().zip(replies) {
                        let _ = answer.send(Ok(reply));
                    }
                }
                Err(e) => {
                    for answer in answers {
                        let _ = answer.send(Err(e.clone()));
                    }
                }
            }
            drop(call);
        });
    }
}
