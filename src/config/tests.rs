use super::*;

const MINIMAL: &str = "upstream: http://127.0.0.1:8080\n";

fn err(yaml: &str) -> String {
    Config::parse(yaml).expect_err("config should be refused")
}

#[test]
fn minimal_config_gets_spec_defaults() {
    let c = Config::parse(MINIMAL).unwrap();
    assert_eq!(c.listen.to_string(), "0.0.0.0:7440");
    assert_eq!(c.admin.to_string(), "0.0.0.0:7441");
    assert_eq!(c.token.header.0.as_str(), "fencing-token");
    assert_eq!(c.token.equal, EqualTokens::Allow);
    assert_eq!(c.store.kind, StoreKind::Embedded);
    assert_eq!(c.store.path.as_deref(), Some(Path::new(DEFAULT_STORE_PATH)));
    assert_eq!(c.unmatched, Unmatched::Forward);
    assert!(c.routes.is_empty());
}

#[test]
fn spec_example_routes_parse() {
    let c = Config::parse(
        r#"
upstream: https://ledger.internal:8443
token: { header: X-Fence, equal: reject }
store: { kind: memory }
routes:
  - name: accounts
    path: /accounts/{id}
    methods: [POST, PUT, PATCH, DELETE]
    resource: "account:{id}"
    missing_token: reject
    ordering: serialize
    barrier_timeout: 1500ms
  - name: health
    path: /healthz
    fence: false
unmatched: reject
"#,
    )
    .unwrap();
    assert!(c.upstream.is_https());
    assert_eq!(c.token.header.0.as_str(), "x-fence");
    let r = &c.routes[0];
    assert_eq!(r.ordering, Ordering::Serialize);
    assert_eq!(r.barrier_timeout, Duration::from_millis(1500));
    assert_eq!(
        r.resource.as_ref().unwrap().captures().collect::<Vec<_>>(),
        ["id"]
    );
    assert!(!c.routes[1].fence);
}

#[test]
fn unknown_field_names_line_column_and_path() {
    let e = err("upstream: http://a:1\nroutes:\n  - name: a\n    path: /a\n    resourse: x\n");
    assert!(e.contains("routes[0]"), "{e}");
    assert!(e.contains("unknown field `resourse`"), "{e}");
    assert!(e.contains("line 5 column 5"), "{e}");
}

