//! `leases.backend`: where leases are granted, one variant per kind with exactly the fields it
//! uses; a networked backend is a [`Remote`] like a networked store.

use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize};

use super::checked;
use super::remote::{check_prefix, ClusterConfig, Holder, RedisHa, SentinelConfig};
use super::store::default_prefix;
use super::{ClientTlsConfig, KindError, Remote, RemoteKind, SecretUrl};

/// Where leases are granted, with its defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendConfig {
    /// Leases in a local redb file: for one process, or tests.
    Embedded {
        /// The file (`leases.backend.path`); default `/var/lib/fencegate/leases.db`.
        path: PathBuf,
        /// The redb table's name, checked like the store's.
        prefix: String,
    },
    /// A Redis server, the primary its Sentinels name, or a Redis Cluster (`kind: redis`).
    Redis(Remote),
    /// A PostgreSQL database (`kind: postgres`).
    Postgres(Remote),
    /// An etcd cluster (`kind: etcd`).
    Etcd(Remote),
}

/// `kind:` as written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum BackendKind {
    Embedded,
    Redis,
    Postgres,
    Etcd,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBackend {
    kind: BackendKind,
    url: Option<SecretUrl>,
    path: Option<PathBuf>,
    #[serde(default = "default_prefix")]
    prefix: String,
    tls: Option<ClientTlsConfig>,
    sentinel: Option<SentinelConfig>,
    cluster: Option<ClusterConfig>,
    replicas: Option<u32>,
}

const DEFAULT_LEASE_PATH: &str = "/var/lib/fencegate/leases.db";

impl TryFrom<RawBackend> for BackendConfig {
    type Error = KindError;
    fn try_from(raw: RawBackend) -> Result<Self, KindError> {
        let holder = Holder::LeaseBackend;
        check_prefix(&raw.prefix)?;
        let remote = |kind: RemoteKind, raw: RawBackend| -> Result<Remote, KindError> {
            let Some(url) = raw.url else {
                return Err(KindError::NoUrl { holder });
            };
            if raw.path.is_some() {
                return Err(KindError::PathWithServer { holder });
            }
            url.check(kind, raw.tls.as_ref())?;
            let redis = RedisHa::from_raw(
                holder,
                kind,
                raw.sentinel,
                raw.cluster,
                raw.replicas,
                &url,
                raw.tls.as_ref(),
            )?;
            Ok(Remote {
                url,
                tls: raw.tls,
                prefix: raw.prefix,
                replicas: raw.replicas.filter(|_| kind == RemoteKind::Postgres),
                redis,
            })
        };
        match raw.kind {
            BackendKind::Embedded if raw.url.is_some() => {
                Err(KindError::UrlWithoutServer { holder })
            }
            BackendKind::Embedded if raw.tls.is_some() => {
                Err(KindError::TlsWithoutServer { holder })
            }
            BackendKind::Embedded if raw.sentinel.is_some() => Err(KindError::RedisOnly {
                holder,
                field: "sentinel",
            }),
            BackendKind::Embedded if raw.cluster.is_some() => Err(KindError::RedisOnly {
                holder,
                field: "cluster",
            }),
            BackendKind::Embedded if raw.replicas.is_some() => {
                Err(KindError::ReplicasWithoutReplication { holder })
            }
            #[cfg(not(feature = "embedded"))]
            BackendKind::Embedded => Err(KindError::NotBuilt("embedded")),
            #[cfg(feature = "embedded")]
            BackendKind::Embedded => Ok(BackendConfig::Embedded {
                path: raw.path.unwrap_or_else(|| DEFAULT_LEASE_PATH.into()),
                prefix: raw.prefix,
            }),
            BackendKind::Redis => remote(RemoteKind::Redis, raw).map(BackendConfig::Redis),
            BackendKind::Postgres => remote(RemoteKind::Postgres, raw).map(BackendConfig::Postgres),
            BackendKind::Etcd => remote(RemoteKind::Etcd, raw).map(BackendConfig::Etcd),
        }
    }
}

impl<'de> Deserialize<'de> for BackendConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked::from_map::<D, RawBackend, BackendConfig>(d)
    }
}

/// Printed as written: `kind` and the fields it uses.
#[derive(Serialize)]
struct PrintedBackend<'a> {
    kind: BackendKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    url: Option<&'a SecretUrl>,
    #[serde(skip_serializing_if = "Option::is_none")]
    path: Option<&'a PathBuf>,
    prefix: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls: Option<&'a ClientTlsConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sentinel: Option<&'a SentinelConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cluster: Option<&'a ClusterConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    replicas: Option<u32>,
}

impl<'a> PrintedBackend<'a> {
    fn remote(kind: BackendKind, remote: &'a Remote) -> Self {
        PrintedBackend {
            kind,
            url: Some(&remote.url),
            path: None,
            prefix: &remote.prefix,
            tls: remote.tls.as_ref(),
            sentinel: remote.redis.sentinel.as_ref(),
            cluster: remote.redis.cluster.as_ref(),
            replicas: match kind {
                BackendKind::Redis => Some(remote.redis.replicas),
                _ => remote.replicas,
            },
        }
    }
}

impl Serialize for BackendConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let printed = match self {
            BackendConfig::Embedded { path, prefix } => PrintedBackend {
                kind: BackendKind::Embedded,
                url: None,
                path: Some(path),
                prefix,
                tls: None,
                sentinel: None,
                cluster: None,
                replicas: None,
            },
            BackendConfig::Redis(r) => PrintedBackend::remote(BackendKind::Redis, r),
            BackendConfig::Postgres(r) => PrintedBackend::remote(BackendKind::Postgres, r),
            BackendConfig::Etcd(r) => PrintedBackend::remote(BackendKind::Etcd, r),
        };
        printed.serialize(s)
    }
}

impl BackendConfig {
    /// `kind:` as written.
    pub fn kind(&self) -> &'static str {
        match self {
            BackendConfig::Embedded { .. } => "embedded",
            BackendConfig::Redis(_) => "redis",
            BackendConfig::Postgres(_) => "postgres",
            BackendConfig::Etcd(_) => "etcd",
        }
    }

    /// The networked backend's server, if it is one.
    pub fn remote(&self) -> Option<&Remote> {
        match self {
            BackendConfig::Embedded { .. } => None,
            BackendConfig::Redis(remote)
            | BackendConfig::Postgres(remote)
            | BackendConfig::Etcd(remote) => Some(remote),
        }
    }
}
