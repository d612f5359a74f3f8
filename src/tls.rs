//! rustls configuration, on the ring provider, for the listener, for an `https` upstream and
//! for the connections to a store or lease backend ([`ClientTls`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::config::{ClientTlsConfig, Config, Remote, TlsConfig};
use crate::sync::Locked;

/// Why a certificate, key or CA bundle cannot be used: the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A certificate file (or CA bundle) that cannot be opened.
    #[error("cannot read certificates from {}: {source}", path.display())]
    ReadCertificates {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: pem::Error,
    },
    /// A certificate file (or CA bundle) whose PEM does not parse.
    #[error("bad certificate in {}: {source}", path.display())]
    BadCertificate {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: pem::Error,
    },
    /// A certificate file (or CA bundle) with no certificate in it.
    #[error("no certificate found in {}", path.display())]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// A CA certificate rustls cannot use as a trust anchor.
    #[error("unusable CA certificate in {}: {source}", path.display())]
    UnusableCa {
        /// The CA bundle.
        path: PathBuf,
        /// Why rustls refused it.
        source: rustls::Error,
    },
    /// A key file that cannot be read, or holds no PEM private key (PKCS#8, PKCS#1 or SEC1).
    #[error("cannot read a private key from {}: {source}", path.display())]
    ReadKey {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: pem::Error,
    },
    /// The provider offers none of the protocol versions asked for.
    #[error("{0}")]
    Protocols(rustls::Error),
    /// The listener's `client_ca` bundle, from which no client certificate verifier can be
    /// built.
    #[error("client_ca {}: {source}", path.display())]
    ClientCa {
        /// The CA bundle.
        path: PathBuf,
        /// Why the verifier cannot be built.
        source: rustls::server::VerifierBuilderError,
    },
    /// The listener's certificate and key, which rustls refuses as a pair.
    #[error("certificate and key do not form a usable pair: {}", described(.0, "server"))]
    Pair(rustls::Error),
    /// A file of a store's or lease backend's `tls` mapping (`field` is `store.tls` or
    /// `leases.backend.tls`, `file` is `ca`, `cert` or `key`).
    #[error("{field}.{file}: {source}")]
    ClientFile {
        /// `store.tls` or `leases.backend.tls`.
        field: &'static str,
        /// `ca`, `cert` or `key`.
        file: &'static str,
        /// What is wrong with the file.
        source: Box<TlsError>,
    },
    /// The `cert` and `key` of a store's or lease backend's `tls` mapping, which rustls
    /// refuses as a pair.
    #[error(
        "{field}.cert and {field}.key do not form a usable pair: {}",
        described(source, "client")
    )]
    ClientPair {
        /// `store.tls` or `leases.backend.tls`.
        field: &'static str,
        /// Why rustls refused them.
        source: rustls::Error,
    },
    /// A file of the listener's TLS, named as the config (`tls.key`) or the command line
    /// (`--tls-key`) gives it.
    #[error("{field}: {source}")]
    Field {
        /// The file's name, as [`ServerFields`] gives it.
        field: &'static str,
        /// What is wrong with the file.
        source: Box<TlsError>,
    },
    /// A `server_name` of a store's or lease backend's `tls` mapping that is neither a DNS
    /// name nor an IP address.
    #[error("{field}.server_name `{name}`: {source}")]
    ServerName {
        /// `store.tls` or `leases.backend.tls`.
        field: &'static str,
        /// The `server_name` as written.
        name: String,
        /// Why it is not a name.
        source: rustls_pki_types::InvalidDnsNameError,
    },
}

impl TlsError {
    /// This error, as one of the files of `field`'s `tls` mapping.
    fn in_file(self, field: &'static str, file: &'static str) -> TlsError {
        TlsError::ClientFile {
            field,
            file,
            source: Box::new(self),
        }
    }
}

/// A rustls error in words: for a certificate in X.509 v1 (which webpki refuses as
/// `UnsupportedCertVersion`, and which `openssl x509 -req` issues when given no extensions), how
/// to issue one rustls accepts. `role` is the certificate's: `client` or `server`.
pub fn described(e: &rustls::Error, role: &str) -> String {
    match e {
        rustls::Error::InvalidCertificate(rustls::CertificateError::Other(other))
            if format!("{other:?}").contains("UnsupportedCertVersion") =>
        {
            format!(
                "the {role} certificate is X.509 v1, and rustls accepts only v3 certificates: \
                 re-issue it with v3 extensions (with openssl, `openssl x509 -req … -extfile \
                 {role}.ext` where {role}.ext has at least `subjectAltName` and \
                 `extendedKeyUsage = {role}Auth`, or `x509_extensions` in the config of \
                 `openssl req -x509` or `openssl ca`) ({e})"
            )
        }
        e => e.to_string(),
    }
}

