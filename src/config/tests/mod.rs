use super::*;

mod env;
mod leases;
mod retention;
mod routes;
mod store;
mod values;

const MINIMAL: &str = "upstream: http://127.0.0.1:8080\n";

fn err(yaml: &str) -> String {
    Config::parse(yaml)
        .expect_err("config should be refused")
        .to_string()
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
            path: PathBuf::from(super::store::DEFAULT_STORE_PATH),
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
    assert!(c.upstream.unwrap().is_https());
    assert_eq!(c.token.header.0.as_str(), "x-fence");
    let r = &c.routes[0];
    assert_eq!(r.ordering, Ordering::Serialize);
    assert_eq!(r.barrier_timeout(), Duration::from_millis(1500));
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
            "upstream: http://a:1\nroutes: [{ name: a, path: /a, ordering: serialize, barrier_timeout: soon }]\n",
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
        "upstream: http://a:1\nstore: { kind: embedded, path: /tmp/f.db }\nleases: { backend: { kind: embedded, path: /tmp/l.db }, ttl: 5s }\n\
         fence: { authority: leases, retention: 30d }\n",
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

/// A scalar where a section belongs names what the section holds, not a Rust type.
#[test]
fn a_section_written_as_a_value_says_what_it_holds() {
    for (yaml, message) in [
        (
            "token: Fencing-Token",
            "token: invalid type: string \"Fencing-Token\", expected a mapping with `header`, `equal` and `max_step` at line 2 column 8",
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
            "fence: invalid type: string \"leases\", expected a mapping with `authority` and `retention` at line 2 column 8",
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
         `upstream: http://127.0.0.1:8080` at line 1 column 1"
    );
}

/// A misspelt field or value is told the nearest accepted name; a name far from all of them
/// gets no guess.
#[test]
fn a_misspelt_name_gets_the_nearest_one() {
    assert_eq!(
        err("upstrem: http://a:1\n"),
        "unknown field `upstrem`, expected one of `listen`, `admin`, `upstream`, `upstream_ca`, \
         `tls`, `token`, `store`, `fence`, `routes`, `unmatched`, `timeouts`, `limits`, \
         `leases`, `egress`, `idempotency`, `access_log`, `log` at line 1 column 1; did you \
         mean `upstream`?"
    );
    assert_eq!(
        err("upstream: http://a:1\nstore: { kind: memory, cache_sise: 1 }\n"),
        "store: unknown field `cache_sise`, expected one of `kind`, `path`, `url`, `prefix`, \
         `cache_size`, `tls`, `sentinel`, `cluster`, `replicas` at line 2 column 24; did you mean \
         `cache_size`?"
    );
    assert_eq!(
        err("upstream: http://a:1\nstore: { kind: memry }\n"),
        "store.kind: unknown variant `memry`, expected one of `memory`, `embedded`, `redis`, \
         `postgres`, `etcd` at line 2 column 16; did you mean `memory`?"
    );
    assert!(!err("upstream: http://a:1\nzzz: 1\n").contains("did you mean"));
}

/// A field written twice is pointed at where it is written the second time, at the top level
/// too (where the deserializer gives no position of its own).
#[test]
fn a_duplicate_field_has_its_line_and_column() {
    assert_eq!(
        err("upstream: http://a:1\nroutes: []\nlisten: 0.0.0.0:1\nroutes: []\n"),
        "duplicate field `routes` at line 4 column 1"
    );
    assert_eq!(
        err("upstream: http://a:1\nfence:\n  authority: none\n  authority: none\n"),
        "fence: duplicate field `authority` at line 4 column 3"
    );
}

/// config/fencegate.yaml loads, and names every field (commented where it is optional).
#[test]
fn the_annotated_example_loads_and_names_every_field() {
    let text = include_str!("../../../config/fencegate.yaml");
    Config::parse(text).unwrap();
    for field in [
        "listen:",
        "admin:",
        "upstream:",
        "upstream_ca:",
        "tls:",
        "cert:",
        "key:",
        "client_ca:",
        "header:",
        "equal:",
        "max_step:",
        "kind:",
        "path:",
        "url:",
        "prefix:",
        "cache_size:",
        "ca:",
        "server_name:",
        "sentinel:",
        "master:",
        "urls:",
        "replicas:",
        "authority:",
        "retention:",
        "routes:",
        "name:",
        "methods:",
        "resource:",
        "missing_token:",
        "ordering:",
        "barrier_timeout:",
        "fence:",
        "idempotency:",
        "unmatched:",
        "timeouts:",
        "header_read:",
        "shutdown:",
        "store:",
        "limits:",
        "max_header_bytes:",
        "max_headers:",
        "max_connections:",
        "max_resource_bytes:",
        "leases:",
        "backend:",
        "ttl:",
        "p99_work:",
        "p99_rtt:",
        "safety_margin:",
        "drift_buffer:",
        "round_to:",
        "acquire:",
        "base_delay:",
        "max_delay:",
        "jitter:",
        "drain_timeout:",
        "egress:",
        "lease:",
        "window:",
        "max_request_bytes:",
        "max_response_bytes:",
        "access_log:",
        "log:",
        "format:",
        "query:",
    ] {
        assert!(
            text.contains(field),
            "config/fencegate.yaml lacks `{field}`"
        );
    }
}

/// The sidecar needs an upstream; an in-process fence has none, and its config may leave it
/// out.
#[test]
fn upstream_is_required_by_the_sidecar_only() {
    let yaml =
        "store: { kind: memory }\nroutes:\n  - { name: a, path: '/a/{id}', resource: 'a:{id}' }\n";
    let got = Config::parse(yaml).unwrap_err().to_string();
    assert_eq!(
        got,
        "missing field `upstream`: the service the sidecar forwards to, such as `upstream: \
         http://127.0.0.1:8080` (an in-process fence, FenceLayer, needs none: read its config \
         with Config::parse_fence)"
    );
    let fence = Config::parse_fence(yaml).unwrap();
    assert!(fence.upstream.is_none());
    let printed = fence.to_yaml();
    assert!(
        !printed.lines().any(|l| l.starts_with("upstream")),
        "{printed}"
    );
    // Given, it is read as the sidecar reads it.
    let with = Config::parse_fence(&format!("upstream: http://a:1\n{yaml}")).unwrap();
    assert_eq!(with.upstream.unwrap().to_string(), "http://a:1");
}
