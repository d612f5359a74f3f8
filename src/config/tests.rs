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
    assert_eq!(
        c.store,
        StoreConfig::Embedded {
            path: PathBuf::from(store::DEFAULT_STORE_PATH),
            prefix: "fencegate".into(),
            cache_size: 100_000,
        }
    );
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
            "does not start with `/`: write `/a/{id}`",
        ),
        (
            "upstream: http://a:1\nroutes: [{ name: a, path: '/a/{id}', resource: 'x:{ic}' }]\n",
            "routes[0]",
            "which path `/a/{id}` does not capture",
        ),
        (
            "upstream: http://a:1\nroutes: [{ name: a, path: /a }, { name: a, path: /b }]\n",
            "routes[1]",
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
            "routes[1]",
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
            "`lots` is not a whole number of bytes",
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

/// What `check` prints, fed back as a config file, is the same config. (Store passwords are
/// the exception: they print masked.)
#[test]
fn the_effective_config_loads_again_as_the_same_config() {
    for yaml in [
        "upstream: http://127.0.0.1:9\nstore: { kind: memory }\nroutes: [{ name: a, path: '/a/{id}', resource: 'a:{id}' }]\n",
        "upstream: http://a:1\nleases: { backend: { kind: embedded, path: /tmp/l.db }, ttl: 1500ms }\n",
        "upstream: http://a:1\nleases: { backend: { kind: embedded }, ttl: 1s, drain_timeout: 5s }\n",
        "upstream: http://a:1\nleases:\n  backend: { kind: redis, url: 'redis://r:6379/', prefix: app }\n  \
         ttl: { p99_work: 800ms, p99_rtt: 40ms, safety_margin: 200ms, drift_buffer: 100ms }\n  \
         acquire: { base_delay: 10ms }\nidempotency: {}\n\
         egress:\n  upstream: http://ledger:80\n  routes: [{ path: '/accounts/{id}', lease: 'account:{id}', methods: [PUT] }]\n\
         fence: { authority: leases }\nroutes: [{ name: a, path: '/accounts/{id}', ordering: serialize, idempotency: false }]\n",
        "upstream: http://a:1\nleases: { backend: { kind: embedded }, ttl: { p99_work: 1s, p99_rtt: 1ms, safety_margin: 1ms, ttl: 3s } }\n\
         idempotency: { window: 10s, header: X-Key }\nroutes: [{ name: a, path: /a }]\n",
        "upstream: http://a:1\nidempotency: { window: 1m }\ntoken: { header: X-Fence, equal: reject }\nunmatched: reject\n",
    ] {
        let c = Config::parse(yaml).unwrap_or_else(|e| panic!("{yaml}: {e}"));
        let printed = c.to_yaml();
        let again = Config::parse(&printed).unwrap_or_else(|e| panic!("{printed}: {e}"));
        assert_eq!(again.to_yaml(), printed);
        assert_eq!(format!("{again:?}"), format!("{c:?}"), "{printed}");
    }
}

/// Values that follow the lease TTL (a derived `ttl`, the default `drain_timeout`, the
/// default idempotency `window`) are not pinned in the printed config when they were left to
/// their defaults: it would load again, but would stop following the TTL (`check` shows them
/// on its `#` lines instead). Written, they are printed as written.
#[test]
fn values_that_follow_the_ttl_are_printed_only_when_written() {
    let c = Config::parse(
        "upstream: http://a:1\nleases:\n  backend: { kind: embedded, path: /tmp/l.db }\n  \
         ttl: { p99_work: 800ms, p99_rtt: 40ms, safety_margin: 200ms }\nidempotency: {}\n",
    )
    .unwrap();
    let leases = c.leases.as_ref().unwrap();
    assert_eq!(leases.ttl.ttl, Duration::from_millis(1500));
    assert_eq!(leases.drain_timeout, Duration::from_secs(3));
    assert_eq!(
        c.idempotency.as_ref().unwrap().window(),
        Duration::from_millis(2300)
    );
    let printed = c.to_yaml();
    let tail = &printed[printed.find("leases:").unwrap()..];
    assert_eq!(
        tail,
        "leases:
  listen: 127.0.0.1:7442
  backend:
    kind: embedded
    path: /tmp/l.db
    prefix: fencegate
  ttl:
    p99_work: 800ms
    p99_rtt: 40ms
    safety_margin: 200ms
    drift_buffer: 0s
    round_to: 500ms
  acquire:
    base_delay: 50ms
    max_delay: 2s
    jitter: 100ms
idempotency:
  header: idempotency-key
  max_request_bytes: 1048576
  max_response_bytes: 1048576
access_log: false
"
    );
    // Longer p99 work in the printed config: the TTL, drain timeout and window follow it.
    let edited = Config::parse(&printed.replace("p99_work: 800ms", "p99_work: 1800ms")).unwrap();
    let leases = edited.leases.as_ref().unwrap();
    assert_eq!(leases.ttl.ttl, Duration::from_millis(2500));
    assert_eq!(leases.drain_timeout, Duration::from_secs(5));
    assert_eq!(
        edited.idempotency.as_ref().unwrap().window(),
        Duration::from_millis(4300)
    );

    let written = Config::parse(
        "upstream: http://a:1\nleases:\n  backend: { kind: embedded }\n  \
         ttl: { p99_work: 800ms, p99_rtt: 40ms, safety_margin: 200ms, ttl: 2s }\n  \
         drain_timeout: 4s\nidempotency: { window: 3s }\n",
    )
    .unwrap()
    .to_yaml();
    for line in ["    ttl: 2s\n", "  drain_timeout: 4s\n", "  window: 3s\n"] {
        assert!(written.contains(line), "{line} in:\n{written}");
    }
}

#[test]
fn store_urls_never_print_their_password() {
    let c = Config::parse(
        "upstream: http://a:1\nstore: { kind: postgres, url: 'postgres://app:s3cret@db:5432/fences' }\n",
    )
    .unwrap();
    let url = &c.store.remote().unwrap().url;
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
    // Passwords with `/`, `?` or `#` unencoded (as `openssl rand -base64` makes them): the
    // etcd and PostgreSQL URL readers take them, so they must be masked too.
    for (raw, shown) in [
        (
            "https://fencegate:ab/Cd+9=@etcd-0:2379,etcd-1:2379",
            "https://fencegate:****@etcd-0:2379,etcd-1:2379",
        ),
        (
            "postgres://app:x/y@db/fences",
            "postgres://app:****@db/fences",
        ),
        ("etcd://u:pa?ss@h:2379", "etcd://u:****@h:2379"),
        ("redis://u:p#w@h:6379/0", "redis://u:****@h:6379/0"),
        (
            "postgres://app:p/w?x@db/f?sslmode=require&password=q",
            "postgres://app:****@db/f?sslmode=require&password=****",
        ),
    ] {
        let url = SecretUrl::try_from(raw.to_owned()).unwrap();
        assert_eq!(url.to_string(), shown, "{raw}");
    }
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
    assert_eq!(leases.drain_timeout, Duration::from_secs(3));
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
    assert_eq!(
        e,
        "egress.routes[0]: lease `a:{x}` uses `{x}`, which path `/a/{id}` does not capture; \
         it captures `{id}` at line 3 column 44"
    );
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

/// One route with `path`, on line 4, its path at column 11.
fn path_error(path: &str) -> String {
    err(&format!(
        "upstream: http://a:1\nroutes:\n  - name: a\n    path: '{path}'\n"
    ))
}

#[test]
fn a_bad_path_template_says_what_to_write() {
    for (path, message) in [
        ("/a/{}", "`{}` has no name: write `{id}`"),
        ("/a/{*}", "`{*}` has no name: write `{*rest}`"),
        (
            "/a/{id",
            "`{id` is not closed: write `{id}` for a capture, or `{{` for a literal `{`",
        ),
        (
            "/a/{id/b}",
            "`{id` is not closed: write `{id}` for a capture, or `{{` for a literal `{`",
        ),
        (
            "/a/id}",
            "the `}` in `id}` closes nothing: write `{name}` for a capture, or `}}` for a literal `}`",
        ),
        (
            "/a/{id}/{id}",
            "`{id}` is captured twice: give each capture its own name",
        ),
        (
            "/a/{*rest}/b",
            "`{*rest}` takes the rest of the path, so it must end it: remove `/b` after it, or write `{rest}` for one segment",
        ),
        (
            "/a/{id}{x}",
            "`{id}{x}` has two captures: a path segment holds at most one (with literal text around it); put them in separate segments",
        ),
        (
            "/a/{a.b}",
            "`{a.b}`: a capture name is letters, digits, `_` and `-`: write `{a_b}`",
        ),
        (
            "accounts/{id}",
            "`accounts/{id}` does not start with `/`: write `/accounts/{id}`",
        ),
    ] {
        assert_eq!(
            path_error(path),
            format!("routes[0].path: {message} at line 4 column 11"),
            "{path}"
        );
    }
    // Literal braces, prefixes and suffixes around one capture, a catch-all after a prefix.
    for path in [
        "/a/{{x}}",
        "/img-{id}.png",
        "/a/x{*rest}",
        "/a/{id}/",
        "/{*rest}",
    ] {
        let config = format!("upstream: http://a:1\nroutes:\n  - name: a\n    path: '{path}'\n");
        assert!(Config::parse(&config).is_ok(), "{path}");
    }
}

#[test]
fn route_errors_name_the_route_and_point_at_its_own_line() {
    let yaml = "upstream: http://a:1\nroutes:\n  - name: a\n    path: '/a/{id}'\n  - name: b\n    path: /b\n  - name: c\n    path: '/a/{name}'\n";
    assert_eq!(
        err(yaml),
        "routes[2]: two routes match the same paths: routes[0] `/a/{id}` and routes[2] \
         `/a/{name}`; merge them, or write both as `/a/{id}` and give them different `methods` \
         at line 7 column 5"
    );
    let yaml = "upstream: http://a:1\nroutes:\n  - name: a\n    path: '/a/{*rest}'\n  - name: b\n    path: '/a/{id}'\n";
    assert_eq!(
        err(yaml),
        "routes[1]: two routes match some of the same paths: routes[0] `/a/{*rest}` and \
         routes[1] `/a/{id}` (`/a/x` matches both); give them distinct literal segments or \
         merge them at line 5 column 5"
    );
    let yaml =
        "upstream: http://a:1\nroutes:\n  - name: a\n    path: /a\n  - name: a\n    path: /b\n";
    assert_eq!(
        err(yaml),
        "routes[1]: name `a` is already used by routes[0] `/a`: give each route its own name \
         at line 5 column 5"
    );
    let yaml = "upstream: http://a:1\nroutes:\n  - name: ''\n    path: /a\n";
    assert_eq!(
        err(yaml),
        "routes[0]: `name` is empty: give the route a name, which labels its metrics and logs \
         at line 3 column 5"
    );
    let yaml = "upstream: http://a:1\nroutes:\n  - name: a\n    path: /b\n  - name: b\n    path: '/a/{id}'\n    resource: 'x:{ic}'\n";
    assert_eq!(
        err(yaml),
        "routes[1]: resource `x:{ic}` uses `{ic}`, which path `/a/{id}` does not capture; it \
         captures `{id}` at line 5 column 5"
    );
    let yaml = "upstream: http://a:1\nroutes:\n  - name: a\n    path: /a\n    resource: 'x:{id}'\n";
    assert_eq!(
        err(yaml),
        "routes[0]: resource `x:{id}` uses `{id}`, which path `/a` does not capture; it has no \
         captures at line 3 column 5"
    );
    let yaml = "upstream: http://a:1\nroutes:\n  - name: a\n    path: '/x/{id}'\n  - name: b\n    path: '/x/{id}'\n    methods: [PUT]\n";
    assert_eq!(
        err(yaml),
        "routes[1]: routes[0] and routes[1] both fence PUT on `/x/{id}`, so routes[1] would \
         never see it: give them disjoint `methods` at line 5 column 5"
    );
    let yaml = "upstream: http://a:1\nroutes:\n  - name: a\n    path: /a\n    methods: []\n";
    assert_eq!(
        err(yaml),
        "routes[0].methods: an empty list fences no method: leave `methods` out to fence every \
         method but GET, HEAD and OPTIONS at line 5 column 14"
    );
    let yaml = "upstream: http://a:1\nroutes:\n  - name: a\n    path: /a\n    methods: PUT\n";
    assert_eq!(
        err(yaml),
        "routes[0].methods: `PUT` is one method, not a list: write [PUT] at line 5 column 14"
    );
    // An unfenced route shadows nothing: the route after it on the same path fences.
    Config::parse(
        "upstream: http://a:1\nroutes:\n  - { name: a, path: /a, fence: false }\n  - { name: b, path: /a }\n",
    )
    .unwrap();
}

/// Egress routes are checked like routes. Two that the router cannot tell apart used to pass
/// `check` and make `run` panic while building the egress route table.
#[test]
fn egress_routes_are_checked_like_routes() {
    let yaml = "upstream: http://a:1\nleases: { backend: { kind: embedded }, ttl: 1s }\negress:\n  upstream: http://x:1\n  routes:\n    - { path: '/a/{id}', lease: 'a:{id}' }\n    - { path: '/a/{x}', lease: 'a:{x}' }\n";
    assert_eq!(
        err(yaml),
        "egress.routes[1]: two routes match the same paths: egress.routes[0] `/a/{id}` and \
         egress.routes[1] `/a/{x}`; merge them, or write both as `/a/{id}` and give them \
         different `methods` at line 7 column 7"
    );
}

#[test]
fn numbers_booleans_and_addresses_say_what_to_write() {
    for (yaml, message) in [
        (
            "limits: { max_headers: lots }",
            "limits.max_headers: `lots` is not a whole number: write digits only, like 100 at line 2 column 24",
        ),
        (
            "limits: { max_headers: -1 }",
            "limits.max_headers: `-1` is not a whole number: write digits only, like 100 at line 2 column 24",
        ),
        (
            "limits: { max_connections: 1.5 }",
            "limits.max_connections: `1.5` is not a whole number: write digits only, like 10000 at line 2 column 28",
        ),
        (
            "limits: { max_header_bytes: 16k }",
            "limits.max_header_bytes: `16k` is not a whole number of bytes: write digits only, like 16384 at line 2 column 29",
        ),
        (
            "limits: { max_resource_bytes: '512' }",
            "limits.max_resource_bytes: `\"512\"` is quoted, so it is text: write 512 without quotes at line 2 column 31",
        ),
        (
            "limits: { max_headers: 99999999999999999999999 }",
            "limits.max_headers: `99999999999999999999999` is too large at line 2 column 24",
        ),
        (
            "store: { kind: redis, url: 'redis://r/', cache_size: big }",
            "store.cache_size: `big` is not a whole number: write digits only, like 100000 at line 2 column 54",
        ),
        (
            "idempotency: { window: 1s, max_request_bytes: 1MB }",
            "idempotency.max_request_bytes: `1MB` is not a whole number of bytes: write digits only, like 1048576 at line 2 column 47",
        ),
        (
            "idempotency: { window: 1s, max_response_bytes: true }",
            "idempotency.max_response_bytes: `true` is not a whole number of bytes: write digits only, like 1048576 at line 2 column 48",
        ),
        (
            "routes: [{ name: a, path: /a, fence: yes }]",
            "routes[0].fence: `yes` is not a boolean: write true or false at line 2 column 38",
        ),
        (
            "routes: [{ name: a, path: /a, fence: 'false' }]",
            "routes[0].fence: `\"false\"` is quoted, so it is text: write false without quotes at line 2 column 38",
        ),
        (
            "routes: [{ name: a, path: /a, idempotency: 1 }]",
            "routes[0].idempotency: `1` is not a boolean: write true or false at line 2 column 44",
        ),
        (
            "listen: 7440",
            "listen: `7440` has no IP address: write 0.0.0.0:7440 (every interface) or 127.0.0.1:7440 (this host only) at line 2 column 9",
        ),
        (
            "admin: ':7441'",
            "admin: `:7441` has no IP address: write 0.0.0.0:7441 (every interface) or 127.0.0.1:7441 (this host only) at line 2 column 8",
        ),
        (
            "listen: localhost:7440",
            "listen: `localhost:7440`: write an IP address, not a host name: 127.0.0.1:7440 at line 2 column 9",
        ),
        (
            "listen: proxy.internal:7440",
            "listen: `proxy.internal:7440`: write an IP address, not a host name, like 0.0.0.0:7440 (every interface) or 127.0.0.1:7440 (this host only) at line 2 column 9",
        ),
        (
            "listen: '::1:7440'",
            "listen: `::1:7440`: an IPv6 address is written in brackets: [::1]:7440 at line 2 column 9",
        ),
        (
            "listen: 0.0.0.0:74400",
            "listen: `0.0.0.0:74400`: a port is at most 65535 at line 2 column 9",
        ),
        (
            "listen: 0.0.0.0",
            "listen: `0.0.0.0` has no port: write an IP address and port, like 0.0.0.0:7440 at line 2 column 9",
        ),
        (
            "listen: [1]",
            "listen: invalid type: sequence, expected an IP address and port, like 0.0.0.0:7440 at line 2 column 9",
        ),
        (
            "leases: { backend: { kind: embedded }, ttl: 1s, listen: 7442 }",
            "leases.listen: `7442` has no IP address: write 0.0.0.0:7442 (every interface) or 127.0.0.1:7442 (this host only) at line 2 column 57",
        ),
        (
            "store: { kind: redis, url: 5 }",
            "store: the `url` does not fit kind redis: write one like redis://127.0.0.1:6379/ at line 2 column 8",
        ),
        (
            "leases: { backend: { kind: postgres, url: 'redis://r/' }, ttl: 1s }",
            "leases.backend: the `url` does not fit kind postgres: write one like postgres://user:password@127.0.0.1:5432/database at line 2 column 20",
        ),
    ] {
        let e = err(&format!("upstream: http://a:1\n{yaml}\n"));
        assert_eq!(e, message, "{yaml}");
    }
}

/// A scalar where a section belongs names what the section holds, not a Rust type.
#[test]
fn a_section_written_as_a_value_says_what_it_holds() {
    for (yaml, message) in [
        (
            "token: Fencing-Token",
            "token: invalid type: string \"Fencing-Token\", expected a mapping with `header` and `equal` at line 2 column 8",
        ),
        (
            "leases: 5",
            "leases: invalid type: integer `5`, expected a mapping with `backend` and `ttl` at line 2 column 9",
        ),
        (
            "leases: { backend: { kind: embedded }, ttl: 1s, acquire: 5 }",
            "leases.acquire: invalid type: integer `5`, expected a mapping with `base_delay`, `max_delay` and `jitter` at line 2 column 58",
        ),
        (
            "routes: [5]",
            "routes[0]: invalid type: integer `5`, expected a route: a mapping with `name` and `path` at line 2 column 10",
        ),
        (
            "fence: leases",
            "fence: invalid type: string \"leases\", expected a mapping with `authority` at line 2 column 8",
        ),
        (
            "tls: yes",
            "tls: invalid type: string \"yes\", expected a mapping with `cert` and `key` at line 2 column 6",
        ),
    ] {
        let e = err(&format!("upstream: http://a:1\n{yaml}\n"));
        assert_eq!(e, message, "{yaml}");
    }
    assert_eq!(
        err("hello\n"),
        "invalid type: string \"hello\", expected a mapping of settings, such as \
         `upstream: http://127.0.0.1:8080`"
    );
}

/// The duration forms docs/configuration.md lists, each as a route's `barrier_timeout`.
#[test]
fn the_documented_duration_forms_load() {
    let ms = Duration::from_millis;
    for (text, want) in [
        ("30s", ms(30_000)),
        ("30 s", ms(30_000)),
        ("1500ms", ms(1500)),
        ("1.5s", ms(1500)),
        ("2m30s", ms(150_000)),
        ("1h", ms(3_600_000)),
        ("1d", ms(86_400_000)),
        ("250us", Duration::from_micros(250)),
        ("100ns", Duration::from_nanos(100)),
        ("2 sec", ms(2000)),
        ("3min", ms(180_000)),
        ("2hours", ms(7_200_000)),
    ] {
        let c = Config::parse(&format!(
            "upstream: http://a:1\nroutes: [{{ name: a, path: /a, barrier_timeout: '{text}' }}]\n"
        ))
        .unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(c.routes[0].barrier_timeout, want, "{text}");
    }
}

/// The 30ms floor: a TTL written below it is refused (plain, or `ttl` in a derivation); a
/// derived TTL below it is raised to it, with a warning.
#[test]
fn lease_ttls_below_the_floor() {
    let leases = |ttl: &str| {
        format!("upstream: http://a:1\nleases:\n  backend: {{ kind: embedded }}\n  ttl: {ttl}\n")
    };
    assert_eq!(
        err(&leases("12ms")),
        "leases.ttl: a lease ttl of 12ms is below the 30ms floor, under which a lease cannot be \
         renewed reliably: write 30ms or more at line 4 column 8"
    );
    assert_eq!(
        err(&leases(
            "{ p99_work: 5ms, p99_rtt: 1ms, safety_margin: 1ms, round_to: 1ms, ttl: 20ms }"
        )),
        "leases.ttl: a lease ttl of 20ms is below the 30ms floor, under which a lease cannot be \
         renewed reliably: write 30ms or more at line 4 column 8"
    );
    let raised = Config::parse(&leases(
        "{ p99_work: 5ms, p99_rtt: 1ms, safety_margin: 1ms, round_to: 1ms }",
    ))
    .unwrap();
    let ttl = &raised.leases.as_ref().unwrap().ttl;
    assert_eq!(
        (ttl.ttl, ttl.minimum),
        (Duration::from_millis(30), Duration::from_millis(30))
    );
    assert_eq!(
        raised.warnings(),
        ["leases.ttl: the derived ttl 7ms is below the 30ms floor, under which a lease cannot be \
          renewed reliably: the lease ttl is 30ms"]
    );
    let written = Config::parse(&leases(
        "{ p99_work: 5ms, p99_rtt: 1ms, safety_margin: 1ms, round_to: 1ms, ttl: 40ms }",
    ))
    .unwrap();
    assert_eq!(
        written.leases.as_ref().unwrap().ttl.ttl,
        Duration::from_millis(40)
    );
    assert!(written.warnings().is_empty());
    assert!(Config::parse(&leases("30ms"))
        .unwrap()
        .warnings()
        .is_empty());
}

#[test]
fn store_tls_prints_back_and_loads_again() {
    let c = Config::parse(
        "upstream: http://a:1\n\
         store: { kind: redis, url: 'rediss://app:pw@r:6380/0', tls: { ca: /etc/ca.pem, cert: /c.pem, key: /k.pem, server_name: redis.internal } }\n\
         leases: { backend: { kind: etcd, url: 'https://e:2379', tls: { ca: /etc/ca.pem } }, ttl: 1s }\n",
    )
    .unwrap();
    let tls = c.store.remote().unwrap().tls.as_ref().unwrap();
    assert_eq!(tls.server_name.as_deref(), Some("redis.internal"));
    assert_eq!(tls.key.as_deref(), Some(Path::new("/k.pem")));
    let yaml = c.to_yaml();
    assert!(yaml.contains("rediss://app:****@r:6380/0"), "{yaml}");
    assert!(!yaml.contains("pw"), "{yaml}");
    let again = Config::parse(&yaml).unwrap();
    let tls = |store: &StoreConfig| store.remote().unwrap().tls.clone();
    assert_eq!(tls(&again.store), tls(&c.store));
    let tls = |leases: Option<LeasesConfig>| leases.unwrap().backend.remote().unwrap().tls.clone();
    assert_eq!(tls(again.leases), tls(c.leases));
}