/// A failed TLS handshake in words ([`described`] when rustls says why). `peer` is the other
/// side's role: `client` on a listener, `server` when connecting.
pub fn handshake_error(e: &std::io::Error, peer: &str) -> String {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(rustls) => described(rustls, peer),
        None => e.to_string(),
    }
}

/// Whether a handshake failed because the peer's certificate was refused.
pub fn certificate_refused(e: &std::io::Error) -> bool {
    let rustls = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>());
    matches!(rustls, Some(rustls::Error::InvalidCertificate(_)))
}

/// The one crypto provider, named explicitly so no feature flag elsewhere can swap it.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Makes ring the process default too, for libraries that ask for the default.
pub fn install_default_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|source| TlsError::ReadCertificates {
            path: path.to_owned(),
            source,
        })?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::BadCertificate {
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// Adds the CA certificates in `path` to `roots`.
fn add_roots(roots: &mut RootCertStore, path: &Path) -> Result<(), TlsError> {
    for cert in certs(path)? {
        roots.add(cert).map_err(|source| TlsError::UnusableCa {
            path: path.to_owned(),
            source,
        })?;
    }
    Ok(())
}

fn roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    add_roots(&mut roots, path)?;
    Ok(roots)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|source| TlsError::ReadKey {
        path: path.to_owned(),
        source,
    })
}

/// How the listener's TLS files are named in messages.
pub struct ServerFields {
    /// The certificate chain's file: `tls.cert`, say.
    pub cert: &'static str,
    /// Its private key's file: `tls.key`.
    pub key: &'static str,
    /// The CA bundle of client certificates: `tls.client_ca`.
    pub client_ca: &'static str,
    /// The certificate and key together.
    pub pair: &'static str,
}

/// The config's `tls` mapping.
pub const CONFIG_TLS: ServerFields = ServerFields {
    cert: "tls.cert",
    key: "tls.key",
    client_ca: "tls.client_ca",
    pair: "tls.cert and tls.key",
};

/// Listener TLS: HTTP/2 and HTTP/1.1 by ALPN, client certificates when `client_ca` is set.
/// An error names the file's field as `fields` say.
pub fn server_config(
    tls: &TlsConfig,
    fields: &ServerFields,
) -> Result<Arc<ServerConfig>, TlsError> {
    let named = |field| {
        move |source| TlsError::Field {
            field,
            source: Box::new(source),
        }
    };
    let chain = certs(&tls.cert).map_err(named(fields.cert))?;
    let key = private_key(&tls.key).map_err(named(fields.key))?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Protocols)?;
    let builder = match &tls.client_ca {
        Some(ca) => {
            let roots = roots(ca).map_err(named(fields.client_ca))?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|source| TlsError::ClientCa {
                    path: ca.clone(),
                    source,
                })
                .map_err(named(fields.client_ca))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(TlsError::Pair)
        .map_err(named(fields.pair))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Upstream TLS: the public web roots plus an optional private CA bundle.
pub fn client_config(extra_ca: Option<&Path>) -> Result<ClientConfig, TlsError> {
    let mut roots = RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = extra_ca {
        add_roots(&mut roots, path)?;
    }
    Ok(ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Protocols)?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// TLS to a store or lease backend (`store.tls`, `leases.backend.tls`): a rustls client
/// config built from the `ca`, `cert` and `key` files, rebuilt when one of them changes.
///
/// Every new connection asks [`ClientTls::config`], which compares the files' modification
/// time, length and inode with those it was built from (three `stat`s, no read) and rebuilds
/// on a difference: a rotated CA bundle or client certificate is used by the next connection,
/// without a restart. When the changed files cannot be used (unreadable, half written, a key
/// that does not fit), the error is logged once for that change and connections keep the last
/// good config; the next change is tried again.
pub struct ClientTls {
    files: ClientTlsConfig,
    /// The config field, for messages: `store.tls` or `leases.backend.tls`.
    field: &'static str,
    alpn: Vec<Vec<u8>>,
    server_name: Option<ServerName<'static>>,
    state: Mutex<Loaded>,
}

struct Loaded {
    stamps: Stamps,
    config: Arc<ClientConfig>,
}

/// What a file looked like when it was read: modification time, length and inode (a
/// Kubernetes Secret volume swaps a symlink; the file it points at is a new inode).
type Stamp = Option<(Option<SystemTime>, u64, u64)>;
type Stamps = [Stamp; 3];

impl ClientTls {
    /// Reads the files once; an unusable file is an error naming its field.
    pub fn load(
        files: &ClientTlsConfig,
        field: &'static str,
        alpn: &[&[u8]],
    ) -> Result<Self, TlsError> {
        let alpn: Vec<Vec<u8>> = alpn.iter().map(|p| p.to_vec()).collect();
        let stamps = stamps(files);
        let config = Arc::new(build(files, field, &alpn)?);
        let server_name =
            match &files.server_name {
                Some(name) => Some(ServerName::try_from(name.clone()).map_err(|source| {
                    TlsError::ServerName {
                        field,
                        name: name.clone(),
                        source,
                    }
                })?),
                None => None,
            };
        Ok(ClientTls {
            files: files.clone(),
            field,
            alpn,
            server_name,
            state: Mutex::new(Loaded { stamps, config }),
        })
    }

    /// The config for a new connection: the files as they are now, or, if they changed into
    /// something unusable, as they last were usable.
    pub fn config(&self) -> Arc<ClientConfig> {
        let now = stamps(&self.files);
        let mut state = self.state.locked();
        if state.stamps != now {
            state.stamps = now;
            match build(&self.files, self.field, &self.alpn) {
                Ok(config) => {
                    state.config = Arc::new(config);
                    tracing::info!(
                        field = self.field,
                        "TLS files changed; new connections use them"
                    );
                }
                Err(error) => tracing::error!(
                    field = self.field,
                    error = %error,
                    "TLS files changed but cannot be used; new connections keep the previous ones"
                ),
            }
        }
        Arc::clone(&state.config)
    }

    /// The name the server's certificate must carry: `server_name`, else `host`.
    pub fn server_name(&self, host: &str) -> std::io::Result<ServerName<'static>> {
        match &self.server_name {
            Some(name) => Ok(name.clone()),
            None => {
                // An IPv6 host comes bracketed from a URL.
                let host = host.trim_start_matches('[').trim_end_matches(']');
                ServerName::try_from(host.to_owned()).map_err(|e| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidInput,
                        format!("`{host}` cannot be checked against a certificate: {e}"),
                    )
                })
            }
        }
    }

    /// The TLS handshake over `tcp` to `host` (or `server_name`), with the current files.
    pub async fn connect<S>(
        &self,
        host: &str,
        tcp: S,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<S>>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let name = self.server_name(host)?;
        tokio_rustls::TlsConnector::from(self.config())
            .connect(name, tcp)
            .await
    }
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("field", &self.field)
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

