//! A Redis, PostgreSQL or etcd server, as a networked store or lease backend reaches it: its
//! URL (checked against the kind, printed with its password masked), TLS files and prefix.

use std::fmt;

use super::checked::checked_from_str;
use super::ClientTlsConfig;

use serde::Serialize;

/// A Redis, PostgreSQL or etcd server: a networked store or lease backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Remote {
    /// Printed and logged with its password masked; its scheme fits the kind and says
    /// whether the connection uses TLS ([`SecretUrl::check`]).
    pub url: SecretUrl,
    /// TLS files (docs/stores.md); without them, a TLS URL trusts the public web roots.
    pub tls: Option<ClientTlsConfig>,
    /// Key / table namespace, an identifier ([`check_prefix`]).
    pub prefix: String,
    /// PostgreSQL only: how many synchronous standbys must hold a commit before it is
    /// acknowledged, checked against the server's replication settings on every new
    /// connection (`crate::conn::postgres`). `None` (the default) asks for one when the server
    /// streams to any standby, and none for a lone primary.
    pub replicas: Option<u32>,
}

/// The kinds of [`Remote`], for checking a URL against the kind it was written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteKind {
    Redis,
    Postgres,
    Etcd,
}

impl RemoteKind {
    /// As `kind:` writes it.
    fn name(self) -> &'static str {
        match self {
            RemoteKind::Redis => "redis",
            RemoteKind::Postgres => "postgres",
            RemoteKind::Etcd => "etcd",
        }
    }

    /// A URL of this kind, for messages.
    fn example(self) -> &'static str {
        match self {
            RemoteKind::Redis => "redis://127.0.0.1:6379/",
            RemoteKind::Postgres => "postgres://user:password@127.0.0.1:5432/database",
            RemoteKind::Etcd => "etcd://127.0.0.1:2379",
        }
    }

    /// The scheme that asks for TLS, where the scheme says it.
    fn tls_scheme(self) -> &'static str {
        match self {
            RemoteKind::Redis => "a rediss://",
            RemoteKind::Postgres | RemoteKind::Etcd => "an https://",
        }
    }
}

/// Which mapping holds a store's or lease backend's fields, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holder {
    Store,
    LeaseBackend,
}

impl Holder {
    fn noun(self) -> &'static str {
        match self {
            Holder::Store => "store",
            Holder::LeaseBackend => "backend",
        }
    }
}

/// A `store` or `leases.backend` mapping whose fields do not fit its `kind`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KindError {
    #[error("`url` is for the redis, postgres and etcd {}s", holder.noun())]
    UrlWithoutServer { holder: Holder },
    #[error("`tls` is for the redis, postgres and etcd {}s", holder.noun())]
    TlsWithoutServer { holder: Holder },
    #[error("`path` is for the embedded {}", holder.noun())]
    PathWithServer { holder: Holder },
    #[error("this {} kind needs a `url`", holder.noun())]
    NoUrl { holder: Holder },
    #[error("`replicas` is for the postgres {}", holder.noun())]
    ReplicasWithoutPostgres { holder: Holder },
    #[error(transparent)]
    Url(#[from] UrlError),
    #[error(transparent)]
    Prefix(#[from] PrefixError),
}

/// A `prefix` that is not an identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`prefix` `{0}` must be 1-40 letters, digits or `_`, not starting with a digit")]
pub struct PrefixError(String);

/// A prefix names PostgreSQL and redb tables and Redis/etcd key prefixes: keep it an identifier.
pub(super) fn check_prefix(prefix: &str) -> Result<(), PrefixError> {
    let identifier = prefix.len() <= 40
        && prefix.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && prefix
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_');
    if identifier {
        Ok(())
    } else {
        Err(PrefixError(prefix.to_owned()))
    }
}

/// A store's or lease backend's `url` that is malformed, or does not fit its kind or `tls`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    #[error("a store url is non-empty and has no spaces")]
    Malformed,
    #[error(
        "the `url` does not fit kind {}: write one like {}",
        kind.name(),
        kind.example()
    )]
    DoesNotFitKind { kind: RemoteKind },
    /// `url` is masked.
    #[error(
        "`tls` needs {} url (`{url}` would connect in plaintext)",
        kind.tls_scheme()
    )]
    TlsOverPlaintext { kind: RemoteKind, url: SecretUrl },
    #[error(
        "`tls` always requires TLS with a verified certificate; remove `sslmode={mode}` from \
         the url"
    )]
    SslmodeWeakerThanTls { mode: String },
    #[error(
        "`sslmode={mode}` needs the `tls` mapping (`tls: {{}}` for the public web roots, or \
         `tls: {{ ca: FILE }}`)"
    )]
    SslmodeWithoutTls { mode: String },
}

