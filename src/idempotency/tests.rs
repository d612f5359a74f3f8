//! Unit tests of idempotency records and decisions.

use super::*;
use crate::fence::token::tk;

fn fp(n: u8) -> Fingerprint {
    Fingerprint([n; 32])
}

fn claim(token: Token, f: u8) -> Claim {
    Claim {
        token,
        fingerprint: fp(f),
        rule: EqualTokens::Allow.into(),
        window: Duration::from_secs(5),
        may_execute: true,
        attempt: AttemptId(u128::from(token.get())),
    }
}

fn completed(token: Token, f: u8) -> Record {
    Record {
        phase: Phase::Completed,
        status: Some(201),
        response: Some(StoredResponse {
            status: 201,
            headers: vec![("content-type".into(), b"text/plain".to_vec())],
            body: Bytes::from_static(b"ok\xff"),
            trailers: Vec::new(),
        }),
        ..Record::in_flight(token, fp(f))
    }
}

#[test]
fn absent_key_is_the_fence() {
    assert_eq!(
        decide(None, None, &claim(3.into(), 1)),
        Begin::Execute { previous: None }
    );
    assert_eq!(
        decide(None, Some(5.into()), &claim(3.into(), 1)),
        Begin::Stale { current: 5.into() }
    );
    let reject = Claim {
        rule: EqualTokens::Reject.into(),
        ..claim(5.into(), 1)
    };
    assert_eq!(
        decide(None, Some(5.into()), &reject),
        Begin::Stale { current: 5.into() }
    );
}

#[test]
fn completed_replays_even_after_newer_tokens() {
    let r = completed(3.into(), 1);
    assert_eq!(
        decide(Some(&r), Some(9.into()), &claim(3.into(), 1)),
        Begin::Completed(r.clone())
    );
    let refused_elsewhere = Claim {
        may_execute: false,
        ..claim(3.into(), 1)
    };
    assert_eq!(
        decide(Some(&r), Some(9.into()), &refused_elsewhere),
        Begin::Completed(r)
    );
}

#[test]
fn reuse_wins_over_every_phase() {
    for r in [
        Record::in_flight(3.into(), fp(1)),
        Record::unknown(3.into(), fp(1)),
        completed(3.into(), 1),
    ] {
        assert_eq!(
            decide(Some(&r), Some(3.into()), &claim(3.into(), 2)),
            Begin::Reused
        );
    }
}

#[test]
fn in_flight_is_a_conflict() {
    let r = Record::in_flight(3.into(), fp(1));
    assert_eq!(
        decide(Some(&r), Some(3.into()), &claim(4.into(), 1)),
        Begin::InFlight
    );
}

#[test]
fn unknown_redoes_only_with_a_token_at_least_the_recorded_one() {
    let r = Record::unknown(7.into(), fp(1));
    assert_eq!(
        decide(Some(&r), Some(7.into()), &claim(6.into(), 1)),
        Begin::Stale { current: 7.into() }
    );
    let same = Claim {
        rule: EqualTokens::Reject.into(),
        ..claim(7.into(), 1)
    };
    assert_eq!(
        decide(Some(&r), Some(7.into()), &same),
        Begin::Execute {
            previous: Some(7.into())
        }
    );
    assert_eq!(
        decide(Some(&r), Some(7.into()), &claim(8.into(), 1)),
        Begin::Execute {
            previous: Some(7.into())
        }
    );
    // A newer epoch wrote meanwhile: the fence still applies.
    assert_eq!(
        decide(Some(&r), Some(9.into()), &claim(8.into(), 1)),
        Begin::Stale { current: 9.into() }
    );
}

#[test]
fn may_not_execute_claims_nothing() {
    let c = Claim {
        may_execute: false,
        ..claim(3.into(), 1)
    };
    assert_eq!(decide(None, None, &c), Begin::Refused);
}

#[test]
fn records_round_trip() {
    for r in [
        Record::in_flight(1.into(), fp(1)),
        Record::unknown(tk(u64::MAX >> 1), fp(2)),
        completed(3.into(), 3),
        Record {
            response: None,
            ..completed(4.into(), 4)
        },
        with_trailers(5.into(), 5),
    ] {
        assert_eq!(Record::decode(&r.encode()).unwrap(), r);
    }
    let owned = claim(5.into(), 1).in_flight();
    assert_eq!(owned.attempt, Some(AttemptId(5)));
    assert_eq!(Record::decode(&owned.encode()).unwrap(), owned);
    assert!(Record::decode(b"{}").is_err());
    assert!(Record::decode(b"not json").is_err());
}

fn with_trailers(token: Token, f: u8) -> Record {
    let mut r = completed(token, f);
    let response = r.response.as_mut().unwrap();
    response.trailers = vec![
        ("grpc-status".into(), b"5".to_vec()),
        ("grpc-message".into(), b"not \xfffound".to_vec()),
    ];
    r
}

