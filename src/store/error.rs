//! What went wrong in a fence store. Every variant keeps the detail its backend gave, and all
//! display the same way (`the fence store is unavailable: …`): the variant names what
//! happened, [`StoreError::fault`] whose fault it is.

use crate::conn::Failure;
use crate::fault::Fault;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store could not be reached: connecting, TLS, I/O (the embedded store's disk), a
    /// connection that broke.
    #[error("the fence store is unavailable: {0}")]
    Unreachable(String),
    /// No answer in time.
    #[error("the fence store is unavailable: {0}")]
    Timeout(String),
    /// The store answered with an error: authentication, permissions, a read-only replica, a
    /// quota, a value it cannot hold.
    #[error("the fence store is unavailable: {0}")]
    Refused(String),
    /// A stored value (a maximum, an idempotency record) or an answer that does not parse.
    #[error("the fence store is unavailable: {0}")]
    Corrupt(String),
    /// Racing writers kept changing what a write depends on, past its retries.
    #[error("the fence store is unavailable: {0}")]
    Contended(String),
    /// The configuration does not make a store: its url, its TLS files, a setting the store
    /// cannot honour (`fence.retention`).
    #[error("the fence store is unavailable: {0}")]
    Config(String),
    /// fencegate's own part of the store stopped (the embedded store's writer: a bug).
    #[error("the fence store is unavailable: {0}")]
    Internal(String),
}

impl StoreError {
    /// The error of a failed call to the store, as its client's error classifies
    /// (`conn`).
    pub(crate) fn new(failure: Failure, detail: impl Into<String>) -> Self {
        let detail = detail.into();
        match failure {
            Failure::Unreachable => StoreError::Unreachable(detail),
            Failure::Timeout => StoreError::Timeout(detail),
            Failure::Refused => StoreError::Refused(detail),
            Failure::Corrupt => StoreError::Corrupt(detail),
        }
    }

    /// No answer within `limit`, the caller's own bound (`timeouts.store`).
    pub fn no_answer_within(limit: std::time::Duration) -> Self {
        StoreError::Timeout(format!(
            "no answer within {}",
            crate::duration::display(limit)
        ))
    }

    /// The same error, its detail preceded by what fencegate was doing (`what: detail`).
    pub(crate) fn with_context(self, what: &str) -> Self {
        let wrap = |d: String| format!("{what}: {d}");
        match self {
            StoreError::Unreachable(d) => StoreError::Unreachable(wrap(d)),
            StoreError::Timeout(d) => StoreError::Timeout(wrap(d)),
            StoreError::Refused(d) => StoreError::Refused(wrap(d)),
            StoreError::Corrupt(d) => StoreError::Corrupt(wrap(d)),
            StoreError::Contended(d) => StoreError::Contended(wrap(d)),
            StoreError::Config(d) => StoreError::Config(wrap(d)),
            StoreError::Internal(d) => StoreError::Internal(wrap(d)),
        }
    }

    /// What the backend said, without the `the fence store is unavailable: ` of `Display`.
    pub fn detail(&self) -> &str {
        match self {
            StoreError::Unreachable(d)
            | StoreError::Timeout(d)
            | StoreError::Refused(d)
            | StoreError::Corrupt(d)
            | StoreError::Contended(d)
            | StoreError::Config(d)
            | StoreError::Internal(d) => d,
        }
    }

    /// The variant's name in logs.
    pub fn label(&self) -> &'static str {
        match self {
            StoreError::Unreachable(_) => "unreachable",
            StoreError::Timeout(_) => "timeout",
            StoreError::Refused(_) => "refused",
            StoreError::Corrupt(_) => "corrupt",
            StoreError::Contended(_) => "contended",
            StoreError::Config(_) => "config",
            StoreError::Internal(_) => "internal",
        }
    }

    pub fn fault(&self) -> Fault {
        match self {
            StoreError::Unreachable(_)
            | StoreError::Timeout(_)
            | StoreError::Refused(_)
            | StoreError::Corrupt(_)
            | StoreError::Contended(_) => Fault::Store,
            StoreError::Config(_) | StoreError::Internal(_) => Fault::Ours,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_displays_as_unavailable_with_its_detail() {
        for e in [
            StoreError::Unreachable("redis: Connection refused (os error 111)".into()),
            StoreError::Timeout("redis: Connection refused (os error 111)".into()),
            StoreError::Corrupt("redis: Connection refused (os error 111)".into()),
            StoreError::Config("redis: Connection refused (os error 111)".into()),
        ] {
            assert_eq!(
                e.to_string(),
                "the fence store is unavailable: redis: Connection refused (os error 111)"
            );
            assert_eq!(e.detail(), "redis: Connection refused (os error 111)");
        }
        assert_eq!(StoreError::new(Failure::Timeout, "x").label(), "timeout");
        assert_eq!(StoreError::Refused("x".into()).fault(), Fault::Store);
        assert_eq!(StoreError::Internal("x".into()).fault(), Fault::Ours);
    }
}