fn stamps(files: &ClientTlsConfig) -> Stamps {
    let stamp = |path: &Option<std::path::PathBuf>| -> Stamp {
        let meta = std::fs::metadata(path.as_ref()?).ok()?;
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(&meta);
        #[cfg(not(unix))]
        let inode = 0;
        Some((meta.modified().ok(), meta.len(), inode))
    };
    [stamp(&files.ca), stamp(&files.cert), stamp(&files.key)]
}

/// The rustls client config the files describe; errors name the field.
fn build(
    files: &ClientTlsConfig,
    field: &'static str,
    alpn: &[Vec<u8>],
) -> Result<ClientConfig, TlsError> {
    let roots = match &files.ca {
        Some(ca) => roots(ca).map_err(|e| e.in_file(field, "ca"))?,
        None => {
            let mut roots = RootCertStore::empty();
            roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
            roots
        }
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Protocols)?
        .with_root_certificates(roots);
    let mut config = match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => {
            let chain = certs(cert).map_err(|e| e.in_file(field, "cert"))?;
            let key = private_key(key).map_err(|e| e.in_file(field, "key"))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|source| TlsError::ClientPair { field, source })?
        }
        _ => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.to_vec();
    Ok(config)
}

/// Reads every store and lease backend TLS file a config names, as `run` does at start.
pub fn check_client_files(config: &Config) -> Result<(), TlsError> {
    if let Some(tls) = config.store.remote().and_then(|r| r.tls.as_ref()) {
        build(tls, "store.tls", &[])?;
    }
    let backend = config.leases.as_ref().and_then(|l| l.backend.remote());
    if let Some(tls) = backend.and_then(|r| r.tls.as_ref()) {
        build(tls, "leases.backend.tls", &[])?;
    }
    Ok(())
}

