//! `fencegate fences` on the embedded store's file.
//!
//! redb lets one process have the file open for writing, and a running fencegate keeps it
//! open (locked) the whole time: inspecting or resetting it works only where no fencegate has
//! it open, so stop the one using it first (docs/operations.md). Reads open the file
//! read-only (a file left by a crash, which redb must repair first, is refused: start and
//! stop fencegate once to repair it); a reset opens it for writing, as fencegate does, and
//! commits one transaction. No cache to tell: the fencegate started afterwards reads the file.

use crate::fence::token::Token;
use std::path::{Path, PathBuf};

use redb::{DatabaseError, ReadableDatabase, TableDefinition, TableError};

use super::{open_file, stored, Names, PAGE_CACHE};
use crate::conn::BoxFuture;
use crate::store::admin::{Fence, Inspect, Page};
use crate::store::StoreError;

/// The embedded store's file, opened for one command at a time.
pub struct EmbeddedAdmin {
    path: PathBuf,
    names: Names,
}

impl EmbeddedAdmin {
    /// Opens nothing yet: each command opens the file and closes it.
    pub fn new(path: &Path, prefix: &str) -> Self {
        EmbeddedAdmin {
            path: path.to_owned(),
            names: Names::new(prefix),
        }
    }

    fn opening(&self, e: DatabaseError) -> StoreError {
        match e {
            DatabaseError::DatabaseAlreadyOpen => StoreError::unreachable(format!(
                "{} is open in another process (a running fencegate: the embedded store's file \
                 is one process's): stop it, or run this where no fencegate has the file open",
                self.path.display()
            )),
            e => StoreError::unreachable(format!("cannot open {}: {e}", self.path.display())),
        }
    }

    fn failed(&self, e: impl std::fmt::Display) -> StoreError {
        StoreError::unreachable(format!("cannot read {}: {e}", self.path.display()))
    }

    /// Up to `limit` maxima from `start` (included, or excluded with `exclusive`) while the
    /// resource starts with `prefix`, with when each was raised if retention kept it.
    fn read(
        &self,
        from: &str,
        exclusive: bool,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<Fence>, StoreError> {
        if !self.path.exists() {
            return Ok(Vec::new());
        }
        let db = redb::Builder::new()
            .set_cache_size(PAGE_CACHE)
            .open_read_only(&self.path)
            .map_err(|e| self.opening(e))?;
        let txn = db.begin_read().map_err(|e| self.failed(e))?;
        let fences = match txn.open_table(TableDefinition::<&str, u64>::new(&self.names.fences)) {
            Ok(table) => table,
            Err(TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(self.failed(e)),
        };
        let raised = txn
            .open_table(TableDefinition::<&str, u64>::new(&self.names.raised))
            .ok();
        let mut out = Vec::new();
        for entry in fences.range(from..).map_err(|e| self.failed(e))? {
            let (key, value) = entry.map_err(|e| self.failed(e))?;
            let resource = key.value();
            if exclusive && resource == from {
                continue;
            }
            if !resource.starts_with(prefix) || out.len() >= limit {
                break;
            }
            let mut fence = Fence::recorded(
                resource,
                Some(stored(value.value()).map_err(|e| self.failed(e))?),
            );
            if let Some(raised) = &raised {
                fence.raised_at_ms = raised
                    .get(resource)
                    .map_err(|e| self.failed(e))?
                    .map(|v| v.value());
            }
            out.push(fence);
        }
        Ok(out)
    }
}

impl Inspect for EmbeddedAdmin {
    fn kind(&self) -> &'static str {
        "embedded"
    }

    fn fence<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Fence, StoreError>> {
        Box::pin(async move {
            let found = self.read(resource, false, resource, 1)?;
            Ok(found
                .into_iter()
                .find(|f| f.resource == resource)
                .unwrap_or_else(|| Fence::absent(resource)))
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Page, StoreError>> {
        Box::pin(async move {
            let fetch = limit.saturating_add(1);
            let fences = match after {
                Some(after) if after >= prefix => self.read(after, true, prefix, fetch)?,
                _ => self.read(prefix, false, prefix, fetch)?,
            };
            Ok(Page::of(fences, limit))
        })
    }

    fn reset<'a>(
        &'a self,
        resource: &'a str,
        to: Token,
    ) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        Box::pin(async move {
            let db = open_file(&self.path).map_err(|e| self.opening(e))?;
            let write = || -> Result<Option<Token>, redb::Error> {
                let txn = db.begin_write()?;
                let before = {
                    let mut table =
                        txn.open_table(TableDefinition::<&str, u64>::new(&self.names.fences))?;
                    let before = table.insert(resource, to.get())?.map(|v| stored(v.value()));
                    before.transpose()?
                };
                txn.commit()?;
                Ok(before)
            };
            write().map_err(|e| {
                StoreError::unreachable(format!("cannot write {}: {e}", self.path.display()))
            })
        })
    }
}
