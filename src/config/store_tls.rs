//! The `tls` mapping of `store` and `leases.backend`: how fencegate reaches a Redis,
//! PostgreSQL or etcd server over TLS (docs/stores.md). The files are read when a connection
//! is made (src/tls.rs, [`crate::tls::ClientTls`]), so a rotated certificate is picked up
//! without a restart; `check` and `run` read them once at start, so a bad path fails there.

use std::path::PathBuf;

use rustls_pki_types::ServerName;
use serde::{Deserialize, Deserializer, Serialize};

use super::checked;

/// Client TLS to a store or lease backend.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ClientTlsConfig {
    /// PEM bundle of the CAs the server's certificate must chain to; the public web roots
    /// when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca: Option<PathBuf>,
    /// PEM client certificate chain, for mutual TLS (with `key`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert: Option<PathBuf>,
    /// PEM private key of `cert`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<PathBuf>,
    /// The name the server's certificate must carry, when it is not the URL's host.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClientTls {
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    server_name: Option<String>,
}

/// A `tls` mapping of `store` or `leases.backend` that cannot describe a connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientTlsError {
    /// `cert` without `key`.
    #[error("`cert` needs its `key` (mutual TLS)")]
    CertWithoutKey,
    /// `key` without `cert`.
    #[error("`key` needs its `cert` (mutual TLS)")]
    KeyWithoutCert,
    /// A file given as an empty path.
    #[error("`{file}` is an empty path")]
    EmptyPath {
        /// `ca`, `cert` or `key`.
        file: &'static str,
    },
    /// `server_name`, as written, is neither a DNS name nor an IP address.
    #[error("`server_name` `{0}` is neither a DNS name nor an IP address")]
    ServerName(String),
}

impl TryFrom<RawClientTls> for ClientTlsConfig {
    type Error = ClientTlsError;

    fn try_from(raw: RawClientTls) -> Result<Self, ClientTlsError> {
        match (&raw.cert, &raw.key) {
            (Some(_), None) => return Err(ClientTlsError::CertWithoutKey),
            (None, Some(_)) => return Err(ClientTlsError::KeyWithoutCert),
            _ => {}
        }
        for (file, path) in [("ca", &raw.ca), ("cert", &raw.cert), ("key", &raw.key)] {
            if path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                return Err(ClientTlsError::EmptyPath { file });
            }
        }
        if let Some(name) = &raw.server_name {
            ServerName::try_from(name.as_str())
                .map_err(|_| ClientTlsError::ServerName(name.clone()))?;
        }
        Ok(ClientTlsConfig {
            ca: raw.ca,
            cert: raw.cert,
            key: raw.key,
            server_name: raw.server_name,
        })
    }
}

impl<'de> Deserialize<'de> for ClientTlsConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        checked::from_map::<D, RawClientTls, ClientTlsConfig>(d)
    }
}
