use super::super::leases::MAX_DRAIN_TIMEOUT;
use super::*;

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

fn refused(leases: &str) -> String {
    Config::parse(&format!(
        "upstream: http://a:1\nleases:\n  backend: {{ kind: embedded }}\n{leases}"
    ))
    .expect_err("config should be refused")
    .to_string()
}

#[test]
fn absurd_durations_are_refused_with_their_location() {
    let e = refused("  ttl: 300000000000years\n");
    assert!(
        e.contains("leases.ttl")
            && e.contains("line 4")
            && e.contains("a lease ttl above 1h is not supported (got 2629800000000000h)"),
        "{e}"
    );
    let e = refused(
        "  ttl: { p99_work: 300000000000years, p99_rtt: 1ms, safety_margin: 300000000000years }\n",
    );
    assert!(
        e.contains("leases.ttl")
            && e.contains("the inputs add up to more than a duration can hold"),
        "{e}"
    );
    let e = refused("  ttl: { p99_work: 2h, p99_rtt: 1ms, safety_margin: 1ms }\n");
    assert!(
        e.contains("leases.ttl") && e.contains("a lease ttl above 1h is not supported"),
        "{e}"
    );
    let e = refused("  ttl: 1s\n  drain_timeout: 300000000000years\n");
    assert!(
        e.contains("leases.drain_timeout")
            && e.contains("line 5")
            && e.contains("a drain_timeout above 2h is not supported (got 300000000000years)"),
        "{e}"
    );
}

#[test]
fn the_longest_durations_load_and_print_back() {
    let c =
        Config::parse("upstream: http://a:1\nleases:\n  backend: { kind: embedded }\n  ttl: 1h\n")
            .unwrap();
    let leases = c.leases.as_ref().unwrap();
    assert_eq!(leases.drain_timeout, MAX_DRAIN_TIMEOUT);
    let c = Config::parse(
        "upstream: http://a:1\nleases:\n  backend: { kind: embedded }\n  ttl: 1h\n  drain_timeout: 2h\n",
    )
    .unwrap();
    let leases = c.leases.unwrap();
    assert_eq!(leases.drain_timeout, MAX_DRAIN_TIMEOUT);
    let printed = serde_yaml::to_string(&leases).unwrap();
    assert!(printed.contains("drain_timeout: 2h"), "{printed}");
}
