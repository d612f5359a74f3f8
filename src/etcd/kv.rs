//! KV: `Range` and `Txn`.

use std::sync::Arc;

use super::pb::etcdserverpb::{
    compare, kv_client, request_op, response_op, DeleteRangeRequest, PutRequest, RangeRequest,
    RangeResponse, RequestOp, ResponseHeader, TxnRequest, TxnResponse,
};
use super::pb::mvccpb::KeyValue;
use super::{retry_unauthenticated, Auth, Error, Transport};

#[derive(Clone)]
pub struct KvClient {
    inner: kv_client::KvClient<Transport>,
    auth: Option<Arc<Auth>>,
}

impl KvClient {
    pub(super) fn new(channel: Transport) -> Self {
        KvClient {
            auth: channel.auth.clone(),
            inner: kv_client::KvClient::new(channel),
        }
    }

    /// The key (a single key: no range options are needed yet).
    pub async fn get(
        &mut self,
        key: impl Into<Vec<u8>>,
        options: Option<GetOptions>,
    ) -> Result<RangeResponse, Error> {
        let request = options.unwrap_or_default().request(key.into());
        retry_unauthenticated(self.auth.as_deref(), request, |request| {
            let mut inner = self.inner.clone();
            async move { Ok(inner.range(request).await?.into_inner()) }
        })
        .await
    }

    /// Up to `limit` keys from `key` (included) to `range_end` (excluded), in key order
    /// (etcd's default); `limit` 0: all of them.
    pub async fn range(
        &mut self,
        key: impl Into<Vec<u8>>,
        range_end: impl Into<Vec<u8>>,
        limit: i64,
    ) -> Result<RangeResponse, Error> {
        let request = RangeRequest {
            key: key.into(),
            range_end: range_end.into(),
            limit,
            ..RangeRequest::default()
        };
        retry_unauthenticated(self.auth.as_deref(), request, |request| {
            let mut inner = self.inner.clone();
            async move { Ok(inner.range(request).await?.into_inner()) }
        })
        .await
    }

    pub async fn txn(&mut self, txn: Txn) -> Result<TxnResponse, Error> {
        retry_unauthenticated(self.auth.as_deref(), txn.request, |request| {
            let mut inner = self.inner.clone();
            async move { Ok(inner.txn(request).await?.into_inner()) }
        })
        .await
    }
}

/// Options of a `Range` of one key.
#[derive(Debug, Clone, Copy, Default)]
pub struct GetOptions {
    count_only: bool,
}

impl GetOptions {
    pub fn new() -> Self {
        Self::default()
    }

    /// Only the count of keys, no key-values.
    pub fn with_count_only(mut self) -> Self {
        self.count_only = true;
        self
    }

    fn request(self, key: Vec<u8>) -> RangeRequest {
        RangeRequest {
            key,
            count_only: self.count_only,
            ..RangeRequest::default()
        }
    }
}

/// Options of a `Put`.
#[derive(Debug, Clone, Copy, Default)]
pub struct PutOptions {
    lease: i64,
}

impl PutOptions {
    pub fn new() -> Self {
        Self::default()
    }

    /// Attaches the key to the lease: the key is deleted when the lease ends.
    pub fn with_lease(mut self, lease: i64) -> Self {
        self.lease = lease;
        self
    }
}

/// A transaction: if every comparison holds, the `and_then` operations, else the `or_else`
/// ones, applied atomically at one revision.
#[derive(Debug, Clone, Default)]
pub struct Txn {
    request: TxnRequest,
}

impl Txn {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn when(mut self, compares: impl IntoIterator<Item = Compare>) -> Self {
        self.request
            .compare
            .extend(compares.into_iter().map(|c| c.0));
        self
    }

    pub fn and_then(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.request.success.extend(ops.into_iter().map(|o| o.0));
        self
    }

    pub fn or_else(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.request.failure.extend(ops.into_iter().map(|o| o.0));
        self
    }
}

/// An operation in a transaction.
#[derive(Debug, Clone)]
pub struct TxnOp(RequestOp);

impl TxnOp {
    fn of(request: request_op::Request) -> Self {
        TxnOp(RequestOp {
            request: Some(request),
        })
    }

    pub fn get(key: impl Into<Vec<u8>>, options: Option<GetOptions>) -> Self {
        let request = options.unwrap_or_default().request(key.into());
        Self::of(request_op::Request::RequestRange(request))
    }

    pub fn put(
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        options: Option<PutOptions>,
    ) -> Self {
        Self::of(request_op::Request::RequestPut(PutRequest {
            key: key.into(),
            value: value.into(),
            lease: options.unwrap_or_default().lease,
            ..PutRequest::default()
        }))
    }

    /// Deletes the key.
    pub fn delete(key: impl Into<Vec<u8>>) -> Self {
        Self::of(request_op::Request::RequestDeleteRange(
            DeleteRangeRequest {
                key: key.into(),
                ..DeleteRangeRequest::default()
            },
        ))
    }