#[test]
fn records_without_trailers_encode_as_before() {
    let encoded = String::from_utf8(completed(3.into(), 3).encode()).unwrap();
    assert!(!encoded.contains("trailers"), "{encoded}");
    let encoded = String::from_utf8(with_trailers(3.into(), 3).encode()).unwrap();
    assert!(
        encoded.contains(r#""trailers":[["grpc-status","NQ=="],"#),
        "{encoded}"
    );
    let bad = encoded.replace("NQ==", "*");
    assert!(Record::decode(bad.as_bytes()).is_err());
}

#[test]
fn records_written_before_trailers_were_kept_decode() {
    let old = format!(
        r#"{{"phase":"completed","token":3,"fingerprint":"{}","status":201,"response":{{"status":201,"headers":[["content-type","dGV4dC9wbGFpbg=="]],"body":"b2v/"}}}}"#,
        fp(3).hex()
    );
    assert_eq!(
        Record::decode(old.as_bytes()).unwrap(),
        completed(3.into(), 3)
    );
}

#[test]
fn records_without_an_attempt_decode_as_owned_by_nobody() {
    let old = format!(
        r#"{{"phase":"in_flight","token":3,"fingerprint":"{}"}}"#,
        fp(1).hex()
    );
    let record = Record::decode(old.as_bytes()).unwrap();
    assert_eq!(record, Record::in_flight(3.into(), fp(1)));
    assert!(!record.owned_by(&claim(3.into(), 1)));
    let bad = format!(
        r#"{{"phase":"in_flight","token":3,"fingerprint":"{}","attempt":"xyz"}}"#,
        fp(1).hex()
    );
    assert!(Record::decode(bad.as_bytes()).is_err());
}

#[test]
fn only_the_claiming_attempt_owns_its_record() {
    let a = claim(3.into(), 1);
    let record = a.in_flight();
    assert!(record.owned_by(&a));
    let b = Claim {
        attempt: AttemptId(99),
        ..a
    };
    assert!(!record.owned_by(&b));
    assert!(!Record::unknown(3.into(), fp(1)).owned_by(&a));
}

#[test]
fn attempt_ids_are_distinct_and_round_trip() {
    let (a, b) = (AttemptId::next(), AttemptId::next());
    assert_ne!(a, b);
    assert_eq!(a.0 >> 64, b.0 >> 64);
    assert_eq!(AttemptId::from_hex(&a.hex()), Some(a));
    assert_eq!(AttemptId::from_hex(&"0".repeat(31)), None);
    assert_eq!(AttemptId::from_hex(&format!("+{}", "0".repeat(31))), None);
}

#[test]
fn fingerprint_separates_its_parts() {
    let a = Fingerprint::of("POST", "/a", None, b"x");
    assert_eq!(a, Fingerprint::of("POST", "/a", None, b"x"));
    assert_ne!(a, Fingerprint::of("PUT", "/a", None, b"x"));
    assert_ne!(a, Fingerprint::of("POST", "/a", Some(""), b"x"));
    assert_ne!(a, Fingerprint::of("POST", "/ax", None, b""));
    assert_eq!(Fingerprint::from_hex(&a.hex()), Some(a));
    assert_eq!(Fingerprint::from_hex("zz"), None);
}

#[test]
fn retryable_statuses_leave_the_outcome_unknown() {
    for s in [408, 425, 429, 500, 502, 503, 504] {
        assert!(outcome_unknown(s), "{s}");
    }
    for s in [200, 201, 204, 400, 404, 409, 422] {
        assert!(!outcome_unknown(s), "{s}");
    }
}

/// The gRPC rule is the HTTP rule through the canonical mapping (`google.rpc.Code`), and
/// CANCELLED (499) counts as the 408 it stands for.
#[test]
fn grpc_statuses_follow_the_http_rule() {
    let canonical: [(u32, u16); 17] = [
        (0, 200),
        (1, 408), // CANCELLED: 499 "client closed request", read as 408
        (2, 500),
        (3, 400),
        (4, 504),
        (5, 404),
        (6, 409),
        (7, 403),
        (8, 429),
        (9, 400),
        (10, 409),
        (11, 400),
        (12, 501),
        (13, 500),
        (14, 503),
        (15, 500),
        (16, 401),
    ];
    for (code, http) in canonical {
        let text = code.to_string();
        assert_eq!(
            grpc_outcome_unknown(text.as_bytes()),
            outcome_unknown(http),
            "{code}"
        );
    }
    let unknown: Vec<u32> = (0..=16)
        .filter(|c| grpc_outcome_unknown(c.to_string().as_bytes()))
        .collect();
    assert_eq!(unknown, [1, 2, 4, 8, 12, 13, 14, 15]);
    // Not a code: read as UNKNOWN.
    for bad in [&b"17"[..], b"", b"14 ", b"-1", b"ok", b"\xff"] {
        assert!(grpc_outcome_unknown(bad), "{bad:?}");
    }
}

#[test]
fn a_claim_too_far_above_the_maximum_claims_nothing() {
    let far = Claim {
        rule: Rule {
            equal: EqualTokens::Allow,
            max_step: Some(10),
        },
        ..claim(21.into(), 1)
    };
    assert_eq!(
        decide(None, Some(10.into()), &far),
        Begin::TooFar {
            current: Some(10.into())
        }
    );
    assert_eq!(
        decide(None, Some(11.into()), &far),
        Begin::Execute {
            previous: Some(11.into())
        }
    );
    // No maximum counts as 0; a completed record is still replayed.
    assert_eq!(decide(None, None, &far), Begin::TooFar { current: None });
    let done = completed(21.into(), 1);
    assert_eq!(
        decide(Some(&done), Some(10.into()), &far),
        Begin::Completed(done.clone())
    );
    // A redo of an unknown outcome with the same token is held to the step as well.
    let unknown = Record::unknown(21.into(), fp(1));
    assert_eq!(
        decide(Some(&unknown), Some(10.into()), &far),
        Begin::TooFar {
            current: Some(10.into())
        }
    );
}
