//! What went wrong in a lease backend. Every variant keeps the detail its backend gave, and
//! all display the same way (`the lease backend is unavailable: …`): the variant names what
//! happened, [`LeaseError::fault`] whose fault it is.

use crate::conn::Failure;
use crate::fault::Fault;

#[derive(Debug, Clone, thiserror::Error)]
pub enum LeaseError {
    /// The backend could not be reached: connecting, TLS, I/O (the embedded backend's disk),
    /// a connection that broke.
    #[error("the lease backend is unavailable: {0}")]
    Unreachable(String),
    /// No answer in time.
    #[error("the lease backend is unavailable: {0}")]
    Timeout(String),
    /// The backend answered with an error: authentication, permissions, a read-only replica,
    /// a quota, a lease it would not extend.
    #[error("the lease backend is unavailable: {0}")]
    Refused(String),
    /// A stored value (a token counter) or an answer that does not parse.
    #[error("the lease backend is unavailable: {0}")]
    Corrupt(String),
    /// The configuration does not make a backend: its url or path, its TLS files.
    #[error("the lease backend is unavailable: {0}")]
    Config(String),
    /// fencegate's own part of the backend failed (a database task that panicked: a bug).
    #[error("the lease backend is unavailable: {0}")]
    Internal(String),
}

impl LeaseError {
    /// The error of a failed call to the backend, as its client's error classifies
    /// (`conn`).
    pub(crate) fn new(failure: Failure, detail: impl Into<String>) -> Self {
        let detail = detail.into();
        match failure {
            Failure::Unreachable => LeaseError::Unreachable(detail),
            Failure::Timeout => LeaseError::Timeout(detail),
            Failure::Refused => LeaseError::Refused(detail),
            Failure::Corrupt => LeaseError::Corrupt(detail),
        }
    }

    /// What the backend said, without the `the lease backend is unavailable: ` of `Display`.
    pub fn detail(&self) -> &str {
        match self {
            LeaseError::Unreachable(d)
            | LeaseError::Timeout(d)
            | LeaseError::Refused(d)
            | LeaseError::Corrupt(d)
            | LeaseError::Config(d)
            | LeaseError::Internal(d) => d,
        }
    }

    /// The variant's name in logs.
    pub fn label(&self) -> &'static str {
        match self {
            LeaseError::Unreachable(_) => "unreachable",
            LeaseError::Timeout(_) => "timeout",
            LeaseError::Refused(_) => "refused",
            LeaseError::Corrupt(_) => "corrupt",
            LeaseError::Config(_) => "config",
            LeaseError::Internal(_) => "internal",
        }
    }

    pub fn fault(&self) -> Fault {
        match self {
            LeaseError::Unreachable(_)
            | LeaseError::Timeout(_)
            | LeaseError::Refused(_)
            | LeaseError::Corrupt(_) => Fault::Store,
            LeaseError::Config(_) | LeaseError::Internal(_) => Fault::Ours,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_displays_as_unavailable_with_its_detail() {
        for e in [
            LeaseError::Unreachable("redis: Connection refused (os error 111)".into()),
            LeaseError::Refused("redis: Connection refused (os error 111)".into()),
            LeaseError::Internal("redis: Connection refused (os error 111)".into()),
        ] {
            assert_eq!(
                e.to_string(),
                "the lease backend is unavailable: redis: Connection refused (os error 111)"
            );
            assert_eq!(e.detail(), "redis: Connection refused (os error 111)");
        }
        assert_eq!(LeaseError::new(Failure::Corrupt, "x").label(), "corrupt");
        assert_eq!(LeaseError::Timeout("x".into()).fault(), Fault::Store);
        assert_eq!(LeaseError::Config("x".into()).fault(), Fault::Ours);
    }
}
