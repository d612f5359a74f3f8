//! Compare-and-raises sent together: one call to the store raises several maxima.
//!
//! A PostgreSQL raise is a statement and a commit of its own, an etcd raise a transaction
//! through Raft, and most of what each costs (the server's per-call and per-commit work,
//! fencegate's encoding, the round trip's system calls) does not grow with how many maxima
//! the call raises. So the raises of a store whose remote takes batches
//! ([`Remote::batch_limit`]) go through a queue: up to [`CALLS`] calls are under way at once,
//! and a raise that finds them all busy waits, joined by every raise that arrives meanwhile;
//! the next call takes up to the remote's limit of them. A lone raise is sent at once, alone,
//! by the remote's own [`Remote::raise`]: batching changes nothing until the store is busy.
//!
//! A batch holds each resource once (one statement or transaction may not write a key
//! twice): a second raise of a resource already in the batch is sent alone at once, beside
//! the calls, as every raise was before they were batched, so that one busy resource is not
//! held to the queue's calls. Each raise is decided by its own rule, as it would be alone,
//! and answered on its own account:
//! one raise's verdict is never another's. When the server refuses the call, or answers what
//! does not parse, before any of it took effect, that may be one raise's doing (a resource id
//! it cannot hold): each raise is then sent alone, so that only those that fail alone are
//! refused. When the server cannot be reached, every raise in the call gets that error (fail
//! closed).
//!
//! A raise whose caller stopped waiting (its `timeouts.store` passed) before its batch was
//! sent is left out of it: it was answered `503` already, so it need not change the maximum.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Semaphore};

use super::Remote;
use crate::store::{ErrorKind, Rule, StoreError, Token, Verdict};

/// Calls under way at once; more raises wait in the queue and share the next call.
pub const CALLS: usize = 4;

/// One compare-and-raise as a batch carries it.
#[derive(Debug, Clone)]
pub struct Raise {
    /// The resource whose maximum it raises.
    pub resource: String,
    /// The token to raise it to.
    pub token: Token,
    /// The rule it is decided by (no [`Rule::floor`] for this token).
    pub rule: Rule,
}

type Answer = oneshot::Sender<Result<Verdict, StoreError>>;

/// The queue of one store's raises, and the task that sends them.
pub struct Batcher {
    queue: mpsc::UnboundedSender<(Raise, Answer)>,
}

impl Batcher {
    /// Starts the sending task on the current runtime. It ends once the batcher is dropped;
    /// calls under way are still answered.
    pub fn start<R: Remote>(remote: Arc<R>) -> Batcher {
        let (queue, waiting) = mpsc::unbounded_channel();
        tokio::spawn(drive(remote, waiting));
        Batcher { queue }
    }

    /// `raise`, sent alone if a call is free, else with whatever raises wait beside it.
    pub async fn raise(&self, raise: Raise) -> Result<Verdict, StoreError> {
        let (answer, answered) = oneshot::channel();
        self.queue
            .send((raise, answer))
            .map_err(|_| StoreError::unreachable("the raise queue has stopped"))?;
        answered
            .await
            .map_err(|_| StoreError::unreachable("the raise queue dropped a raise"))?
    }
}

/// Whenever a call is free, takes the waiting raises (up to the remote's limit, each
/// resource once) and sends them in one call.
async fn drive<R: Remote>(remote: Arc<R>, mut waiting: mpsc::UnboundedReceiver<(Raise, Answer)>) {
    let calls = Arc::new(Semaphore::new(CALLS));
    loop {
        let Ok(call) = Arc::clone(&calls).acquire_owned().await else {
            return;
        };
        let Some(first) = waiting.recv().await else {
            return;
        };
        // Read each time: a remote may stop taking batches.
        let limit = remote.batch_limit().max(1);
        let mut batch = vec![first];
        while batch.len() < limit {
            let Ok(next) = waiting.try_recv() else {
                break;
            };
            if next.1.is_closed() {
                continue;
            }
            if batch.iter().any(|(r, _)| r.resource == next.0.resource) {
                // One resource's raises cannot share a call: it goes alone, beside the calls,
                // as before raises were batched (one busy resource is not held to four calls).
                alone(&remote, next);
            } else {
                batch.push(next);
            }
        }
        batch.retain(|(_, answer)| !answer.is_closed());
        if batch.is_empty() {
            continue;
        }
        let remote = Arc::clone(&remote);
        tokio::spawn(async move {
            send(&remote, batch).await;
            drop(call);
        });
    }
}

/// Sends `raise` by the remote's own [`Remote::raise`], in a task of its own, outside the
/// calls the queue counts.
fn alone<R: Remote>(remote: &Arc<R>, waiting: (Raise, Answer)) {
    let remote = Arc::clone(remote);
    tokio::spawn(async move { raise_alone(&*remote, waiting).await });
}

/// `raise` by the remote's own [`Remote::raise`], its verdict sent to `answer`.
async fn raise_alone<R: Remote>(remote: &R, (raise, answer): (Raise, Answer)) {
    let verdict = remote.raise(&raise.resource, raise.token, raise.rule).await;
    let _ = answer.send(verdict);
}

