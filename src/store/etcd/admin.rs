//! `fencegate fences` on etcd: a list is one range of `/{prefix}/fences/{resource prefix}…`
//! (etcd answers in key order); a reset is one transaction that reads and writes the maximum
//! and writes `/{prefix}/resets`, whose `version` (writes since it was created) is the reset
//! generation running fencegates follow ([`crate::store::shared::resets`]).

use super::{padded, parse, unavailable, EtcdRemote};
use crate::conn::BoxFuture;
use crate::etcd::{KeyValue, Txn, TxnOp, TxnOpResponse};
use crate::fence::token::Token;
use crate::store::admin::{Fence, Inspect, Page};
use crate::store::StoreError;

impl EtcdRemote {
    fn resets_key(&self) -> String {
        format!("/{}/resets", self.prefix)
    }

    /// The reset generation (0: no reset ever).
    pub(super) async fn read_resets(&self) -> Result<u64, StoreError> {
        let response = self
            .kv
            .clone()
            .get(self.resets_key(), None)
            .await
            .map_err(unavailable)?;
        Ok(response
            .kvs()
            .first()
            .and_then(|kv| u64::try_from(kv.version()).ok())
            .unwrap_or(0))
    }

    fn fence_of(&self, kv: &KeyValue) -> Result<Fence, StoreError> {
        let key = std::str::from_utf8(kv.key())
            .map_err(|_| StoreError::corrupt("etcd holds a key that is not UTF-8"))?;
        let resource = key.strip_prefix(&self.key("")).unwrap_or(key);
        let mut fence = Fence::recorded(resource, Some(parse(kv.value())?));
        fence.mod_revision = Some(kv.mod_revision());
        Ok(fence)
    }
}

/// The first key after every key that starts with `prefix` (etcd's `range_end` of a prefix).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: to the end of the keyspace.
    vec![0]
}

impl Inspect for EtcdRemote {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    fn fence<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Fence, StoreError>> {
        Box::pin(async move {
            let response = self
                .kv
                .clone()
                .get(self.key(resource), None)
                .await
                .map_err(unavailable)?;
            match response.kvs().first() {
                Some(kv) => self.fence_of(kv),
                None => Ok(Fence::absent(resource)),
            }
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<Page, StoreError>> {
        Box::pin(async move {
            let first = self.key(prefix).into_bytes();
            let end = prefix_end(&first);
            let start = match after {
                // The first key after `after`'s.
                Some(after) if self.key(after).into_bytes() >= first => {
                    let mut key = self.key(after).into_bytes();
                    key.push(0);
                    key
                }
                _ => first,
            };
            let fetch = i64::try_from(limit.saturating_add(1)).unwrap_or(i64::MAX);
            let response = self
                .kv
                .clone()
                .range(start, end, fetch)
                .await
                .map_err(unavailable)?;
            let fences = response
                .kvs()
                .iter()
                .map(|kv| self.fence_of(kv))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Page::of(fences, limit))
        })
    }

    fn reset<'a>(
        &'a self,
        resource: &'a str,
        to: Token,
    ) -> BoxFuture<'a, Result<Option<Token>, StoreError>> {
        Box::pin(async move {
            let key = self.key(resource);
            let txn = Txn::new().and_then([
                TxnOp::get(key.clone(), None),
                TxnOp::put(key, padded(to), None),
                TxnOp::put(self.resets_key(), resource, None),
            ]);
            let response = self.kv.clone().txn(txn).await.map_err(unavailable)?;
            let before = response.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(get) => Some(get),
                _ => None,
            });
            let Some(before) = before else {
                return Err(StoreError::corrupt("etcd: malformed transaction answer"));
            };
            before.kvs().first().map(|kv| parse(kv.value())).transpose()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_at_its_last_byte_plus_one() {
        assert_eq!(prefix_end(b"/p/fences/a"), b"/p/fences/b".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
    }
}
