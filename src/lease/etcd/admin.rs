//! `fencegate leases` on etcd: the lock key (its value the holder, attached to the grant's etcd
//! lease, whose id is the lease id and whose remaining TTL the expiry) and the `last` key,
//! whose `mod_revision` is the last grant's token. A list reads every lease key under the
//! resource prefix (keys of one resource do not sort as the resource ids do) and sorts them.

use super::{unavailable, EtcdLeases};
use crate::conn::BoxFuture;
use crate::fence::token::Token;
use crate::lease::admin::{page_of, InspectLeases, Lease, LeasePage};
use crate::lease::LeaseError;

impl EtcdLeases {
    fn leases_root(&self) -> String {
        format!("/{}/leases/", self.prefix)
    }
}

/// The first key after every key that starts with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

impl InspectLeases for EtcdLeases {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    fn lease<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Lease, LeaseError>> {
        Box::pin(async move {
            let mut kv = self.kv.clone();
            let last = kv
                .get(self.last_key(resource), None)
                .await
                .map_err(unavailable)?;
            let token = last
                .kvs()
                .first()
                .and_then(|kv| Token::try_from(kv.mod_revision()).ok());
            let lock = kv
                .get(self.lock_key(resource), None)
                .await
                .map_err(unavailable)?;
            let Some(lock) = lock.kvs().first() else {
                return Ok(Lease::free(resource, token));
            };
            let ttl = self
                .lease
                .clone()
                .time_to_live(lock.lease(), None)
                .await
                .map_err(unavailable)?
                .ttl();
            Ok(Lease {
                resource: resource.to_owned(),
                held: true,
                holder: Some(String::from_utf8_lossy(lock.value()).into_owned()),
                lease_id: Some(lock.lease().to_string()),
                // The grant's revision: the lock's creation.
                token: Token::try_from(lock.create_revision()).ok(),
                expires_in_ms: u64::try_from(ttl).ok().map(|s| s.saturating_mul(1000)),
            })
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<LeasePage, LeaseError>> {
        Box::pin(async move {
            let root = self.leases_root();
            let start = format!("{root}{prefix}").into_bytes();
            let end = prefix_end(&start);
            let response = self
                .kv
                .clone()
                .range(start, end, 0)
                .await
                .map_err(unavailable)?;
            // Every resource ever leased has its `last` key.
            let resources = response
                .kvs()
                .iter()
                .filter_map(|kv| {
                    let key = std::str::from_utf8(kv.key()).ok()?;
                    let resource = key.strip_prefix(&root)?.strip_suffix("/last")?;
                    resource.starts_with(prefix).then(|| resource.to_owned())
                })
                .collect();
            let mut leases = Vec::new();
            for resource in page_of(resources, after, limit) {
                leases.push(self.lease(&resource).await?);
            }
            Ok(LeasePage::of(leases, limit))
        })
    }
}
