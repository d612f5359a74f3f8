//! The decision, without sockets: a [`Fence`] over the memory store, asked about request
//! heads.

use crate::fence::resource::rid;
use std::sync::Arc;

use http::{Request, StatusCode};

use super::{Decision, Fence, Fenced, Pass};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::problem::refusal::Refusal;
use crate::store::MemoryStore;

fn fence(extra: &str) -> Fence {
    let yaml = format!(
        "store: {{ kind: memory }}\n\
         routes:\n  - {{ name: accounts, path: '/accounts/{{id}}', methods: [PUT], \
         resource: 'account:{{id}}'{extra} }}\n"
    );
    let config = Config::parse_fence(&yaml).unwrap();
    let metrics = Arc::new(Metrics::new(prometheus::Registry::new()).unwrap());
    Fence::new(&config, Arc::new(MemoryStore::new()), metrics)
}

fn put(path: &str, token: Option<&str>) -> Request<()> {
    let mut req = Request::put(path).header("host", "ledger");
    if let Some(token) = token {
        req = req.header("fencing-token", token);
    }
    req.body(()).unwrap()
}

/// The refusal a decision is, or a panic naming what it was instead.
fn refusal(decision: Decision) -> Refusal {
    match decision {
        Decision::Refuse(refused) => refused.refusal,
        Decision::Forward(_) => panic!("forwarded"),
        Decision::Later(_) => panic!("left to wait"),
    }
}

#[test]
fn a_higher_token_is_admitted_and_raises_and_a_lower_one_is_stale() {
    let fence = fence("");
    match fence.decide(&put("/accounts/42", Some("34"))) {
        Decision::Forward(Pass {
            normalised,
            route: Some(0),
            fenced:
                Some(Fenced {
                    resource,
                    token: Some(token),
                    attach: false,
                }),
        }) => {
            assert_eq!(token, 34.into());
            assert_eq!(normalised, "/accounts/42");
            assert_eq!(resource, "account:42");
        }
        _ => panic!("34 was not admitted at once"),
    }
    let stale = refusal(fence.decide(&put("/accounts/42", Some("33"))));
    assert!(
        matches!(stale, Refusal::Stale { current } if current == 34.into()),
        "{stale:?}"
    );
    assert_eq!(stale.kind().status, StatusCode::CONFLICT);
    // Another resource has its own maximum.
    let other = fence.decide(&put("/accounts/7", Some("1")));
    assert!(matches!(
        other,
        Decision::Forward(Pass {
            fenced: Some(_),
            ..
        })
    ));
}

#[test]
fn a_write_without_a_token_or_with_a_bad_one_is_refused_before_the_store() {
    let fence = fence("");
    let missing = refusal(fence.decide(&put("/accounts/42", None)));
    assert!(matches!(missing, Refusal::TokenRequired), "{missing:?}");
    let bad = refusal(fence.decide(&put("/accounts/42", Some("7x"))));
    assert!(matches!(bad, Refusal::InvalidToken(_)), "{bad:?}");
    // Neither raised anything: a first token of 1 is still admitted.
    let first = fence.decide(&put("/accounts/42", Some("1")));
    assert!(matches!(
        first,
        Decision::Forward(Pass {
            fenced: Some(_),
            ..
        })
    ));
}

#[test]
fn reads_and_unrouted_paths_pass_unfenced() {
    let fence = fence("");
    let get = Request::get("/accounts/42")
        .header("host", "ledger")
        .body(())
        .unwrap();
    assert!(matches!(
        fence.decide(&get),
        Decision::Forward(Pass {
            route: Some(0),
            fenced: None,
            ..
        })
    ));
    assert!(matches!(
        fence.decide(&put("/elsewhere", None)),
        Decision::Forward(Pass {
            route: None,
            fenced: None,
            ..
        })
    ));
}

#[test]
fn a_serialized_route_leaves_the_write_to_wait_for_its_barrier() {
    let fence = fence(", ordering: serialize");
    match fence.decide(&put("/accounts/42", Some("5"))) {
        Decision::Later(later) => {
            assert_eq!((later.route, later.token), (0, 5.into()));
            assert_eq!(later.resource, "account:42");
            assert!(later.key.is_none());
        }
        _ => panic!("a serialized write was decided at once"),
    }
}

#[tokio::test]
async fn admit_raises_and_then_refuses_the_same_token_below() {
    let fence = fence(", ordering: serialize");
    let route = fence.route(0);
    let ticket = fence
        .admit(route, &rid("account:42"), 5.into())
        .await
        .unwrap();
    assert!(ticket.is_some(), "a serialized write holds its turn");
    drop(ticket);
    match fence.admit(route, &rid("account:42"), 4.into()).await {
        Err(Refusal::Stale { current }) if current == 5.into() => {}
        Err(other) => panic!("{other:?}"),
        Ok(_) => panic!("4 was admitted after 5"),
    }
}