impl ClientTls {
    /// The TLS of a connection to `remote`: its `tls` files; without them, the public web
    /// roots for a TLS URL (`rediss://`, `https://`), and none for a plaintext one. `field`
    /// names the config field in messages.
    pub fn for_remote(
        remote: &Remote,
        field: &'static str,
        alpn: &[&[u8]],
    ) -> Result<Option<Arc<ClientTls>>, TlsError> {
        let web_roots = ClientTlsConfig::default();
        let files = match (&remote.tls, remote.url.is_tls()) {
            (Some(files), _) => files,
            (None, true) => &web_roots,
            (None, false) => return Ok(None),
        };
        ClientTls::load(files, field, alpn).map(|tls| Some(Arc::new(tls)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    /// A client certificate issued by `openssl x509 -req` without extensions is X.509 v1:
    /// loading it says so and how to re-issue it.
    #[test]
    fn a_v1_client_certificate_is_explained() {
        let files = ClientTlsConfig {
            cert: Some(fixture("client-v1.pem")),
            key: Some(fixture("client-v1-key.pem")),
            ..Default::default()
        };
        let e = ClientTls::load(&files, "store.tls", &[]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "store.tls.cert and store.tls.key do not form a usable pair: the client certificate \
             is X.509 v1, and rustls accepts only v3 certificates: re-issue it with v3 \
             extensions (with openssl, `openssl x509 -req … -extfile client.ext` where \
             client.ext has at least `subjectAltName` and `extendedKeyUsage = clientAuth`, or \
             `x509_extensions` in the config of `openssl req -x509` or `openssl ca`) (invalid \
             peer certificate: Other(OtherError(UnsupportedCertVersion)))"
        );
    }

    /// The same words for a v1 certificate refused in a handshake (webpki's error, by name).
    #[test]
    fn a_v1_certificate_refused_in_a_handshake_is_explained() {
        #[derive(Debug)]
        struct UnsupportedCertVersion;
        impl std::fmt::Display for UnsupportedCertVersion {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("UnsupportedCertVersion")
            }
        }
        impl std::error::Error for UnsupportedCertVersion {}
        let refused = rustls::Error::InvalidCertificate(rustls::CertificateError::Other(
            rustls::OtherError(Arc::new(UnsupportedCertVersion)),
        ));
        let e = std::io::Error::new(std::io::ErrorKind::InvalidData, refused);
        assert!(certificate_refused(&e));
        assert!(handshake_error(&e, "client").starts_with(
            "the client certificate is X.509 v1, and rustls accepts only v3 certificates: \
             re-issue it"
        ));
        let other = std::io::Error::new(std::io::ErrorKind::InvalidData, "bad record");
        assert!(!certificate_refused(&other));
        assert_eq!(handshake_error(&other, "client"), "bad record");
    }

    #[test]
    fn bad_files_name_their_field() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let files = ClientTlsConfig {
            ca: Some(missing.clone()),
            ..Default::default()
        };
        let e = ClientTls::load(&files, "store.tls", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("store.tls.ca: cannot read certificates from"),
            "{e}"
        );
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let files = ClientTlsConfig {
            cert: Some(empty.clone()),
            key: Some(empty),
            ..Default::default()
        };
        let e = ClientTls::load(&files, "leases.backend.tls", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("leases.backend.tls.cert: no certificate found"),
            "{e}"
        );
    }

    /// A CA certificate, PEM.
    fn ca_pem(name: &str) -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.self_signed(&key).unwrap().pem()
    }

    /// Replaces `path` as rotation does: a new file renamed over the old one.
    fn replace(path: &Path, contents: &str) {
        let next = path.with_extension("next");
        std::fs::write(&next, contents).unwrap();
        std::fs::rename(&next, path).unwrap();
    }

    #[test]
    fn changed_files_are_used_and_unusable_ones_keep_the_last_good_config() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, ca_pem("first")).unwrap();
        let files = ClientTlsConfig {
            ca: Some(ca.clone()),
            ..Default::default()
        };
        let tls = ClientTls::load(&files, "store.tls", &[]).unwrap();
        let first = tls.config();
        assert!(
            Arc::ptr_eq(&first, &tls.config()),
            "unchanged files: same config"
        );
        replace(&ca, "not a certificate\n");
        assert!(
            Arc::ptr_eq(&first, &tls.config()),
            "kept the last good config"
        );
        replace(&ca, &ca_pem("second"));
        let second = tls.config();
        assert!(!Arc::ptr_eq(&first, &second), "rebuilt from the new file");
        std::fs::remove_file(&ca).unwrap();
        assert!(
            Arc::ptr_eq(&second, &tls.config()),
            "a missing file keeps it too"
        );
    }

    #[test]
    fn no_ca_means_the_public_roots() {
        let tls = ClientTls::load(&ClientTlsConfig::default(), "store.tls", &[b"h2"]).unwrap();
        let config = tls.config();
        assert_eq!(config.alpn_protocols, [b"h2".to_vec()]);
        assert!(!config.client_auth_cert_resolver.has_certs());
        assert_eq!(
            tls.server_name("127.0.0.1").unwrap(),
            ServerName::try_from("127.0.0.1").unwrap()
        );
        assert!(tls.server_name("[::1]").is_ok());
    }
}
