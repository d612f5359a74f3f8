use super::*;

#[test]
fn header_names_are_spelled_as_people_write_them() {
    for (name, want) in [
        ("fencing-token", "Fencing-Token"),
        ("idempotency-key", "Idempotency-Key"),
        ("x-fence", "X-Fence"),
        ("token", "Token"),
        ("x--a", "X--A"),
    ] {
        assert_eq!(spelled(&HeaderName::from_static(name)), want);
    }
}

#[test]
fn a_store_that_failed_is_the_stores_fault_in_its_own_words() {
    let header = HeaderName::from_static("fencing-token");
    let subject = Subject {
        resource: Some("account:42"),
        token: Some(7.into()),
        ..Subject::default()
    };
    let limit = Duration::from_millis(300);
    let silent = Refusal::StoreUnavailable(Unavailable::Store(StoreError::no_answer_within(limit)));
    let problem = silent.problem(&subject, &header);
    assert_eq!(problem.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(problem.kind(), "urn:fencegate:store-unavailable");
    assert_eq!(
        problem.detail(),
        "the write was not forwarded because it could not be checked: no answer within 300ms"
    );
    assert_eq!(silent.fault(), Fault::Store);
    assert_eq!(silent.outcome(), Outcome::StoreUnavailable);
    assert_eq!(
        silent.response(&subject, &header).headers()[RETRY_AFTER],
        "1"
    );
    let leases = Refusal::StoreUnavailable(Unavailable::Leases(LeaseError::refused(
        "etcd: permission denied",
    )));
    assert_eq!(
        leases.detail(&subject, &header),
        "the write was not forwarded because it could not be checked: the lease backend is \
         unavailable: etcd: permission denied"
    );
    let leases_silent = Unavailable::LeasesSilent(limit);
    assert_eq!(leases_silent.label(), "timeout");
    assert_eq!(
        leases_silent.detail(),
        "the lease backend did not answer within 300ms"
    );
    assert_eq!(
        Refusal::UpstreamTimeout(Duration::ZERO).fault(),
        Fault::Upstream
    );
    assert_eq!(Refusal::TokenRequired.fault(), Fault::Client);
}

#[test]
fn a_stale_token_is_told_only_what_the_store_recorded() {
    let header = HeaderName::from_static("fencing-token");
    let subject = Subject {
        resource: Some("account:42"),
        token: Some(1.into()),
        ..Subject::default()
    };
    assert_eq!(
        Refusal::Stale { current: 34.into() }.detail(&subject, &header),
        "token 1 is below 34, the highest token recorded for account:42; the write was not \
         forwarded"
    );
    // With `fence.authority: leases` the lease backend knows of the newer grant.
    assert_eq!(
        Refusal::Superseded { latest: 34.into() }.detail(&subject, &header),
        "token 1 is below 34, the latest lease granted for account:42: a newer holder has \
         the lease, even if it has not written yet"
    );
}

#[test]
fn an_upstream_timeout_names_the_setting_and_its_value() {
    let header = HeaderName::from_static("fencing-token");
    let subject = Subject::default();
    let late = Refusal::UpstreamTimeout(Duration::from_secs(30));
    assert_eq!(
        late.problem(&subject, &header).status(),
        StatusCode::GATEWAY_TIMEOUT
    );
    assert_eq!(
        late.detail(&subject, &header),
        "the upstream sent no response headers within timeouts.upstream (30s); the request \
         may or may not have been applied"
    );
}

#[test]
fn a_token_too_far_names_the_step_and_the_maximum() {
    let header = HeaderName::from_static("fencing-token");
    let subject = Subject {
        resource: Some("account:42"),
        token: Some(Token::MAX),
        ..Subject::default()
    };
    let far = Refusal::TooFar {
        current: Some(17.into()),
        max_step: 1 << 40,
    };
    let problem = far.problem(&subject, &header);
    assert_eq!(problem.status(), StatusCode::CONFLICT);
    assert_eq!(problem.kind(), "urn:fencegate:token-too-far");
    assert_eq!(
        problem.detail(),
        "token 9223372036854775807 exceeds 17, the highest token recorded for account:42, \
         by more than token.max_step (1099511627776); it was not forwarded and the recorded \
         maximum is unchanged"
    );
    assert_eq!(
        (far.fault(), far.outcome()),
        (Fault::Client, Outcome::TooFar)
    );
    assert_eq!(far.kind().grpc, grpc::Code::Aborted);
    let response = far.response(&subject, &header);
    assert_eq!(response.headers()[TOKEN_CURRENT], "17");
    let first = Refusal::TooFar {
        current: None,
        max_step: 100,
    };
    assert_eq!(
        first.detail(&subject, &header),
        "no token is recorded for account:42, and a first token may be at most \
         token.max_step (100); token 9223372036854775807 was not forwarded and nothing was \
         recorded"
    );
    assert!(first
        .response(&subject, &header)
        .headers()
        .get(TOKEN_CURRENT)
        .is_none());
}

/// The table declares each kind once: no two rows share a problem type, and every refusal
/// picks a row of it.
#[test]
fn each_refusal_kind_is_one_row_of_the_table() {
    let mut urns: Vec<&str> = KINDS.iter().map(|k| k.urn).collect();
    urns.sort_unstable();
    urns.dedup();
    assert_eq!(urns.len(), KINDS.len(), "a problem type is declared twice");
    let one_of_each = [
        Refusal::InvalidToken(TokenError::Grammar),
        Refusal::InvalidPath(crate::fence::path::normalise("nope").unwrap_err()),
        Refusal::TokenRequired,
        Refusal::Stale { current: 1.into() },
        Refusal::Superseded { latest: 1.into() },
        Refusal::Unissued { latest: None },
        Refusal::TooFar {
            current: None,
            max_step: 1,
        },
        Refusal::NoRoute,
        Refusal::InvalidIdempotencyKey(KeyError::Repeated {
            name: "Idempotency-Key".into(),
        }),
        Refusal::RequestTooLarge { limit: 1 },
        Refusal::InvalidRequest(String::new()),
        Refusal::IdempotencyInFlight,
        Refusal::IdempotencyKeyReused,
        Refusal::NotReplayable { status: None },
        Refusal::StoreUnavailable(Unavailable::LeasesSilent(Duration::from_secs(1))),
        Refusal::LeaseNotHeld,
        Refusal::BarrierTimeout,
        Refusal::UpstreamError(String::new()),
        Refusal::UpstreamTimeout(Duration::from_secs(1)),
    ];
    for refusal in &one_of_each {
        let kind = refusal.kind();
        assert!(
            KINDS.iter().any(|row| std::ptr::eq(*row, kind)),
            "{refusal:?} has no row"
        );
        let response = refusal.response(&Subject::default(), &HeaderName::from_static("t"));
        assert_eq!(response.status(), kind.status, "{refusal:?}");
        assert_eq!(
            response.headers().contains_key(RETRY_AFTER),
            kind.retry_after,
            "{refusal:?}"
        );
    }
}
