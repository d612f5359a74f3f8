//! The `egress:` section (docs/leases.md): app → fencegate → remote service, with the held
//! lease's token attached on the routes listed.

use std::net::SocketAddr;

use serde::{Deserialize, Deserializer, Serialize};

use super::checked;
use super::routes::{uses_captures, Paths, Shape};
use super::{MethodCfg, PathTemplate, ResourceTemplate, UpstreamUrl};

/// One of `egress.routes`: writes on `path` get the token of the lease `lease` names.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EgressRoute {
    /// Path template, matched against the normalised request path as for `routes[].path`.
    pub path: PathTemplate,
    /// The lease (resource) whose token is attached; captures of `path` may be used.
    pub lease: ResourceTemplate,
    /// Methods that get the token; default every method but GET, HEAD, OPTIONS.
    #[serde(
        default,
        deserialize_with = "super::values::methods",
        skip_serializing_if = "Option::is_none"
    )]
    pub methods: Option<Vec<super::MethodCfg>>,
}

impl Shape for EgressRoute {
    fn path(&self) -> &PathTemplate {
        &self.path
    }
    fn methods(&self) -> Option<&[MethodCfg]> {
        self.methods.as_deref()
    }
    fn fences(&self) -> bool {
        true
    }
}

/// `egress.routes`.
pub(super) fn egress_routes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<EgressRoute>, D::Error> {
    let mut paths = Paths::new("egress.routes");
    checked::from_seq_each(
        d,
        "an egress route: a mapping with `path` and `lease`",
        move |earlier: &[EgressRoute], route: &EgressRoute| {
            uses_captures("lease", &route.lease, &route.path)?;
            paths.add(earlier, route)
        },
    )
}

/// The `egress` section: a proxy from the app to a remote service that attaches the token of a
/// lease this agent holds; needs the `leases` section.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with `upstream` and `routes`"
)]
pub struct EgressConfig {
    /// The egress proxy's listener, plain HTTP (`egress.listen`); default `127.0.0.1:7443`.
    #[serde(
        default = "default_egress_listen",
        deserialize_with = "super::values::address"
    )]
    pub listen: SocketAddr,
    /// The remote service (`egress.upstream`), written as `upstream` is; `upstream_ca` applies.
    pub upstream: UpstreamUrl,
    /// The routes whose writes get a held lease's token (`egress.routes`); requests on none are
    /// forwarded unchanged. Default none.
    #[serde(default, deserialize_with = "egress_routes")]
    pub routes: Vec<EgressRoute>,
}

fn default_egress_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 7443))
}
