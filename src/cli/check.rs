//! `fencegate check`: the config loaded as `run` would load it, the files it names read, and
//! the effective configuration printed (or the error, with its location).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::config::{Config, ConfigError};
use crate::tls::TlsError;

/// Checks the config at `config` and prints it; exit code 1 when it is refused.
pub(super) fn command(config: &Path) -> ExitCode {
    match check(config) {
        Ok(c) => {
            for warning in c.warnings() {
                eprintln!("warning: {}: {warning}", config.display());
            }
            let mut out = String::new();
            out.push_str(&format!("# {}: valid\n", config.display()));
            out.push_str(&format!("# token.max_step: {}\n", max_step(&c)));
            if let Some(leases) = &c.leases {
                let ttl = &leases.ttl;
                out.push_str(&format!(
                    "# leases: ttl {} (minimum {}), renew every {}, local deadline ttl - {}, drain timeout {}{}\n",
                    crate::duration::display(ttl.ttl),
                    crate::duration::display(ttl.minimum),
                    crate::duration::display_ms(ttl.renew_every()),
                    crate::duration::display(ttl.drift_buffer),
                    crate::duration::display(leases.drain_timeout),
                    ttl.p99_work
                        .map(|w| format!(", dedup window {}", crate::duration::display(ttl.ttl + w)))
                        .unwrap_or_default()
                ));
            }
            if let Some(idempotency) = &c.idempotency {
                let routes: Vec<&str> = c
                    .routes
                    .iter()
                    .filter(|r| r.idempotent(Some(idempotency)))
                    .map(|r| r.name.as_str())
                    .collect();
                out.push_str(&format!(
                    "# idempotency: header {}, window {}, on routes [{}]\n",
                    idempotency.header.0,
                    crate::duration::display(idempotency.window()),
                    routes.join(", ")
                ));
            }
            out.push_str(&c.to_yaml());
            // A closed pipe (`check | head`) is not an error worth a panic.
            let _ = std::io::Write::write_all(&mut std::io::stdout(), out.as_bytes());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}

/// What `token.max_step` does with this config, in words (the YAML below shows the value).
fn max_step(c: &Config) -> String {
    use crate::config::Authority;
    match (c.fence.authority, c.token.max_step.get()) {
        (Authority::Leases, _) => "not applied: with fence.authority: leases a token above the \
                                   latest grant is refused as unissued"
            .into(),
        (Authority::None, None) => "off: any token above the recorded maximum is admitted".into(),
        (Authority::None, Some(step)) => format!(
            "a token more than {step} above the recorded maximum (or above {step} for a \
             resource with none) is refused"
        ),
    }
}

/// Why `check` refuses a config file.
#[derive(Debug, thiserror::Error)]
enum CheckError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The file that `upstream_ca` names.
    #[error("{path}: {field}: {source}")]
    File {
        path: PathBuf,
        field: &'static str,
        source: Box<TlsError>,
    },
    /// A file of the listener's, the store's or the lease backend's `tls` mapping (the error
    /// names the field).
    #[error("{path}: {source}")]
    Named {
        path: PathBuf,
        source: Box<TlsError>,
    },
}

/// Loads a config as `run` would, and reads the files it names as `run` does before it
/// listens.
fn check(path: &Path) -> Result<Config, CheckError> {
    let config = Config::load(path)?;
    let named = |source| CheckError::Named {
        path: path.to_owned(),
        source: Box::new(source),
    };
    let file = |field| {
        move |source| CheckError::File {
            path: path.to_owned(),
            field,
            source: Box::new(source),
        }
    };
    // TLS files are part of the config: a missing key should fail here, as it fails `run`.
    if let Some(tls) = &config.tls {
        crate::tls::server_config(tls, &crate::tls::CONFIG_TLS).map_err(named)?;
    }
    // So is the upstream's CA bundle: `run` reads it before it listens.
    if let Some(ca) = &config.upstream_ca {
        crate::tls::client_config(Some(ca)).map_err(file("upstream_ca"))?;
    }
    // And the store's and the lease backend's TLS files.
    crate::tls::check_client_files(&config).map_err(named)?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_max_step_line_says_what_the_ceiling_does() {
        let line = |extra: &str| {
            let yaml = format!("upstream: http://a:1\nstore: {{ kind: memory }}\n{extra}");
            max_step(&Config::parse(&yaml).unwrap())
        };
        assert_eq!(
            line(""),
            "a token more than 1099511627776 above the recorded maximum (or above \
             1099511627776 for a resource with none) is refused"
        );
        assert_eq!(
            line("token: { max_step: 10 }\n"),
            "a token more than 10 above the recorded maximum (or above 10 for a resource with \
             none) is refused"
        );
        assert_eq!(
            line("token: { max_step: off }\n"),
            "off: any token above the recorded maximum is admitted"
        );
        assert_eq!(
            line(
                "token: { max_step: 10 }\nfence: { authority: leases }\nleases: { backend: { kind: \
                 embedded, path: /tmp/unused.db }, ttl: 5s }\n"
            ),
            "not applied: with fence.authority: leases a token above the latest grant is refused \
             as unissued"
        );
    }
}
