//! `fencegate leases` on Redis: the lease key (`<lease_id>|<token>|<holder>`, with its expiry)
//! and the token counter, which every resource ever leased has; a list `SCAN`s the counters
//! under the prefix and sorts them.

use super::{parse_token, unavailable, RedisLeases};
use crate::conn::redis::{glob_escape, ScanCursor};
use crate::conn::BoxFuture;
use crate::lease::admin::{page_of, InspectLeases, Lease, LeasePage};
use crate::lease::LeaseError;

impl RedisLeases {
    async fn read(&self, resources: &[String]) -> Result<Vec<Lease>, LeaseError> {
        let replies: Vec<(Option<String>, i64, Option<String>)> = self
            .conn
            .pipelined(
                resources,
                |r| self.key(r, "lease"),
                |pipe, r| {
                    let lease = self.key(r, "lease");
                    pipe.cmd("GET")
                        .arg(&lease)
                        .cmd("PTTL")
                        .arg(&lease)
                        .cmd("GET")
                        .arg(self.key(r, "token"));
                },
            )
            .await
            .map_err(unavailable)?;
        resources
            .iter()
            .zip(replies)
            .map(|(resource, (lease, ttl, counter))| {
                let counter = counter.as_deref().map(parse_token).transpose()?;
                let Some(lease) = lease else {
                    return Ok(Lease::free(resource, counter));
                };
                // The holder is last, so it may contain `|`.
                let mut parts = lease.splitn(3, '|');
                let (Some(id), Some(token), Some(holder)) =
                    (parts.next(), parts.next(), parts.next())
                else {
                    return Err(LeaseError::corrupt(format!(
                        "redis holds a malformed lease `{lease}`"
                    )));
                };
                Ok(Lease {
                    resource: resource.clone(),
                    held: true,
                    holder: Some(holder.to_owned()),
                    lease_id: Some(id.to_owned()),
                    token: Some(parse_token(token)?),
                    expires_in_ms: u64::try_from(ttl).ok(),
                })
            })
            .collect()
    }
}

impl InspectLeases for RedisLeases {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn lease<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Lease, LeaseError>> {
        Box::pin(async move {
            let mut leases = self.read(&[resource.to_owned()]).await?;
            Ok(leases.pop().unwrap_or_else(|| Lease::free(resource, None)))
        })
    }

    fn list<'a>(
        &'a self,
        prefix: &'a str,
        after: Option<&'a str>,
        limit: usize,
    ) -> BoxFuture<'a, Result<LeasePage, LeaseError>> {
        Box::pin(async move {
            let pattern = format!("{}:{{{}*}}:token", self.prefix, glob_escape(prefix));
            let head = format!("{}:{{", self.prefix);
            let mut resources = Vec::new();
            let mut cursor = ScanCursor::default();
            while !cursor.done() {
                let keys: Vec<String> = self
                    .conn
                    .scan(&mut cursor, &pattern)
                    .await
                    .map_err(unavailable)?;
                resources.extend(keys.iter().filter_map(|k| {
                    let r = k.strip_prefix(&head)?.strip_suffix("}:token")?;
                    r.starts_with(prefix).then(|| r.to_owned())
                }));
            }
            let resources = page_of(resources, after, limit);
            Ok(LeasePage::of(self.read(&resources).await?, limit))
        })
    }
}
