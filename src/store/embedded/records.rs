//! Idempotency records in the file, and their expiry index.

use super::*;

/// The record of `(resource, key)`, as a claim or an outcome write finds it.
pub(super) struct Found {
    /// Its key in the table.
    pub(super) key: String,
    /// When what is stored under it expires (ms since the Unix epoch), expired or not: its
    /// entry in the expiry index.
    pub(super) expires: Option<u64>,
    /// The stored record if it is live: unexpired at `now`, or the `in_flight` record of an
    /// attempt still running here, or a record this process wrote that its monotonic clock
    /// keeps ([`live_here`]).
    pub(super) live: Option<Record>,
}

impl Found {
    /// Reads the record of `(resource, key)`. The inner error is a record that does not
    /// decode: it fails the one operation, not the batch.
    pub(super) fn read(
        records: &Table<&'static str, (u64, &'static [u8])>,
        running_here: &Running,
        (resource, key): (&str, &str),
        now: u64,
        monotonic: Instant,
    ) -> Result<Result<Found, StoreError>, redb::Error> {
        let key = record_key(resource, key);
        let stored = match records.get(key.as_str())? {
            Some(guard) => {
                let (at, bytes) = guard.value();
                match Record::decode(bytes) {
                    Ok(record) => Some((at, record)),
                    Err(e) => {
                        return Ok(Err(StoreError::corrupt(format!(
                            "the idempotency record {key:?} is unreadable: {e}"
                        ))))
                    }
                }
            }
            None => None,
        };
        let expires = stored.as_ref().map(|(at, _)| *at);
        let live = stored
            .filter(|(at, r)| live_here(running_here, &key, *at, r, monotonic).unwrap_or(*at > now))
            .map(|(_, r)| r);
        Ok(Ok(Found { key, expires, live }))
    }
}

/// Writes `record` under `key` to expire at `at`, moving its entry in the expiry index from
/// `old` (the expiry of the record it replaces, if any).
pub(super) fn write_record(
    records: &mut Table<&'static str, (u64, &'static [u8])>,
    expiries: &mut Table<(u64, &'static str), ()>,
    key: &str,
    old: Option<u64>,
    at: u64,
    record: &Record,
) -> Result<(), redb::Error> {
    if let Some(old) = old {
        expiries.remove((old, key))?;
    }
    records.insert(key, (at, record.encode().as_slice()))?;
    expiries.insert((at, key), ())?;
    Ok(())
}

/// Removes records that expired at or before `now`, visiting only those (at most
/// [`MAX_PURGE`]).
pub(super) fn purge(
    records: &mut Table<&'static str, (u64, &'static [u8])>,
    expiries: &mut Table<(u64, &'static str), ()>,
    now: u64,
    live: &Running,
    monotonic: Instant,
) -> Result<(), redb::Error> {
    let mut expired = Vec::new();
    for entry in expiries
        .range(..(now.saturating_add(1), ""))?
        .take(MAX_PURGE)
    {
        let (index, _) = entry?;
        let (at, key) = index.value();
        expired.push((at, key.to_owned()));
    }
    for (at, key) in expired {
        // A record this process wrote stays, index entry and all, until its monotonic
        // deadline.
        if live.contains_key(&key) {
            let guard = records.get(key.as_str())?;
            let bytes = guard.as_ref().map(|g| g.value().1.to_vec());
            drop(guard);
            let record = bytes.and_then(|b| Record::decode(&b).ok());
            if record.is_some_and(|r| live_here(live, &key, at, &r, monotonic) == Some(true)) {
                continue;
            }
        }
        expiries.remove((at, key.as_str()))?;
        // The index is exact, but never remove a record that does not expire here.
        let due = records
            .get(key.as_str())?
            .is_some_and(|g| g.value().0 == at);
        if due {
            records.remove(key.as_str())?;
        }
    }
    Ok(())
}
