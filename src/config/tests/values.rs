use super::*;

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
            "upstream: http://a:1\nroutes: [{ name: a, path: /a, ordering: serialize, barrier_timeout: 2days }]\n",
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
        let e = Config::parse(yaml).expect_err(yaml).to_string();
        assert!(e.contains(path) && e.contains(message), "{yaml}: {e}");
    }
    let longest = "upstream: http://a:1\ntimeouts: { upstream: 24h, shutdown: 24h, store: 24h, header_read: 24h }\nidempotency: { window: 30days }\nroutes: [{ name: a, path: /a, ordering: serialize, barrier_timeout: 24h }]\n";
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
            "upstream: http://a:1\nroutes: [{{ name: a, path: /a, ordering: serialize, barrier_timeout: '{text}' }}]\n"
        ))
        .unwrap_or_else(|e| panic!("{text}: {e}"));
        assert_eq!(c.routes[0].barrier_timeout(), want, "{text}");
    }
}

#[test]
fn max_step_is_a_whole_number_or_off() {
    let step = |yaml: &str| Config::parse(yaml).unwrap().token.max_step.get();
    assert_eq!(step(MINIMAL), Some(1 << 40));
    assert_eq!(step(MINIMAL), Some(DEFAULT_MAX_STEP));
    for (value, want) in [
        ("1", Some(1)),
        ("4294967296", Some(4_294_967_296)),
        ("18446744073709551615", Some(u64::MAX)),
        ("off", None),
        ("none", None),
    ] {
        let yaml = format!("upstream: http://a:1\ntoken:\n  max_step: {value}\n");
        assert_eq!(step(&yaml), want, "{value}");
    }
    // The effective config prints it back in a form the parser takes.
    let off = Config::parse("upstream: http://a:1\ntoken: { max_step: off }\n").unwrap();
    assert!(off.to_yaml().contains("max_step: off"), "{}", off.to_yaml());
    let again = Config::parse(&off.to_yaml()).unwrap();
    assert_eq!(again.token.max_step, MaxStep::OFF);
    let default = Config::parse(MINIMAL).unwrap();
    assert!(default.to_yaml().contains("max_step: 1099511627776"));
}

#[test]
fn a_bad_max_step_is_refused_where_it_is_written() {
    for (value, message) in [
        (
            "0",
            "`0` would refuse every token above the recorded maximum: write a whole number of \
             at least 1, or off to have no ceiling",
        ),
        (
            "-5",
            "`-5` is not a token step: write a whole number of at least 1, like 1099511627776 \
             (2^40, the default), or off",
        ),
        (
            "1e9",
            "`1000000000` is not a token step: write a whole number of at least 1, like \
             1099511627776 (2^40, the default), or off",
        ),
        (
            "'100'",
            "`\"100\"` is quoted, so it is text: write 100 without quotes",
        ),
        (
            "never",
            "`never` is not a token step: write a whole number of at least 1, like \
             1099511627776 (2^40, the default), or off",
        ),
        (
            "18446744073709551616",
            "`18446744073709551616` is too large (tokens are at most 9223372036854775807): \
             write off to have no ceiling",
        ),
    ] {
        let yaml = format!("upstream: http://a:1\ntoken:\n  equal: allow\n  max_step: {value}\n");
        let e = err(&yaml);
        assert!(
            e.contains("token.max_step") && e.contains("line 4 column 13") && e.contains(message),
            "{value}: {e}"
        );
    }
}