/// A store URL. It may carry a password, so it displays and serialises masked.
#[derive(Clone, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub struct SecretUrl(String);

impl SecretUrl {
    /// The URL with its password, for the store client only.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Checks the scheme against the store kind, and against `tls` (TLS is on exactly when
    /// the scheme says so: `rediss://`, `https://`, or a PostgreSQL URL with the `tls`
    /// mapping), so that no config asks for TLS and gets plaintext.
    pub fn check(&self, kind: RemoteKind, tls: Option<&ClientTlsConfig>) -> Result<(), UrlError> {
        let fits = match kind {
            RemoteKind::Redis => self.0.starts_with("redis://") || self.0.starts_with("rediss://"),
            RemoteKind::Postgres => {
                self.0.starts_with("postgres://") || self.0.starts_with("postgresql://")
            }
            RemoteKind::Etcd => {
                self.0.starts_with("etcd://")
                    || self.0.starts_with("http://")
                    || self.0.starts_with("https://")
            }
        };
        if !fits {
            // Not printed: without a scheme it cannot be told where a password would be.
            return Err(UrlError::DoesNotFitKind { kind });
        }
        let plaintext = || UrlError::TlsOverPlaintext {
            kind,
            url: self.clone(),
        };
        match kind {
            RemoteKind::Redis if tls.is_some() && !self.0.starts_with("rediss://") => {
                Err(plaintext())
            }
            RemoteKind::Etcd if tls.is_some() && !self.0.starts_with("https://") => {
                Err(plaintext())
            }
            RemoteKind::Redis | RemoteKind::Etcd => Ok(()),
            RemoteKind::Postgres => match (tls, self.query_param("sslmode")) {
                (Some(_), Some(mode @ ("disable" | "allow" | "prefer"))) => {
                    Err(UrlError::SslmodeWeakerThanTls { mode: mode.into() })
                }
                (None, Some(mode @ ("require" | "verify-ca" | "verify-full"))) => {
                    Err(UrlError::SslmodeWithoutTls { mode: mode.into() })
                }
                _ => Ok(()),
            },
        }
    }

    /// Whether the URL's scheme asks for TLS (`rediss://`, `https://`).
    pub fn is_tls(&self) -> bool {
        self.0.starts_with("rediss://") || self.0.starts_with("https://")
    }

    /// A query parameter's value, as written.
    fn query_param(&self, name: &str) -> Option<&str> {
        let (_, query) = self.0.split_once('?')?;
        query
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v)
    }
}

impl TryFrom<String> for SecretUrl {
    type Error = UrlError;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        if raw.is_empty() || raw.chars().any(char::is_whitespace) {
            return Err(UrlError::Malformed);
        }
        Ok(SecretUrl(raw))
    }
}

impl From<SecretUrl> for String {
    fn from(u: SecretUrl) -> String {
        u.to_string()
    }
}

/// `scheme://user:****@host/...`: the password is never printed or logged.
impl fmt::Display for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some((scheme, rest)) = self.0.split_once("://") else {
            return f.write_str("****");
        };
        // The userinfo ends at the last `@`, wherever it is: a password may hold `/`, `?` or
        // `#` unencoded (the etcd and PostgreSQL URL readers accept it), and must be masked
        // all the same. An `@` in the query only masks more than it needs to.
        let tail = match rest.rfind('@') {
            Some(at) => {
                let userinfo = &rest[..at];
                let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
                write!(f, "{scheme}://{user}:****@")?;
                &rest[at + 1..]
            }
            None => {
                write!(f, "{scheme}://")?;
                rest
            }
        };
        let (host, query) = match tail.split_once('?') {
            Some((host, query)) => (host, Some(query)),
            None => (tail, None),
        };
        f.write_str(host)?;
        if let Some(query) = query {
            // Query parameters can carry secrets too (`?password=`): mask the likely ones.
            f.write_str("?")?;
            for (i, pair) in query.split('&').enumerate() {
                if i > 0 {
                    f.write_str("&")?;
                }
                let key = pair.split_once('=').map_or(pair, |(k, _)| k);
                let lower = key.to_ascii_lowercase();
                if ["pass", "secret", "token", "key"]
                    .iter()
                    .any(|s| lower.contains(s))
                {
                    write!(f, "{key}=****")?;
                } else {
                    f.write_str(pair)?;
                }
            }
        }
        Ok(())
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

checked_from_str!(SecretUrl);
