//! The `store:` section (docs/stores.md): where recorded maxima live, one variant per kind
//! with exactly the fields that kind uses. A networked store is a [`Remote`], as a networked
//! lease backend is.

use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize};

use super::remote::{check_prefix, ClusterConfig, Holder, RedisHa, SentinelConfig};
use super::{checked, values, ClientTlsConfig, KindError, Remote, RemoteKind, SecretUrl};

/// The fence store, with its defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreConfig {
    /// Maxima in this process's memory only (tests, demos); `prefix` and `cache_size` are
    /// accepted and ignored.
    Memory,
    /// Maxima in a local redb file.
    Embedded {
        /// The file (`store.path`); default `/var/lib/fencegate/fences.db`.
        path: PathBuf,
        /// The redb table's name.
        prefix: String,
        /// How many resources' maxima are kept in memory (the recently used ones); the others
        /// are read from the file.
        cache_size: usize,
    },
    /// Maxima on a Redis server, the primary its Sentinels name, or a Redis Cluster.
    Redis {
        /// The server: `url`, `tls`, `prefix`, `sentinel`, `cluster`, `replicas`.
        remote: Remote,
        /// How many resources' maxima are kept in memory (the recently used ones), so that a
        /// refusal is answered from them without a round trip.
        cache_size: usize,
    },
    /// Maxima in a PostgreSQL table.
    Postgres {
        /// The database: `url`, `tls`, `prefix`, `replicas`.
        remote: Remote,
        /// As for [`StoreConfig::Redis`].
        cache_size: usize,
    },
    /// Maxima in etcd keys.
    Etcd {
        /// The cluster: `url`, `tls`, `prefix`.
        remote: Remote,
        /// As for [`StoreConfig::Redis`].
        cache_size: usize,
    },
}

impl StoreConfig {
    /// `kind:` as written.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreConfig::Memory => "memory",
            StoreConfig::Embedded { .. } => "embedded",
            StoreConfig::Redis { .. } => "redis",
            StoreConfig::Postgres { .. } => "postgres",
            StoreConfig::Etcd { .. } => "etcd",
        }
    }

    /// The networked store's server, if it is one.
    pub fn remote(&self) -> Option<&Remote> {
        match self {
            StoreConfig::Memory | StoreConfig::Embedded { .. } => None,
            StoreConfig::Redis { remote, .. }
            | StoreConfig::Postgres { remote, .. }
            | StoreConfig::Etcd { remote, .. } => Some(remote),
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig::Embedded {
            path: PathBuf::from(DEFAULT_STORE_PATH),
            prefix: default_prefix(),
            cache_size: DEFAULT_CACHE_SIZE,
        }
    }
}

pub(super) const DEFAULT_STORE_PATH: &str = "/var/lib/fencegate/fences.db";
const DEFAULT_CACHE_SIZE: usize = 100_000;

/// `kind:` as written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum StoreKind {
    Memory,
    #[default]
    Embedded,
    Redis,
    Postgres,
    Etcd,
}

/// The section as written: parsed first, then checked inside the deserializer (so errors keep
/// their location) by the `TryFrom` below.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    #[serde(default)]
    kind: StoreKind,
    path: Option<PathBuf>,
    url: Option<SecretUrl>,
    #[serde(default = "default_prefix")]
    prefix: String,
    #[serde(
        default = "default_cache_size",
        deserialize_with = "values::Count::<100000>::de"
    )]
    cache_size: usize,
    tls: Option<ClientTlsConfig>,
    sentinel: Option<SentinelConfig>,
    cluster: Option<ClusterConfig>,
    replicas: Option<u32>,
}

fn default_cache_size() -> usize {
    DEFAULT_CACHE_SIZE
}

pub(super) fn default_prefix() -> String {
    "fencegate".to_owned()
}

impl TryFrom<RawStore> for StoreConfig {
    type Error = KindError;

