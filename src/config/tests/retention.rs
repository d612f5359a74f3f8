use super::*;

/// Forgetting maxima is refused wherever a forgotten maximum could admit a stale token: in
/// observed fencing (only the store stands between an old token and the upstream), for
/// periods too short to be far above the grant events' delay, and on stores that cannot.
#[test]
fn retention_is_refused_where_it_would_be_unsafe() {
    let with = |store: &str, fence: &str| {
        format!(
            "upstream: http://a:1\nstore: {store}\n\
             leases: {{ backend: {{ kind: embedded, path: /tmp/l.db }}, ttl: 5s }}\nfence: {fence}\n"
        )
    };
    let redis = "{ kind: redis, url: 'redis://r:6379/' }";
    for (store, fence, message) in [
        (
            redis,
            "{ retention: 30d }",
            "fence.retention: 720h is safe only with `fence.authority: leases`: without it a \
             forgotten maximum is the only thing between a stale token and the upstream, and a \
             writer that wakes more than 720h after its last write would be admitted; with it, \
             the lease backend refuses every token below its latest grant whatever the store \
             remembers",
        ),
        (
            redis,
            "{ authority: none, retention: 2h }",
            "fence.retention: 2h is safe only with `fence.authority: leases`: without it a \
             forgotten maximum is the only thing between a stale token and the upstream, and a \
             writer that wakes more than 2h after its last write would be admitted; with it, \
             the lease backend refuses every token below its latest grant whatever the store \
             remembers",
        ),
        (
            redis,
            "{ authority: leases, retention: 59m }",
            "fence.retention must be at least 1h (it is 59m): a maximum may be forgotten only \
             long after the grant of its token is known to every fencegate",
        ),
        (
            "{ kind: memory }",
            "{ authority: leases, retention: 1d }",
            "fence.retention is not offered by the `memory` store (tests and demos: it forgets \
             everything when the process ends); use `embedded`, `redis` or `postgres`",
        ),
        (
            "{ kind: etcd, url: 'http://e:2379' }",
            "{ authority: leases, retention: 1d }",
            "fence.retention is not offered by the `etcd` store; use `embedded`, `redis` or \
             `postgres`, or keep the maxima and size etcd for them (see the docs' Memory and \
             sizing)",
        ),
    ] {
        let yaml = with(store, fence);
        let err = Config::parse(&yaml).expect_err(&yaml).to_string();
        assert_eq!(err, message, "{yaml}");
    }
    for store in [
        redis,
        "{ kind: embedded, path: /tmp/f.db }",
        "{ kind: postgres, url: 'postgres://p/db' }",
    ] {
        let yaml = with(store, "{ authority: leases, retention: 1h }");
        let c = Config::parse(&yaml).unwrap_or_else(|e| panic!("{yaml}: {e}"));
        assert_eq!(c.fence.retention, Some(Duration::from_secs(3600)));
    }
    let plain = Config::parse("upstream: http://a:1\n").unwrap();
    assert_eq!(plain.fence.retention, None);
    assert!(
        !plain.to_yaml().contains("retention"),
        "{}",
        plain.to_yaml()
    );
}

/// `token.equal: reject` relies on the recorded maximum alone to refuse a repeat of the latest
/// grant's token (the lease backend admits it): with retention, a forgotten maximum would let
/// a replica admit the repeat, so the pair is refused, on every store that offers retention.
/// Either one alone is accepted.
#[test]
fn retention_is_refused_with_equal_tokens_rejected() {
    let yaml = |store: &str, token: &str, fence: &str| {
        format!(
            "upstream: http://a:1\nstore: {store}\ntoken: {token}\n\
             leases: {{ backend: {{ kind: embedded, path: /tmp/l.db }}, ttl: 5s }}\nfence: {fence}\n"
        )
    };
    for store in [
        "{ kind: redis, url: 'redis://r:6379/' }",
        "{ kind: embedded, path: /tmp/f.db }",
        "{ kind: postgres, url: 'postgres://p/db' }",
    ] {
        let both = yaml(
            store,
            "{ equal: reject }",
            "{ authority: leases, retention: 2h }",
        );
        let err = Config::parse(&both).expect_err(&both).to_string();
        assert_eq!(
            err,
            "fence.retention: 2h is unsafe with `token.equal: reject`: the lease backend admits \
             its latest grant's token, so a repeat of that token is refused only by the recorded \
             maximum, and once the maximum is forgotten (2h after its last raise) a replica \
             would admit the repeat; use `token.equal: allow`, or keep every maximum (no \
             `fence.retention`)",
            "{both}"
        );
        for (token, fence) in [
            ("{ equal: reject }", "{ authority: leases }"),
            ("{ equal: allow }", "{ authority: leases, retention: 2h }"),
        ] {
            let one = yaml(store, token, fence);
            Config::parse(&one).unwrap_or_else(|e| panic!("{one}: {e}"));
        }
    }
}
