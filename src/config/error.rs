//! Why a configuration was refused: the file could not be read, a `${NAME}` could not be
//! expanded, a value is wrong where it is written (located), or sections disagree.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use super::env::EnvError;
use super::limits::MAX_TIMEOUT_TEXT;
use crate::duration::display;

/// A configuration file that cannot be used, displayed with its path.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Invalid { path: PathBuf, source: ParseError },
}

/// Configuration text that does not parse into a [`super::Config`].
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error(transparent)]
    Env(#[from] EnvError),
    /// A value, field or section is wrong where it is written: the message names its field
    /// path, line and column.
    #[error(transparent)]
    Located(#[from] super::located::LocatedError),
    /// Each section is valid, but together they are not: there is no one line to point at.
    #[error(transparent)]
    Sections(#[from] SectionsError),
}

/// Sections that disagree with each other.
#[derive(Debug, thiserror::Error)]
pub enum SectionsError {
    #[error(
        "missing field `upstream`: the service the sidecar forwards to, such as \
         `upstream: http://127.0.0.1:8080` (an in-process fence, FenceLayer, needs none: \
         read its config with Config::parse_fence)"
    )]
    NoUpstream,
    #[error("routes[{route}].barrier_timeout must be at most {}", MAX_TIMEOUT_TEXT)]
    BarrierTimeoutTooLong { route: usize },
    #[error(
        "routes[{route}].idempotency: true needs the top-level `idempotency` section and a \
         fenced route (`fence: true`)"
    )]
    IdempotentRouteWithoutSection { route: usize },
    #[error("idempotency.header and token.header must differ")]
    IdempotencyHeaderIsTokenHeader,
    #[error("idempotency.max_request_bytes must be greater than zero")]
    NoIdempotentRequestBytes,
    #[error("idempotency.window must be greater than zero")]
    ZeroIdempotencyWindow,
    #[error("idempotency.window must be at most {}", MAX_WINDOW_TEXT)]
    IdempotencyWindowTooLong,
    #[error(
        "idempotency.window is required when no `leases` section gives a TTL to derive it \
         from (ttl + p99_work)"
    )]
    NoIdempotencyWindow,
    #[error(
        "fence.authority: leases checks tokens against the lease backend configured in the \
         `leases` section, which is missing"
    )]
    AuthorityWithoutLeases,
    #[error("egress: attaching tokens needs the `leases` section")]
    EgressWithoutLeases,
    #[error(
        "fence.retention: {shown} is safe only with `fence.authority: leases`: without it a \
         forgotten maximum is the only thing between a stale token and the upstream, and a \
         writer that wakes more than {shown} after its last write would be admitted; with it, \
         the lease backend refuses every token below its latest grant whatever the store \
         remembers",
        shown = display(*period)
    )]
    RetentionWithoutAuthority { period: Duration },
    #[error(
        "fence.retention: {shown} is unsafe with `token.equal: reject`: the lease backend admits \
         its latest grant's token, so a repeat of that token is refused only by the recorded \
         maximum, and once the maximum is forgotten ({shown} after its last raise) a replica \
         would admit the repeat; use `token.equal: allow`, or keep every maximum (no \
         `fence.retention`)",
        shown = display(*period)
    )]
    RetentionWithEqualReject { period: Duration },
    #[error(
        "fence.retention must be at least 1h (it is {}): a maximum may be forgotten only long \
         after the grant of its token is known to every fencegate",
        display(*period)
    )]
    RetentionTooShort { period: Duration },
    #[error(
        "fence.retention is not offered by the `memory` store (tests and demos: it forgets \
         everything when the process ends); use `embedded`, `redis` or `postgres`"
    )]
    RetentionOnMemory,
    #[error(
        "fence.retention is not offered by the `etcd` store; use `embedded`, `redis` or \
         `postgres`, or keep the maxima and size etcd for them (see the docs' Memory and \
         sizing)"
    )]
    RetentionOnEtcd,
    #[error("`{first}` and `{second}` are both {address}")]
    SharedAddress {
        first: &'static str,
        second: &'static str,
        address: SocketAddr,
    },
}

/// [`super::MAX_WINDOW`], as the refusal writes it.
const MAX_WINDOW_TEXT: &str = "30days";
