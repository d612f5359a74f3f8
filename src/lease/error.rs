//! What went wrong in a lease backend: the one
//! [`BackendError`](crate::conn::error::BackendError) of the systems fencegate keeps state in,
//! naming the lease backend (`the lease backend is unavailable: …`). Its
//! [`Kind`](crate::conn::error::Kind) says what happened, [`LeaseError::fault`] whose fault it
//! is, and its source the error it came from.

/// A failure of the lease backend.
pub type LeaseError = crate::conn::error::BackendError<crate::conn::error::Leases>;
