//! One error for the systems fencegate keeps its state in: the fence store
//! ([`crate::store::StoreError`]) and the lease backend ([`crate::lease::LeaseError`]) are
//! the same [`BackendError`], told apart by the [`System`] they name. Each says what happened
//! (its [`Kind`]), the backend's own words (its detail), and keeps the error it came from,
//! when there is one (its [`std::error::Error::source`]). All display the same way:
//! `the fence store is unavailable: <detail>`.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use super::Failure;
use crate::fault::Fault;

/// Which system an error is about: what its message begins with.
pub trait System: 'static {
    /// `the fence store is unavailable`, say.
    const UNAVAILABLE: &'static str;
}

/// The fence store.
#[derive(Debug)]
pub enum Store {}

impl System for Store {
    const UNAVAILABLE: &'static str = "the fence store is unavailable";
}

/// The lease backend.
#[derive(Debug)]
pub enum Leases {}

impl System for Leases {
    const UNAVAILABLE: &'static str = "the lease backend is unavailable";
}

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Not reached: connecting, TLS, I/O (an embedded file's disk), a connection that broke.
    Unreachable,
    /// No answer in time.
    Timeout,
    /// The backend answered with an error: authentication, permissions, a read-only replica,
    /// a quota, a value it cannot hold, a lease it would not extend.
    Refused,
    /// A stored value (a maximum, a token counter, an idempotency record) or an answer that
    /// does not parse.
    Corrupt,
    /// Racing writers kept changing what a write depends on, past its retries.
    Contended,
    /// The configuration does not make a backend: its url or path, its TLS files, a setting
    /// it cannot honour.
    Config,
    /// fencegate's own part of the backend stopped (a writer thread, a task that panicked: a
    /// bug).
    Internal,
}

impl Kind {
    /// Its name in logs and metrics (`store_error`).
    pub fn label(self) -> &'static str {
        match self {
            Kind::Unreachable => "unreachable",
            Kind::Timeout => "timeout",
            Kind::Refused => "refused",
            Kind::Corrupt => "corrupt",
            Kind::Contended => "contended",
            Kind::Config => "config",
            Kind::Internal => "internal",
        }
    }

    /// Whose fault it is: the backend's, or ours (a setup to fix, a bug).
    pub fn fault(self) -> Fault {
        match self {
            Kind::Unreachable | Kind::Timeout | Kind::Refused | Kind::Corrupt | Kind::Contended => {
                Fault::Store
            }
            Kind::Config | Kind::Internal => Fault::Ours,
        }
    }
}

impl From<Failure> for Kind {
    fn from(failure: Failure) -> Kind {
        match failure {
            Failure::Unreachable => Kind::Unreachable,
            Failure::Timeout => Kind::Timeout,
            Failure::Refused => Kind::Refused,
            Failure::Corrupt => Kind::Corrupt,
        }
    }
}

/// A failure of the fence store or the lease backend (see the [module docs](self)).
pub struct BackendError<S: System> {
    kind: Kind,
    detail: String,
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
    system: PhantomData<fn() -> S>,
}

impl<S: System> BackendError<S> {
    /// An error of `kind`, in the backend's words.
    pub fn of(kind: Kind, detail: impl Into<String>) -> Self {
        BackendError {
            kind,
            detail: detail.into(),
            source: None,
            system: PhantomData,
        }
    }

    /// The error of a failed call, as its client's error classifies (`conn`).
    pub(crate) fn new(failure: Failure, detail: impl Into<String>) -> Self {
        Self::of(failure.into(), detail)
    }

    /// A [`Kind::Unreachable`] error, in the backend's words.
    pub fn unreachable(detail: impl Into<String>) -> Self {
        Self::of(Kind::Unreachable, detail)
    }

    /// A [`Kind::Timeout`] error, in the backend's words.
    pub fn timeout(detail: impl Into<String>) -> Self {
        Self::of(Kind::Timeout, detail)
    }

    /// A [`Kind::Refused`] error, in the backend's words.
    pub fn refused(detail: impl Into<String>) -> Self {
        Self::of(Kind::Refused, detail)
    }

    /// A [`Kind::Corrupt`] error, in the backend's words.
    pub fn corrupt(detail: impl Into<String>) -> Self {
        Self::of(Kind::Corrupt, detail)
    }

