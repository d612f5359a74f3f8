//! Forgetting maxima not raised for `fence.retention`.
//!
//! `{prefix}.fences.raised` holds when each maximum was last raised (ms since the Unix epoch)
//! and `{prefix}.fences.raised.order` the same pairs in time order, so forgetting visits only
//! the maxima it forgets. Both are written in the transaction of the raise; a raise within
//! [`GRAIN_MS`] of the one recorded keeps the recorded time, so a resource raised over and
//! over costs one lookup, not three writes. A maximum may so be forgotten up to [`GRAIN_MS`]
//! before `retention` after its last raise: the config keeps `retention` at one hour or more,
//! and what makes forgetting safe (the lease backend's refusal of every token below its
//! latest grant) does not depend on the exact period.
//!
//! Maxima recorded while retention was off have no entry: they are kept until their next
//! raise records one. The first commit of a run without retention drops both tables, since
//! its raises do not keep them: an entry left from an earlier run with retention would date a
//! maximum by a raise long past once retention is on again, and forget it however recently it
//! was raised.

use super::*;

/// How close to the recorded time a raise may be and leave it as it is.
pub(super) const GRAIN_MS: u64 = 60_000;

/// How often the writer looks for maxima to forget (it wakes for it when idle).
pub(super) const EVERY_MS: u64 = 60_000;

/// Upper bound on maxima forgotten per transaction; the rest go with the next ones, at once.
pub(super) const MAX_FORGET: usize = 4096;

/// The age tables, open in one write transaction.
pub(super) struct Ages<'t> {
    pub raised: Table<'t, &'static str, u64>,
    pub order: Table<'t, (u64, &'static str), ()>,
    pub now: u64,
}

impl Ages<'_> {
    /// Records that the maximum of `resource` was raised now.
    pub fn touch(&mut self, resource: &str) -> Result<(), redb::Error> {
        let old = self.raised.get(resource)?.map(|v| v.value());
        if old.is_some_and(|at| self.now.saturating_sub(at) < GRAIN_MS) {
            return Ok(());
        }
        if let Some(at) = old {
            self.order.remove((at, resource))?;
        }
        self.order.insert((self.now, resource), ())?;
        self.raised.insert(resource, self.now)?;
        Ok(())
    }

    /// Forgets the maxima last raised before `cutoff`, oldest first, at most [`MAX_FORGET`],
    /// adding their resources to `forgotten`. Returns how many it forgot.
    pub fn forget(
        &mut self,
        fences: &mut Table<&'static str, u64>,
        cutoff: u64,
        forgotten: &mut Vec<Box<str>>,
    ) -> Result<usize, redb::Error> {
        let mut due = Vec::new();
        for entry in self.order.range(..(cutoff, ""))?.take(MAX_FORGET) {
            let (index, _) = entry?;
            let (at, resource) = index.value();
            due.push((at, Box::<str>::from(resource)));
        }
        for (at, resource) in &due {
            self.order.remove((*at, &**resource))?;
            self.raised.remove(&**resource)?;
            fences.remove(&**resource)?;
        }
        let n = due.len();
        forgotten.extend(due.into_iter().map(|(_, r)| r));
        Ok(n)
    }
}
