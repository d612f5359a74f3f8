//! Whose fault a failure is: what an error or a refusal tells the reader to look at.

/// Whose fault a failure is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The request's: fix it before sending it again.
    Client,
    /// fencegate's own: its configuration, or a bug.
    Ours,
    /// The upstream service's: it failed or did not answer.
    Upstream,
    /// The store's, fence store or lease backend: it failed, refused or did not answer;
    /// retrying later may work.
    Store,
}

impl Fault {
    /// The name in logs.
    pub fn label(self) -> &'static str {
        match self {
            Fault::Client => "client",
            Fault::Ours => "ours",
            Fault::Upstream => "upstream",
            Fault::Store => "store",
        }
    }
}
