//! How each networked system's url is read, without connecting: the config checks every
//! store and lease backend url with these when it loads (so `check` refuses what `run`
//! would), and the connectors read the url with the same functions when they connect.

#[cfg(feature = "redis")]
use redis::{ConnectionAddr, IntoConnectionInfo, RedisConnectionInfo};

/// Why a store's or lease backend's url cannot be read (as
/// [`UrlError::Unreadable`](crate::config::UrlError::Unreadable)). No reason shows the
/// password.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum UrlReadError {
    /// A Redis url with a `#` fragment, which the redis crate would read (`#insecure`: do not
    /// verify the server's certificate).
    #[cfg(feature = "redis")]
    #[error(
        "a redis url has no `#` fragment (`#insecure` would skip verifying the server's \
         certificate, which fencegate never does)"
    )]
    RedisFragment,
    /// A Redis url the redis crate does not read (a bad database number, say).
    #[cfg(feature = "redis")]
    #[error("bad redis url: {0}")]
    Redis(#[source] redis::RedisError),
    /// A Redis url that names no TCP host and port.
    #[cfg(feature = "redis")]
    #[error("a redis url names a host and port")]
    RedisNoHost,
    /// A PostgreSQL url tokio-postgres does not read (an option's value, say).
    #[cfg(feature = "postgres")]
    #[error("bad postgres url: {}", with_cause(.0))]
    Postgres(#[source] std::sync::Arc<tokio_postgres::Error>),
    /// A PostgreSQL url that names no host.
    #[cfg(feature = "postgres")]
    #[error("bad postgres url: it names no host")]
    PostgresNoHost,
    /// An etcd url whose scheme is not `etcd://`, `http://` or `https://`.
    #[error("etcd url must start with etcd://, http:// or https://")]
    EtcdScheme,
    /// An etcd user or password that is not UTF-8 once percent-decoded.
    #[error("the etcd user and password are UTF-8 (percent-encoded)")]
    EtcdUserNotUtf8(#[source] std::str::Utf8Error),
    /// An etcd user without `:password`.
    #[error("an etcd user needs its password: user:password@host:port")]
    EtcdNoPassword,
    /// An etcd url with `:password@` and no user name.
    #[error("the etcd user name is empty")]
    EtcdEmptyUser,
    /// An etcd url without a `host:port`.
    #[error("etcd url names no endpoint")]
    EtcdNoEndpoint,
}

/// tokio-postgres's error, followed by its source: the error says "invalid connection
/// string", its source what is wrong.
#[cfg(feature = "postgres")]
fn with_cause(e: &tokio_postgres::Error) -> String {
    match std::error::Error::source(e) {
        Some(why) => format!("{e}: {why}"),
        None => e.to_string(),
    }
}

/// A Redis url, read: where to dial, and the settings the connection is set up with.
#[cfg(feature = "redis")]
pub(crate) struct RedisUrl {
    pub host: String,
    pub port: u16,
    /// User, password, database, protocol.
    pub settings: RedisConnectionInfo,
    /// `rediss://`: the connection is TLS.
    pub tls: bool,
}

/// Reads a `redis://` or `rediss://` url (docs/stores.md).
#[cfg(feature = "redis")]
pub(crate) fn redis(url: &str) -> Result<RedisUrl, UrlReadError> {
    if url.contains('#') {
        // The redis crate reads `#insecure` as "do not verify": never.
        return Err(UrlReadError::RedisFragment);
    }
    // The TLS is fencegate's own: the redis crate reads the rest like a redis:// url.
    let (plain, tls) = match url.strip_prefix("rediss://") {
        Some(rest) => (format!("redis://{rest}"), true),
        None => (url.to_owned(), false),
    };
    let info = plain
        .as_str()
        .into_connection_info()
        .map_err(UrlReadError::Redis)?;
    let ConnectionAddr::Tcp(host, port) = info.addr().clone() else {
        return Err(UrlReadError::RedisNoHost);
    };
    Ok(RedisUrl {
        host,
        port,
        settings: info.redis_settings().clone(),
        tls,
    })
}

/// Reads a `postgres://` or `postgresql://` url; with `tls`, its `sslmode` is dropped (the
/// connection is always TLS, verified; see [`super::postgres::pool`]).
#[cfg(feature = "postgres")]
pub(crate) fn postgres(url: &str, tls: bool) -> Result<tokio_postgres::Config, UrlReadError> {
    let url = if tls {
        without_sslmode(url)
    } else {
        url.to_owned()
    };
    let config: tokio_postgres::Config = url
        .parse()
        .map_err(|e| UrlReadError::Postgres(std::sync::Arc::new(e)))?;
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        return Err(UrlReadError::PostgresNoHost);
    }
    Ok(config)
}

/// `url` without its `sslmode` parameter.
#[cfg(feature = "postgres")]
pub(super) fn without_sslmode(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| !pair.starts_with("sslmode="))
        .collect();
    if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

/// An etcd url: `etcd://` or `http://` (plaintext) or `https://` (TLS) and comma-separated
/// `host:port` endpoints, with `user:password@` (percent-encoded) before the first to
/// authenticate as that user.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct EtcdUrl {
    pub endpoints: Vec<String>,
    pub user: Option<(String, String)>,
}

/// Reads an etcd url.
pub(crate) fn etcd(url: &str) -> Result<EtcdUrl, UrlReadError> {
    let (scheme, rest) = if let Some(rest) = url.strip_prefix("https://") {
        ("https", rest)
    } else if let Some(rest) = url
        .strip_prefix("etcd://")
        .or_else(|| url.strip_prefix("http://"))
    {
        ("http", rest)
    } else {
        // Not printed: without a scheme it cannot be told where a password would be.
        return Err(UrlReadError::EtcdScheme);
    };
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8()
            .map(|s| s.into_owned())
            .map_err(UrlReadError::EtcdUserNotUtf8)
    };
    // Hosts have no `@`: the last one ends the user information.
    let (user, rest) = match rest.rsplit_once('@') {
        Some((userinfo, rest)) => {
            let Some((name, password)) = userinfo.split_once(':') else {
                return Err(UrlReadError::EtcdNoPassword);
            };
            if name.is_empty() {
                return Err(UrlReadError::EtcdEmptyUser);
            }
            (Some((decode(name)?, decode(password)?)), rest)
        }
        None => (None, rest),
    };
    let endpoints: Vec<String> = rest
        .trim_end_matches('/')
        .split(',')
        .filter(|e| !e.is_empty())
        .map(|e| format!("{scheme}://{e}"))
        .collect();
    if endpoints.is_empty() {
        return Err(UrlReadError::EtcdNoEndpoint);
    }
    Ok(EtcdUrl { endpoints, user })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(all(feature = "redis", feature = "postgres"))]
    fn what_no_connection_could_use_is_refused() {
        let redis_err = |url| redis(url).err().unwrap().to_string();
        assert!(redis_err("redis://h/abc").starts_with("bad redis url: "));
        assert!(redis_err("rediss://h/#insecure").starts_with("a redis url has no `#`"));
        assert!(redis("rediss://u:p@h:6380/2").unwrap().tls);
        let pg_err = |url| postgres(url, false).err().unwrap().to_string();
        assert!(pg_err("postgres://h:99999/db").starts_with("bad postgres url: "));
        assert_eq!(
            pg_err("postgres:///db"),
            "bad postgres url: it names no host"
        );
        assert_eq!(
            etcd("etcd://").unwrap_err().to_string(),
            "etcd url names no endpoint"
        );
    }
}