#[test]
fn bad_values_name_their_field() {
    let cases = [
        (
            "upstream: ftp://a\n",
            "upstream",
            "scheme must be http or https",
        ),
        (
            "upstream: http://a:1/base\n",
            "upstream",
            "host and port only",
        ),
        (
            "upstream: http://a:1\ntoken: { header: fencing_token }\n",
            "token.header",
            "`_`",
        ),
        (
            "upstream: http://a:1\ntoken: { equal: sometimes }\n",
            "token.equal",
            "unknown variant",
        ),
        (
            "upstream: http://a:1\nroutes: [{ name: a, path: /a, methods: [put] }]\n",
            "routes[0].methods[0]",
            "did you mean `PUT`",
        ),
        (
            "upstream: http://a:1\nroutes: [{ name: a, path: /a, barrier_timeout: soon }]\n",
            "routes[0].barrier_timeout",
            "",
        ),
        (
            "upstream: http://a:1\nroutes: [{ name: a, path: 'a/{id}' }]\n",
            "routes[0].path",
            "starts with `/`",
        ),
        (
            "upstream: http://a:1\nroutes: [{ name: a, path: '/a/{id}', resource: 'x:{ic}' }]\n",
            "routes",
            "no such capture",
        ),
        (
            "upstream: http://a:1\nroutes: [{ name: a, path: /a }, { name: a, path: /b }]\n",
            "routes",
            "already used",
        ),
        (
            "upstream: http://a:1\nstore: { kind: postgres }\n",
            "store",
            "needs a `url`",
        ),
        (
            "upstream: http://a:1\nstore: { kind: redis, url: 'postgres://x' }\n",
            "store",
            "does not fit",
        ),
        (
            "upstream: http://a:1\nstore: { kind: redis, url: 'redis://x', tls: {} }\n",
            "store",
            "`tls` needs a rediss:// url",
        ),
        (
            "upstream: http://a:1\nstore: { kind: etcd, url: 'etcd://x:1', tls: { ca: c.pem } }\n",
            "store",
            "`tls` needs an https:// url",
        ),
        (
            "upstream: http://a:1\nstore: { kind: postgres, url: 'postgres://x/db?sslmode=disable', tls: {} }\n",
            "store",
            "remove `sslmode=disable`",
        ),
        (
            "upstream: http://a:1\nstore: { kind: postgres, url: 'postgres://x/db?sslmode=require' }\n",
            "store",
            "`sslmode=require` needs the `tls` mapping",
        ),
        (
            "upstream: http://a:1\nstore: { kind: rediss, url: 'rediss://x', tls: { cert: c.pem } }\n",
            "store",
            "unknown variant",
        ),
        (
            "upstream: http://a:1\nstore: { kind: redis, url: 'rediss://x', tls: { cert: c.pem } }\n",
            "store.tls",
            "`cert` needs its `key`",
        ),
        (
            "upstream: http://a:1\nstore: { kind: redis, url: 'rediss://x', tls: { server_name: 'a b' } }\n",
            "store.tls",
            "neither a DNS name nor an IP address",
        ),
        (
            "upstream: http://a:1\nstore: { kind: memory, tls: {} }\n",
            "store",
            "`tls` is for the redis, postgres and etcd stores",
        ),
        (
            "upstream: http://a:1\nleases: { backend: { kind: embedded, tls: {} }, ttl: 1s }\n",
            "leases.backend",
            "`tls` is for the redis, postgres and etcd backends",
        ),
        (
            "upstream: http://a:1\nleases: { backend: { kind: redis, url: 'rediss://r:6380', tls: { key: k.pem } }, ttl: 1s }\n",
            "leases.backend.tls",
            "`key` needs its `cert`",
        ),
        (
            "upstream: http://a:1\nlimits: { max_connections: 0 }\n",
            "limits",
            "max_connections",
        ),
        (
            "upstream: http://a:1\nlimits: { max_header_bytes: 1024 }\n",
            "limits",
            "8192",
        ),
        (
            "upstream: http://a:1\ntimeouts: { upstream: 0s }\n",
            "timeouts",
            "greater than zero",
        ),
        (
            "upstream: http://a:1\nroutes: [{ name: a, path: '/x/{id}' }, { name: b, path: '/x/{id}', methods: [PUT] }]\n",
            "routes",
            "both fence PUT",
        ),
        (
            "upstream: http://a:1\nstore: { kind: redis, url: 'redis://x', prefix: my-app }\n",
            "store",
            "letters, digits or `_`",
        ),
        (
            "upstream: http://a:1\nidempotency: { window: 1s, max_response_bytes: lots }\n",
            "idempotency.max_response_bytes",
            "invalid",
        ),
        (
            "upstream: http://a:1\nleases: { backend: { kind: embedded }, ttl: { p99_work: 800ms, p99_rtt: 40ms, safety_margin: 200ms, ttl: 1s } }\n",
            "leases.ttl",
            "below the derived minimum",
        ),
        (
            "upstream: http://a:1\nleases: { backend: { kind: redis }, ttl: 1s }\n",
            "leases.backend",
            "needs a `url`",
        ),
        ("upstream: http://a:1\nlisten: 7440\n", "listen", ""),
    ];
    for (yaml, path, message) in cases {
        let e = err(yaml);
        assert!(
            e.starts_with(&format!("{path}: "))
                || e.contains(&format!(" {path}"))
                || e.contains(path),
            "{yaml}: {e}"
        );
        assert!(e.contains(message), "{yaml}: {e}");
        assert!(e.contains("line "), "{yaml}: no location in {e}");
    }
}

#[test]
fn effective_config_roundtrips() {
    let c = Config::parse(
        "upstream: http://127.0.0.1:9\nstore: { kind: memory }\nroutes: [{ name: a, path: '/a/{id}', resource: 'a:{id}' }]\n",
    )
    .unwrap();
    let again = Config::parse(&c.to_yaml()).unwrap();
    assert_eq!(again.to_yaml(), c.to_yaml());
}