    fn try_from(raw: RawStore) -> Result<Self, Self::Error> {
        let holder = Holder::Store;
        // The checks run in this order so that a config with several faults is told the
        // same first one as ever.
        let remote = |kind: RemoteKind, raw: RawStore| -> Result<(Remote, usize), KindError> {
            let Some(url) = raw.url else {
                return Err(KindError::NoUrl { holder });
            };
            url.check(kind, raw.tls.as_ref())?;
            if raw.path.is_some() {
                return Err(KindError::PathWithServer { holder });
            }
            check_prefix(&raw.prefix)?;
            let redis = RedisHa::from_raw(
                holder,
                kind,
                raw.sentinel,
                raw.cluster,
                raw.replicas,
                &url,
                raw.tls.as_ref(),
            )?;
            let remote = Remote {
                url,
                tls: raw.tls,
                prefix: raw.prefix,
                replicas: raw.replicas.filter(|_| kind == RemoteKind::Postgres),
                redis,
            };
            Ok((remote, raw.cache_size))
        };
        match raw.kind {
            StoreKind::Memory | StoreKind::Embedded if raw.url.is_some() => {
                Err(KindError::UrlWithoutServer { holder })
            }
            StoreKind::Memory | StoreKind::Embedded if raw.tls.is_some() => {
                Err(KindError::TlsWithoutServer { holder })
            }
            StoreKind::Memory | StoreKind::Embedded if raw.sentinel.is_some() => {
                Err(KindError::RedisOnly {
                    holder,
                    field: "sentinel",
                })
            }
            StoreKind::Memory | StoreKind::Embedded if raw.cluster.is_some() => {
                Err(KindError::RedisOnly {
                    holder,
                    field: "cluster",
                })
            }
            StoreKind::Memory | StoreKind::Embedded if raw.replicas.is_some() => {
                Err(KindError::ReplicasWithoutReplication { holder })
            }
            StoreKind::Memory if raw.path.is_some() => Err(KindError::PathWithServer { holder }),
            StoreKind::Memory => {
                check_prefix(&raw.prefix)?;
                Ok(StoreConfig::Memory)
            }
            #[cfg(not(feature = "embedded"))]
            StoreKind::Embedded => Err(KindError::NotBuilt("embedded")),
            #[cfg(feature = "embedded")]
            StoreKind::Embedded => {
                check_prefix(&raw.prefix)?;
                Ok(StoreConfig::Embedded {
                    path: raw.path.unwrap_or_else(|| DEFAULT_STORE_PATH.into()),
                    prefix: raw.prefix,
                    cache_size: raw.cache_size,
                })
            }
            StoreKind::Redis => {
                let (remote, cache_size) = remote(RemoteKind::Redis, raw)?;
                Ok(StoreConfig::Redis { remote, cache_size })
            }
            StoreKind::Postgres => {
                let (remote, cache_size) = remote(RemoteKind::Postgres, raw)?;
                Ok(StoreConfig::Postgres { remote, cache_size })
            }
            StoreKind::Etcd => {
                let (remote, cache_size) = remote(RemoteKind::Etcd, raw)?;
                Ok(StoreConfig::Etcd { remote, cache_size })
            }
        }
    }
}

impl<'de> Deserialize<'de> for StoreConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked::from_map::<D, RawStore, StoreConfig>(d)
    }
}

/// Printed as written: `kind` and the fields it uses.
#[derive(Serialize)]
struct PrintedStore<'a> {
    kind: StoreKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    path: Option<&'a PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    url: Option<&'a SecretUrl>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prefix: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_size: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tls: Option<&'a ClientTlsConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    sentinel: Option<&'a SentinelConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cluster: Option<&'a ClusterConfig>,
    #[serde(skip_serializing_if = "Option::is_none")]
    replicas: Option<u32>,
}

impl<'a> PrintedStore<'a> {
    fn remote(kind: StoreKind, remote: &'a Remote, cache_size: usize) -> Self {
        PrintedStore {
            kind,
            path: None,
            url: Some(&remote.url),
            prefix: Some(&remote.prefix),
            cache_size: Some(cache_size),
            tls: remote.tls.as_ref(),
            sentinel: remote.redis.sentinel.as_ref(),
            cluster: remote.redis.cluster.as_ref(),
            replicas: match kind {
                StoreKind::Redis => Some(remote.redis.replicas),
                _ => remote.replicas,
            },
        }
    }
}

impl Serialize for StoreConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let printed = match self {
            StoreConfig::Memory => PrintedStore {
                kind: StoreKind::Memory,
                path: None,
                url: None,
                prefix: None,
                cache_size: None,
                tls: None,
                sentinel: None,
                cluster: None,
                replicas: None,
            },
            StoreConfig::Embedded {
                path,
                prefix,
                cache_size,
            } => PrintedStore {
                kind: StoreKind::Embedded,
                path: Some(path),
                url: None,
                prefix: Some(prefix),
                cache_size: Some(*cache_size),
                tls: None,
                sentinel: None,
                cluster: None,
                replicas: None,
            },
            StoreConfig::Redis {
                remote: r,
                cache_size,
            } => PrintedStore::remote(StoreKind::Redis, r, *cache_size),
            StoreConfig::Postgres {
                remote: r,
                cache_size,
            } => PrintedStore::remote(StoreKind::Postgres, r, *cache_size),
            StoreConfig::Etcd {
                remote: r,
                cache_size,
            } => PrintedStore::remote(StoreKind::Etcd, r, *cache_size),
        };
        printed.serialize(s)
    }
}
