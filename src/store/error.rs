//! What went wrong in a fence store: the one [`BackendError`](crate::conn::error::BackendError)
//! of the systems fencegate keeps state in, naming the store (`the fence store is
//! unavailable: …`). Its [`Kind`](crate::conn::error::Kind) says what happened,
//! [`StoreError::fault`] whose fault it is, and its source the error it came from.

/// A failure of the fence store.
pub type StoreError = crate::conn::error::BackendError<crate::conn::error::Store>;