#[test]
fn store_urls_never_print_their_password() {
    let c = Config::parse(
        "upstream: http://a:1\nstore: { kind: postgres, url: 'postgres://app:s3cret@db:5432/fences' }\n",
    )
    .unwrap();
    let url = c.store.url.as_ref().unwrap();
    assert_eq!(url.expose(), "postgres://app:s3cret@db:5432/fences");
    assert_eq!(url.to_string(), "postgres://app:****@db:5432/fences");
    assert_eq!(format!("{url:?}"), "postgres://app:****@db:5432/fences");
    assert!(!c.to_yaml().contains("s3cret"));
    assert!(!format!("{c:?}").contains("s3cret"));
    let plain = SecretUrl::try_from("redis://127.0.0.1:6379/".to_owned()).unwrap();
    assert_eq!(plain.to_string(), "redis://127.0.0.1:6379/");
    let query =
        SecretUrl::try_from("postgres://db/x?user=a&password=pw&sslmode=disable".to_owned())
            .unwrap();
    assert_eq!(
        query.to_string(),
        "postgres://db/x?user=a&password=****&sslmode=disable"
    );
    let token_only = SecretUrl::try_from("redis://:pw@h/".to_owned()).unwrap();
    assert_eq!(token_only.to_string(), "redis://:****@h/");
}

#[test]
fn leases_and_egress_sections() {
    let c = Config::parse(
        "upstream: http://a:1\nleases:\n  backend: { kind: redis, url: 'redis://127.0.0.1:6379/' }\n  \
         ttl: { p99_work: 800ms, p99_rtt: 40ms, safety_margin: 200ms, drift_buffer: 100ms }\n\
         egress:\n  upstream: http://ledger:80\n  routes:\n    - { path: '/accounts/{id}', lease: 'account:{id}' }\n",
    )
    .unwrap();
    let leases = c.leases.as_ref().unwrap();
    assert_eq!(leases.ttl.ttl, Duration::from_millis(1500));
    assert_eq!(leases.ttl.drift_buffer, Duration::from_millis(100));
    assert_eq!(leases.ttl.renew_every(), Duration::from_millis(500));
    assert_eq!(leases.drain_timeout(), Duration::from_secs(3));
    assert_eq!(leases.listen.to_string(), "127.0.0.1:7442");
    assert_eq!(
        c.egress.as_ref().unwrap().listen.to_string(),
        "127.0.0.1:7443"
    );

    let plain =
        Config::parse("upstream: http://a:1\nleases: { backend: { kind: embedded }, ttl: 2s }\n")
            .unwrap();
    let ttl = &plain.leases.as_ref().unwrap().ttl;
    assert_eq!(
        (ttl.ttl, ttl.drift_buffer),
        (Duration::from_secs(2), Duration::from_millis(100))
    );

    let e = err("upstream: http://a:1\negress: { upstream: 'http://x:1' }\n");
    assert!(e.contains("needs the `leases` section"), "{e}");
    let e = err("upstream: http://a:1\nleases: { backend: { kind: embedded }, ttl: 1s }\negress: { upstream: 'http://x:1', routes: [{ path: '/a/{id}', lease: 'a:{x}' }] }\n");
    assert!(e.contains("no such capture"), "{e}");
    let e = err("upstream: http://a:1\nleases: { backend: { kind: embedded }, ttl: soon }\n");
    assert!(e.contains("leases.ttl") && e.contains("line 2"), "{e}");
}

#[test]
fn environment_variables_expand_in_config_files() {
    let env = |name: &str| match name {
        "FENCEGATE_UPSTREAM_PORT" => Some("9090".to_owned()),
        "PG_PASSWORD" => Some("s3cret".to_owned()),
        _ => None,
    };
    let text = "upstream: http://127.0.0.1:${FENCEGATE_UPSTREAM_PORT:-8080}\n\
                store: { kind: postgres, url: 'postgres://app:${PG_PASSWORD}@db/x' }\n\
                admin: 0.0.0.0:${ADMIN_PORT:-7441}\n";
    let expanded = expand_env(text, env).unwrap();
    assert!(expanded.contains("127.0.0.1:9090"), "{expanded}");
    assert!(expanded.contains("app:s3cret@db"), "{expanded}");
    assert!(expanded.contains("0.0.0.0:7441"), "{expanded}");
    let c = Config::parse(&expanded).unwrap();
    assert_eq!(c.upstream.to_string(), "http://127.0.0.1:9090");
    let e = expand_env("upstream: x\nlisten: ${MISSING}\n", env).unwrap_err();
    assert!(
        e.contains("line 2") && e.contains("MISSING is not set"),
        "{e}"
    );
    assert!(expand_env("a: ${lower}", env).unwrap_err().contains("A-Z"));
    assert!(expand_env("a: ${OPEN", env)
        .unwrap_err()
        .contains("closing"));
    assert_eq!(
        expand_env("no variables: {id}", env).unwrap(),
        "no variables: {id}"
    );
}