/// One call for `batch`: the remote's own raise for one, its batch call for more.
async fn send<R: Remote>(remote: &Arc<R>, mut batch: Vec<(Raise, Answer)>) {
    if batch.len() == 1 {
        if let Some(one) = batch.pop() {
            raise_alone(&**remote, one).await;
        }
        return;
    }
    let (raises, answers): (Vec<Raise>, Vec<Answer>) = batch.into_iter().unzip();
    match remote.raise_many(&raises).await {
        Ok(verdicts) if verdicts.len() == raises.len() => {
            for (answer, verdict) in answers.into_iter().zip(verdicts) {
                let _ = answer.send(verdict);
            }
        }
        // Applied, but not answered raise by raise: each is refused, none sent again.
        Ok(verdicts) => {
            let e = StoreError::corrupt(format!(
                "{}: {} answers to {} raises",
                remote.kind(),
                verdicts.len(),
                raises.len()
            ));
            for answer in answers {
                let _ = answer.send(Err(e.clone()));
            }
        }
        // The server refused the call, or answered what does not parse, and none of it took
        // effect ([`Remote::raise_many`]): that may be one raise's doing (a resource id it
        // cannot hold), so each is sent again alone, all at once, and only the raises that
        // fail alone are refused.
        Err(e) if matches!(e.kind(), ErrorKind::Refused | ErrorKind::Corrupt) => {
            tracing::debug!(
                store = remote.kind(),
                error = %e,
                "a batch of raises was refused; raising each alone"
            );
            for waiting in raises.into_iter().zip(answers) {
                alone(remote, waiting);
            }
        }
        Err(e) => {
            for answer in answers {
                let _ = answer.send(Err(e.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EqualTokens;
    use crate::idempotency::{AttemptId, Claim, Record};
    use crate::store::shared::Claimed;
    use crate::store::BoxFuture;
    use std::sync::Mutex;

    /// A remote whose calls wait for a permit each, and which records each call's resources.
    struct Held {
        gate: Semaphore,
        calls: Mutex<Vec<Vec<String>>>,
    }

    impl Held {
        async fn call(&self, resources: Vec<String>) {
            self.gate.acquire().await.unwrap().forget();
            self.calls.lock().unwrap().push(resources);
        }
    }

    impl Remote for Held {
        fn raise<'a>(
            &'a self,
            resource: &'a str,
            token: Token,
            _rule: Rule,
        ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
            Box::pin(async move {
                self.call(vec![resource.to_owned()]).await;
                Ok(Verdict::Admitted {
                    previous: token.checked_sub(1u32.into()),
                })
            })
        }

        fn batch_limit(&self) -> usize {
            3
        }

        fn raise_many<'a>(
            &'a self,
            raises: &'a [Raise],
        ) -> BoxFuture<'a, Result<Vec<Result<Verdict, StoreError>>, StoreError>> {
            Box::pin(async move {
                self.call(raises.iter().map(|r| r.resource.clone()).collect())
                    .await;
                Ok(raises
                    .iter()
                    .map(|r| {
                        Ok(Verdict::Admitted {
                            previous: r.token.checked_sub(1u32.into()),
                        })
                    })
                    .collect())
            })
        }

        fn get<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
            unreachable!()
        }

        fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
            unreachable!()
        }

        fn begin_idempotent<'a>(
            &'a self,
            _: &'a str,
            _: &'a str,
            _: &'a Claim,
            _: Option<AttemptId>,
        ) -> BoxFuture<'a, Result<Claimed, StoreError>> {
            unreachable!()
        }

        fn finish_idempotent<'a>(
            &'a self,
            _: &'a str,
            _: &'a str,
            _: &'a Claim,
            _: &'a Record,
        ) -> BoxFuture<'a, Result<bool, StoreError>> {
            unreachable!()
        }

        fn kind(&self) -> &'static str {
            "held"
        }
    }

    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    /// While every call is busy, raises wait and share the next call: up to the remote's
    /// limit, each resource once (a second raise of one is sent alone), each answered with its
    /// own verdict; a raise whose caller stopped waiting is left out.
    #[tokio::test(flavor = "current_thread")]
    async fn waiting_raises_share_a_call_each_resource_once() {
        let remote = Arc::new(Held {
            gate: Semaphore::new(0),
            calls: Mutex::new(Vec::new()),
        });
        let batcher = Arc::new(Batcher::start(Arc::clone(&remote)));
        let raise = |resource: &str, token: u32| {
            let batcher = Arc::clone(&batcher);
            let raise = Raise {
                resource: resource.to_owned(),
                token: token.into(),
                rule: EqualTokens::Allow.into(),
            };
            tokio::spawn(async move { batcher.raise(raise).await })
        };
        // Every call taken, alone.
        let mut busy = Vec::new();
        for i in 0..CALLS as u32 {
            busy.push(raise(&format!("busy{i}"), i + 1));
            settle().await;
        }
        let a = raise("a", 10);
        settle().await;
        let gave_up = raise("gone", 5);
        settle().await;
        let a_again = raise("a", 11);
        settle().await;
        let b = raise("b", 20);
        settle().await;
        let c = raise("c", 30);
        settle().await;
        gave_up.abort();
        settle().await;
        remote.gate.add_permits(100);
        for (i, busy) in busy.into_iter().enumerate() {
            let previous = Some(Token::from(i as u32));
            assert_eq!(busy.await.unwrap().unwrap(), Verdict::Admitted { previous });
        }
        for (task, token) in [(a, 10u32), (a_again, 11), (b, 20), (c, 30)] {
            assert_eq!(
                task.await.unwrap().unwrap(),
                Verdict::Admitted {
                    previous: Some(Token::from(token - 1))
                }
            );
        }
        let calls = remote.calls.lock().unwrap().clone();
        let mut batches: Vec<Vec<String>> = calls[CALLS..].to_vec();
        batches.iter_mut().for_each(|b| b.sort());
        batches.sort();
        assert_eq!(
            batches,
            [vec!["a"], vec!["a", "b", "c"]]
                .map(|b| b.into_iter().map(String::from).collect::<Vec<_>>())
                .to_vec(),
            "the calls after the busy ones: {calls:?}"
        );
    }
}
