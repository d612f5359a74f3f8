//! Maxima in etcd: one transaction per compare-and-raise.
//!
//! Values are 20-digit zero-padded decimals, so etcd's byte-wise value comparison is numeric
//! comparison. The transaction: if the key does not exist, create it; else, in a nested
//! transaction, if the stored value is below the token, read it and overwrite it; else read
//! it. etcd applies the whole transaction atomically at one revision.

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, KvClient, Txn, TxnOp, TxnOpResponse,
};

use super::shared::Remote;
use super::{decide, BoxFuture, StoreError, Verdict};
use crate::config::EqualTokens;

pub struct EtcdRemote {
    /// The client keeps a balanced, lazily (re)connecting channel to the endpoints.
    kv: KvClient,
    prefix: String,
}

impl EtcdRemote {
    /// `url`: `etcd://host:port[,host:port...]` or `http://host:port[,...]`.
    pub async fn connect(url: &str, prefix: &str) -> Result<Self, StoreError> {
        let endpoints = endpoints(url).map_err(StoreError::Unavailable)?;
        let options = ConnectOptions::new()
            .with_connect_timeout(std::time::Duration::from_secs(1))
            .with_timeout(std::time::Duration::from_secs(2))
            .with_keep_alive(
                std::time::Duration::from_secs(5),
                std::time::Duration::from_secs(2),
            );
        let client = Client::connect(endpoints, Some(options))
            .await
            .map_err(unavailable)?;
        Ok(EtcdRemote {
            kv: client.kv_client(),
            prefix: prefix.to_owned(),
        })
    }

    fn key(&self, resource: &str) -> String {
        format!("/{}/fences/{resource}", self.prefix)
    }
}

/// `etcd://host:port[,host:port...]` or `http://...`, as endpoint URLs. Shared with the etcd
/// lease backend, so both accept the same forms.
pub(crate) fn endpoints(url: &str) -> Result<Vec<String>, String> {
    let rest = url
        .strip_prefix("etcd://")
        .or_else(|| url.strip_prefix("http://"))
        .ok_or_else(|| format!("etcd url must start with etcd:// or http://: {url}"))?;
    let endpoints: Vec<String> = rest
        .trim_end_matches('/')
        .split(',')
        .filter(|e| !e.is_empty())
        .map(|e| format!("http://{e}"))
        .collect();
    if endpoints.is_empty() {
        return Err("etcd url names no endpoint".into());
    }
    Ok(endpoints)
}

fn unavailable(e: etcd_client::Error) -> StoreError {
    StoreError::Unavailable(format!("etcd: {e}"))
}

fn padded(token: u64) -> String {
    format!("{token:020}")
}

fn parse(value: &[u8]) -> Result<u64, StoreError> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| StoreError::Unavailable("etcd holds a non-token maximum".into()))
}

/// The value read by the first `Get` among transaction responses.
fn read_value(responses: &[TxnOpResponse]) -> Result<Option<u64>, StoreError> {
    for response in responses {
        if let TxnOpResponse::Get(get) = response {
            return get.kvs().first().map(|kv| parse(kv.value())).transpose();
        }
    }
    Ok(None)
}

impl Remote for EtcdRemote {
    fn raise<'a>(
        &'a self,
        resource: &'a str,
        token: u64,
        equal: EqualTokens,
    ) -> BoxFuture<'a, Result<Verdict, StoreError>> {
        Box::pin(async move {
            let key = self.key(resource);
            let value = padded(token);
            let existing = Txn::new()
                .when([Compare::value(key.clone(), CompareOp::Less, value.clone())])
                .and_then([
                    TxnOp::get(key.clone(), None),
                    TxnOp::put(key.clone(), value.clone(), None),
                ])
                .or_else([TxnOp::get(key.clone(), None)]);
            let txn = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key, value, None)])
                .or_else([TxnOp::txn(existing)]);
            let response = self.kv.clone().txn(txn).await.map_err(unavailable)?;
            if response.succeeded() {
                return Ok(Verdict::Admitted { previous: None });
            }
            let inner = response
                .op_responses()
                .into_iter()
                .find_map(|r| match r {
                    TxnOpResponse::Txn(inner) => Some(inner),
                    _ => None,
                })
                .ok_or_else(|| {
                    StoreError::Unavailable("etcd: malformed transaction answer".into())
                })?;
            let current = read_value(&inner.op_responses())?;
            if inner.succeeded() {
                Ok(Verdict::Admitted { previous: current })
            } else {
                Ok(decide(current, token, equal))
            }
        })
    }

    fn get<'a>(&'a self, resource: &'a str) -> BoxFuture<'a, Result<Option<u64>, StoreError>> {
        Box::pin(async move {
            let response = self
                .kv
                .clone()
                .get(self.key(resource), None)
                .await
                .map_err(unavailable)?;
            response
                .kvs()
                .first()
                .map(|kv| parse(kv.value()))
                .transpose()
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async move {
            self.kv
                .clone()
                .get("/", Some(etcd_client::GetOptions::new().with_count_only()))
                .await
                .map_err(unavailable)?;
            Ok(())
        })
    }

    fn begin_idempotent<'a>(
        &'a self,
        _resource: &'a str,
        _key: &'a str,
        _claim: &'a crate::idempotency::Claim,
    ) -> BoxFuture<'a, Result<crate::idempotency::Begin, StoreError>> {
        Box::pin(std::future::ready(Err(StoreError::Unavailable(
            "idempotency records are not implemented for this store yet".into(),
        ))))
    }

    fn finish_idempotent<'a>(
        &'a self,
        _resource: &'a str,
        _key: &'a str,
        _claim: &'a crate::idempotency::Claim,
        _outcome: &'a crate::idempotency::Record,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(std::future::ready(Err(StoreError::Unavailable(
            "idempotency records are not implemented for this store yet".into(),
        ))))
    }

    fn kind(&self) -> &'static str {
        "etcd"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_orders_like_numbers() {
        assert!(padded(9) < padded(10));
        assert!(padded(i64::MAX as u64 - 1) < padded(i64::MAX as u64));
        assert_eq!(padded(i64::MAX as u64).len(), 20);
        assert_eq!(parse(padded(42).as_bytes()).unwrap(), 42);
    }

    #[test]
    fn endpoint_forms() {
        assert_eq!(
            endpoints("etcd://a:2379,b:2379").unwrap(),
            ["http://a:2379", "http://b:2379"]
        );
        assert_eq!(
            endpoints("http://127.0.0.1:2379/").unwrap(),
            ["http://127.0.0.1:2379"]
        );
        assert!(endpoints("redis://x").is_err());
    }
}