/// Every duration that reaches a clock is bounded: a deadline computed from one cannot
/// overflow (`Instant + Duration` panics), and an absurd value is a located error at load.
#[test]
fn absurd_timeouts_and_windows_are_refused() {
    let cases = [
        (
            "upstream: http://a:1\ntimeouts: { upstream: 300000000000years }\n",
            "timeouts",
            "`upstream` must be at most 24h",
        ),
        (
            "upstream: http://a:1\ntimeouts: { shutdown: 25h }\n",
            "timeouts",
            "`shutdown` must be at most 24h",
        ),
        (
            "upstream: http://a:1\ntimeouts: { store: 1000days, header_read: 5s }\n",
            "timeouts",
            "`store` must be at most 24h",
        ),
        (
            "upstream: http://a:1\nroutes: [{ name: a, path: /a, barrier_timeout: 2days }]\n",
            "routes[0].barrier_timeout",
            "at most 24h",
        ),
        (
            "upstream: http://a:1\nidempotency: { window: 31days }\nroutes: [{ name: a, path: /a }]\n",
            "idempotency.window",
            "at most 30days",
        ),
    ];
    for (yaml, path, message) in cases {
        let e = Config::parse(yaml).expect_err(yaml);
        assert!(e.contains(path) && e.contains(message), "{yaml}: {e}");
    }
    let longest = "upstream: http://a:1\ntimeouts: { upstream: 24h, shutdown: 24h, store: 24h, header_read: 24h }\nidempotency: { window: 30days }\nroutes: [{ name: a, path: /a, barrier_timeout: 24h }]\n";
    let config = Config::parse(longest).unwrap();
    assert_eq!(config.timeouts.upstream, Duration::from_secs(86_400));
}

#[test]
fn a_duration_without_a_unit_says_what_to_write() {
    for (yaml, field, line) in [
        ("upstream: http://a:1\ntimeouts:\n  upstream: 30\n", "timeouts.upstream", 3),
        ("upstream: http://a:1\ntimeouts:\n  store: '2'\n", "timeouts.store", 3),
        (
            "upstream: http://a:1\nleases:\n  backend: { kind: embedded }\n  ttl: 10\n",
            "leases.ttl",
            4,
        ),
        (
            "upstream: http://a:1\nleases:\n  backend: { kind: embedded }\n  ttl: 10s\n  drain_timeout: 20\n",
            "leases.drain_timeout",
            5,
        ),
    ] {
        let e = err(yaml);
        let value = yaml.lines().nth(line - 1).unwrap().rsplit(": ").next().unwrap();
        let value = value.trim_matches('\'');
        assert!(
            e.contains(field)
                && e.contains(&format!("line {line}"))
                && e.contains(&format!("`{value}` is not a duration: write 30s, 1500ms, 1m")),
            "{yaml}: {e}"
        );
        assert!(!e.contains("invalid value") && !e.contains("expected"), "{e}");
    }
}

#[test]
fn durations_print_back_as_the_docs_write_them() {
    let c = Config::parse(
        "upstream: http://a:1\ntimeouts: { upstream: 1.5s, store: 2m30s, header_read: 30 s }\n",
    )
    .unwrap();
    let yaml = c.to_yaml();
    for want in [
        "upstream: 1500ms",
        "store: 150s",
        "header_read: 30s",
        "shutdown: 10s",
    ] {
        assert!(yaml.contains(want), "{want} in:\n{yaml}");
    }
}

#[test]
fn store_tls_prints_back_and_loads_again() {
    let c = Config::parse(
        "upstream: http://a:1\n\
         store: { kind: redis, url: 'rediss://app:pw@r:6380/0', tls: { ca: /etc/ca.pem, cert: /c.pem, key: /k.pem, server_name: redis.internal } }\n\
         leases: { backend: { kind: etcd, url: 'https://e:2379', tls: { ca: /etc/ca.pem } }, ttl: 1s }\n",
    )
    .unwrap();
    let tls = c.store.tls.as_ref().unwrap();
    assert_eq!(tls.server_name.as_deref(), Some("redis.internal"));
    assert_eq!(tls.key.as_deref(), Some(Path::new("/k.pem")));
    let yaml = c.to_yaml();
    assert!(yaml.contains("rediss://app:****@r:6380/0"), "{yaml}");
    assert!(!yaml.contains("pw"), "{yaml}");
    let again = Config::parse(&yaml).unwrap();
    assert_eq!(again.store.tls, c.store.tls);
    assert_eq!(
        again.leases.unwrap().backend.tls,
        c.leases.unwrap().backend.tls
    );
}