    /// A nested transaction.
    pub fn txn(txn: Txn) -> Self {
        Self::of(request_op::Request::RequestTxn(txn.request))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompareOp {
    Equal,
    Less,
    Greater,
}

/// A comparison of a key's target with a value, guarding a transaction.
#[derive(Debug, Clone)]
pub struct Compare(super::pb::etcdserverpb::Compare);

impl Compare {
    fn of(key: impl Into<Vec<u8>>, op: CompareOp, target: compare::TargetUnion) -> Self {
        let result = match op {
            CompareOp::Equal => compare::CompareResult::Equal,
            CompareOp::Less => compare::CompareResult::Less,
            CompareOp::Greater => compare::CompareResult::Greater,
        };
        let kind = match target {
            compare::TargetUnion::Version(_) => compare::CompareTarget::Version,
            compare::TargetUnion::CreateRevision(_) => compare::CompareTarget::Create,
            compare::TargetUnion::ModRevision(_) => compare::CompareTarget::Mod,
            compare::TargetUnion::Value(_) => compare::CompareTarget::Value,
            compare::TargetUnion::Lease(_) => compare::CompareTarget::Lease,
        };
        Compare(super::pb::etcdserverpb::Compare {
            result: result.into(),
            target: kind.into(),
            key: key.into(),
            range_end: Vec::new(),
            target_union: Some(target),
        })
    }

    /// The revision the key was created at (0: absent).
    pub fn create_revision(key: impl Into<Vec<u8>>, op: CompareOp, revision: i64) -> Self {
        Self::of(key, op, compare::TargetUnion::CreateRevision(revision))
    }

    /// The revision the key was last written at (0: absent).
    pub fn mod_revision(key: impl Into<Vec<u8>>, op: CompareOp, revision: i64) -> Self {
        Self::of(key, op, compare::TargetUnion::ModRevision(revision))
    }

    /// The key's value, byte-wise.
    pub fn value(key: impl Into<Vec<u8>>, op: CompareOp, value: impl Into<Vec<u8>>) -> Self {
        Self::of(key, op, compare::TargetUnion::Value(value.into()))
    }

    /// The lease the key is attached to (0: none).
    pub fn lease(key: impl Into<Vec<u8>>, op: CompareOp, lease: i64) -> Self {
        Self::of(key, op, compare::TargetUnion::Lease(lease))
    }
}

/// The answer of one operation of a transaction (of a put or a delete: only that it ran).
#[derive(Debug, Clone)]
pub enum TxnOpResponse {
    Get(RangeResponse),
    Put,
    Delete,
    Txn(TxnResponse),
}

impl TxnResponse {
    /// Whether the comparisons held (the `and_then` branch ran).
    pub fn succeeded(&self) -> bool {
        self.succeeded
    }

    pub fn header(&self) -> Option<&ResponseHeader> {
        self.header.as_ref()
    }

    /// The answers of the branch that ran, in order.
    pub fn op_responses(&self) -> Vec<TxnOpResponse> {
        self.responses
            .iter()
            .filter_map(|r| {
                Some(match r.response.clone()? {
                    response_op::Response::ResponseRange(r) => TxnOpResponse::Get(r),
                    response_op::Response::ResponsePut(_) => TxnOpResponse::Put,
                    response_op::Response::ResponseDeleteRange(_) => TxnOpResponse::Delete,
                    response_op::Response::ResponseTxn(r) => TxnOpResponse::Txn(r),
                })
            })
            .collect()
    }
}

impl RangeResponse {
    pub fn header(&self) -> Option<&ResponseHeader> {
        self.header.as_ref()
    }

    pub fn kvs(&self) -> &[KeyValue] {
        &self.kvs
    }
}

impl ResponseHeader {
    /// The store's revision when the request was applied.
    pub fn revision(&self) -> i64 {
        self.revision
    }
}

impl KeyValue {
    pub fn key_str(&self) -> Result<&str, Error> {
        Ok(std::str::from_utf8(&self.key)?)
    }

    pub fn value(&self) -> &[u8] {
        &self.value
    }

    pub fn value_str(&self) -> Result<&str, Error> {
        Ok(std::str::from_utf8(&self.value)?)
    }

    pub fn mod_revision(&self) -> i64 {
        self.mod_revision
    }

    /// The lease the key is attached to (0: none).
    pub fn lease(&self) -> i64 {
        self.lease
    }

    /// The revision the key was created at.
    pub fn create_revision(&self) -> i64 {
        self.create_revision
    }

    /// How many times the key was written since it was created (0: absent).
    pub fn version(&self) -> i64 {
        self.version
    }

    pub fn key(&self) -> &[u8] {
        &self.key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_compare_names_its_target() {
        let c = Compare::lease("k", CompareOp::Equal, 7).0;
        assert_eq!(c.target(), compare::CompareTarget::Lease);
        assert_eq!(c.result(), compare::CompareResult::Equal);
        assert_eq!(c.target_union, Some(compare::TargetUnion::Lease(7)));
        let c = Compare::value("k", CompareOp::Less, "v").0;
        assert_eq!(c.target(), compare::CompareTarget::Value);
        assert_eq!(c.result(), compare::CompareResult::Less);
        assert_eq!(c.key, b"k");
    }

    #[test]
    fn a_transaction_keeps_its_branches() {
        let txn = Txn::new()
            .when([Compare::create_revision("k", CompareOp::Equal, 0)])
            .and_then([TxnOp::put("k", "v", Some(PutOptions::new().with_lease(3)))])
            .or_else([TxnOp::get("k", None), TxnOp::delete("k")])
            .request;
        assert_eq!(txn.compare.len(), 1);
        let Some(request_op::Request::RequestPut(put)) = &txn.success[0].request else {
            panic!("not a put: {:?}", txn.success);
        };
        assert_eq!((put.key.as_slice(), put.lease), (&b"k"[..], 3));
        assert_eq!(txn.failure.len(), 2);
    }
}
