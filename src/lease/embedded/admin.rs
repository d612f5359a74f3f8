//! `fencegate leases` on the embedded backend's file. Like the embedded fence store's, the
//! file is one process's: it is read (read-only) only where no fencegate has it open. A lease
//! is held while its row's wall-clock deadline is ahead (the running fencegate judges by its
//! monotonic clock; with it stopped, the row is what is left).

use crate::fence::token::Token;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use redb::{DatabaseError, ReadableDatabase, TableError};

use super::Table;
use crate::conn::BoxFuture;
use crate::lease::admin::{InspectLeases, Lease, LeasePage};
use crate::lease::LeaseError;

/// The embedded backend's file, opened read-only for each command.
pub struct EmbeddedLeasesAdmin {
    path: PathBuf,
    table: String,
}

impl EmbeddedLeasesAdmin {
    pub fn new(path: &Path, prefix: &str) -> Self {
        EmbeddedLeasesAdmin {
            path: path.to_owned(),
            table: format!("{prefix}.leases"),
        }
    }

    fn failed(&self, e: impl std::fmt::Display) -> LeaseError {
        LeaseError::unreachable(format!("cannot read {}: {e}", self.path.display()))
    }

    /// Leases from `from` on (after it with `exclusive`) while the resource starts with
    /// `prefix`, at most `limit`.
    fn read(
        &self,
        from: &str,
        exclusive: bool,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<Lease>, LeaseError> {
        if !self.path.exists() {
            return Ok(Vec::new());
        }
        let db = redb::Builder::new()
            .open_read_only(&self.path)
            .map_err(|e| match e {
                DatabaseError::DatabaseAlreadyOpen => LeaseError::unreachable(format!(
                    "{} is open in another process (a running fencegate: the embedded \
                     backend's file is one process's): stop it, or run this where no fencegate \
                     has the file open",
                    self.path.display()
                )),
                e => self.failed(e),
            })?;
        let txn = db.begin_read().map_err(|e| self.failed(e))?;
        let table = match txn.open_table(Table::new(&self.table)) {
            Ok(table) => table,
            Err(TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(self.failed(e)),
        };
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut out = Vec::new();
        for entry in table.range(from..).map_err(|e| self.failed(e))? {
            let (key, row) = entry.map_err(|e| self.failed(e))?;
            let resource = key.value();
            if exclusive && resource == from {
                continue;
            }
            if !resource.starts_with(prefix) || out.len() >= limit {
                break;
            }
            let (token, expires_ms, lease_id, holder) = row.value();
            let token = Token::try_from(token).map_err(|e| self.failed(e))?;
            out.push(if expires_ms > now_ms && !holder.is_empty() {
                Lease {
                    resource: resource.to_owned(),
                    held: true,
                    holder: Some(holder.to_owned()),
                    lease_id: Some(lease_id.to_owned()),
                    token: Some(token),
                    expires_in_ms: Some(expires_ms - now_ms),
                }
            } else {
                Lease::free(resource, Some(token))
            });
        }
        Ok(out)
    }
}

impl InspectLeases for EmbeddedLeasesAdmin {
    fn kind(&self) -> &'static str {
        "embedded"
    }

    fn lease<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Lease, LeaseError>> {
        Box::pin(async move {
            Ok(self
                .read(resource, false, resource, 1)?
                .into_iter()
                .find(|l| l.resource == resource)
                .unwrap_or_else(|| Lease::free(resource, None)))
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<LeasePage, LeaseError>> {
        Box::pin(async move {
            let fetch = limit.saturating_add(1);
            let leases = match after {
                Some(after) if after >= prefix => self.read(after, true, prefix, fetch)?,
                _ => self.read(prefix, false, prefix, fetch)?,
            };
            Ok(LeasePage::of(leases, limit))
        })
    }
}