    /// A [`Kind::Contended`] error, in the backend's words.
    pub fn contended(detail: impl Into<String>) -> Self {
        Self::of(Kind::Contended, detail)
    }

    /// A [`Kind::Config`] error, in the backend's words.
    pub fn config(detail: impl Into<String>) -> Self {
        Self::of(Kind::Config, detail)
    }

    /// A [`Kind::Config`] error saying what `source` says, and keeping it as its source.
    pub(crate) fn config_from(source: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::config(source.to_string()).with_source(source)
    }

    /// A [`Kind::Internal`] error, in the backend's words.
    pub fn internal(detail: impl Into<String>) -> Self {
        Self::of(Kind::Internal, detail)
    }

    /// No answer within `limit`, the caller's own bound (`timeouts.store`).
    pub fn no_answer_within(limit: std::time::Duration) -> Self {
        Self::timeout(format!(
            "no answer within {}",
            crate::duration::display(limit)
        ))
    }

    /// The same error, keeping `source`, the error it came from.
    pub(crate) fn with_source(
        mut self,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        self.source = Some(Arc::new(source));
        self
    }

    /// The same error, its detail preceded by what fencegate was doing (`what: detail`).
    pub(crate) fn with_context(mut self, what: &str) -> Self {
        self.detail = format!("{what}: {}", self.detail);
        self
    }

    /// What happened.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// What the backend said, without the `the fence store is unavailable: ` of `Display`.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The kind's name in logs.
    pub fn label(&self) -> &'static str {
        self.kind.label()
    }

    /// Whose fault it is: the backend's, or ours (a setup to fix, a bug).
    pub fn fault(&self) -> Fault {
        self.kind.fault()
    }
}

impl<S: System> Clone for BackendError<S> {
    fn clone(&self) -> Self {
        BackendError {
            kind: self.kind,
            detail: self.detail.clone(),
            source: self.source.clone(),
            system: PhantomData,
        }
    }
}

impl<S: System> fmt::Debug for BackendError<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendError")
            .field("system", &S::UNAVAILABLE)
            .field("kind", &self.kind)
            .field("detail", &self.detail)
            .field("source", &self.source)
            .finish()
    }
}

impl<S: System> fmt::Display for BackendError<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", S::UNAVAILABLE, self.detail)
    }
}

impl<S: System> std::error::Error for BackendError<S> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use super::*;

    type StoreError = BackendError<Store>;
    type LeaseError = BackendError<Leases>;

    #[test]
    fn every_kind_displays_as_unavailable_with_its_detail() {
        let words = "redis: Connection refused (os error 111)";
        for e in [
            StoreError::unreachable(words),
            StoreError::timeout(words),
            StoreError::corrupt(words),
            StoreError::config(words),
        ] {
            assert_eq!(
                e.to_string(),
                format!("the fence store is unavailable: {words}")
            );
            assert_eq!(e.detail(), words);
        }
        for e in [LeaseError::unreachable(words), LeaseError::internal(words)] {
            assert_eq!(
                e.to_string(),
                format!("the lease backend is unavailable: {words}")
            );
        }
        assert_eq!(StoreError::new(Failure::Timeout, "x").label(), "timeout");
        assert_eq!(LeaseError::new(Failure::Corrupt, "x").label(), "corrupt");
        assert_eq!(StoreError::refused("x").fault(), Fault::Store);
        assert_eq!(LeaseError::timeout("x").fault(), Fault::Store);
        assert_eq!(StoreError::internal("x").fault(), Fault::Ours);
        assert_eq!(LeaseError::config("x").fault(), Fault::Ours);
    }

    #[test]
    fn the_error_it_came_from_is_kept_as_its_source_and_in_context() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let e = StoreError::unreachable("redis: reset by peer")
            .with_source(io)
            .with_context("raising account:42");
        assert_eq!(e.detail(), "raising account:42: redis: reset by peer");
        assert_eq!(e.kind(), Kind::Unreachable);
        let source = e.source().expect("kept");
        assert_eq!(source.to_string(), "reset by peer");
        assert!(e.clone().source().is_some(), "a clone keeps it too");
    }
}
