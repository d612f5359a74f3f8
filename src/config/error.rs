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
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file's path, as given.
        path: PathBuf,
        /// Why it could not be read.
        source: std::io::Error,
    },
    /// The file was read, and is not a valid configuration.
    #[error("{path}: {source}")]
    Invalid {
        /// The file's path, as given.
        path: PathBuf,
        /// What is wrong with it.
        source: ParseError,
    },
}

/// Configuration text that does not parse into a [`super::Config`].
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// A `${NAME}` that cannot be expanded.
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
    /// No `upstream`, which the sidecar needs ([`super::Config::parse`]).
    #[error(
        "missing field `upstream`: the service the sidecar forwards to, such as \
         `upstream: http://127.0.0.1:8080` (an in-process fence, FenceLayer, needs none: \
         read its config with Config::parse_fence)"
    )]
    NoUpstream,
    /// A route's `barrier_timeout` is above [`super::MAX_TIMEOUT`].
    #[error("routes[{route}].barrier_timeout must be at most {}", MAX_TIMEOUT_TEXT)]
    BarrierTimeoutTooLong {
        /// The route's index in `routes`.
        route: usize,
    },
    /// A route says `idempotency: true` without the `idempotency` section, or with
    /// `fence: false`.
    #[error(
        "routes[{route}].idempotency: true needs the top-level `idempotency` section and a \
         fenced route (`fence: true`)"
    )]
    IdempotentRouteWithoutSection {
        /// The route's index in `routes`.
        route: usize,
    },
    /// `idempotency.header` is the token header.
    #[error("idempotency.header and token.header must differ")]
    IdempotencyHeaderIsTokenHeader,
    /// `idempotency.max_request_bytes` is 0.
    #[error("idempotency.max_request_bytes must be greater than zero")]
    NoIdempotentRequestBytes,
    /// `idempotency.window` is zero.
    #[error("idempotency.window must be greater than zero")]
    ZeroIdempotencyWindow,
    /// `idempotency.window` is above [`super::MAX_WINDOW`].
    #[error("idempotency.window must be at most {}", MAX_WINDOW_TEXT)]
    IdempotencyWindowTooLong,
    /// No `idempotency.window`, and no `leases` section whose TTL it could follow.
    #[error(
        "idempotency.window is required when no `leases` section gives a TTL to derive it \
         from (ttl + p99_work)"
    )]
    NoIdempotencyWindow,
    /// `fence.authority: leases` without the `leases` section.
    #[error(
        "fence.authority: leases checks tokens against the lease backend configured in the \
         `leases` section, which is missing"
    )]
    AuthorityWithoutLeases,
    /// An `egress` section without the `leases` section.
    #[error("egress: attaching tokens needs the `leases` section")]
    EgressWithoutLeases,
    /// `fence.retention` without `fence.authority: leases`.
    #[error(
        "fence.retention: {shown} is safe only with `fence.authority: leases`: without it a \
         forgotten maximum is the only thing between a stale token and the upstream, and a \
         writer that wakes more than {shown} after its last write would be admitted; with it, \
         the lease backend refuses every token below its latest grant whatever the store \
         remembers",
        shown = display(*period)
    )]
    RetentionWithoutAuthority {
        /// `fence.retention`.
        period: Duration,
    },
    /// `fence.retention` with `token.equal: reject`.
    #[error(
        "fence.retention: {shown} is unsafe with `token.equal: reject`: the lease backend admits \
         its latest grant's token, so a repeat of that token is refused only by the recorded \
         maximum, and once the maximum is forgotten ({shown} after its last raise) a replica \
         would admit the repeat; use `token.equal: allow`, or keep every maximum (no \
         `fence.retention`)",
        shown = display(*period)
    )]
    RetentionWithEqualReject {
        /// `fence.retention`.
        period: Duration,
    },
    /// `fence.retention` below [`super::MIN_RETENTION`].
    #[error(
        "fence.retention must be at least 1h (it is {}): a maximum may be forgotten only long \
         after the grant of its token is known to every fencegate",
        display(*period)
    )]
    RetentionTooShort {
        /// `fence.retention`.
        period: Duration,
    },
    /// `fence.retention` with the `memory` store, which does not offer it.
    #[error(
        "fence.retention is not offered by the `memory` store (tests and demos: it forgets \
         everything when the process ends); use `embedded`, `redis` or `postgres`"
    )]
    RetentionOnMemory,
    /// `fence.retention` with the `etcd` store, which does not offer it.
    #[error(
        "fence.retention is not offered by the `etcd` store; use `embedded`, `redis` or \
         `postgres`, or keep the maxima and size etcd for them (see the docs' Memory and \
         sizing)"
    )]
    RetentionOnEtcd,
    /// Two of `listen`, `admin`, `leases.listen` and `egress.listen` on one address (port 0,
    /// any free port, excepted).
    #[error("`{first}` and `{second}` are both {address}")]
    SharedAddress {
        /// The later of the two fields, in the order above.
        first: &'static str,
        /// The earlier of the two.
        second: &'static str,
        /// The address both name.
        address: SocketAddr,
    },
}

/// [`super::MAX_WINDOW`], as the refusal writes it.
const MAX_WINDOW_TEXT: &str = "30days";
