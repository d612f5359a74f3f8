use super::*;

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

/// A resource named by a header the proxy strips or rewrites before forwarding would be
/// checked on one value and written on another: refused at load, saying what to write.
#[test]
fn a_resource_header_the_proxy_rewrites_is_refused() {
    let resource = |template: &str| {
        err(&format!(
            "upstream: http://a:1\nroutes:\n  - name: a\n    path: /a\n    resource: '{template}'\n"
        ))
    };
    assert_eq!(
        resource("site:{header:X-Forwarded-Host}"),
        "routes[0].resource: `site:{header:X-Forwarded-Host}`: `X-Forwarded-Host` cannot name a \
         resource: fencegate sets it to the host the client addressed before forwarding; name \
         the resource by `{header:Host}`, which is that host at line 5 column 15"
    );
    for name in ["X-Forwarded-For", "x-forwarded-proto"] {
        assert!(
            resource(&format!("c:{{header:{name}}}"))
                .contains("fencegate rewrites it before forwarding"),
            "{name}"
        );
    }
    for name in [
        "Connection",
        "TE",
        "Upgrade",
        "Keep-Alive",
        "Proxy-Authorization",
    ] {
        assert!(
            resource(&format!("h:{{header:{name}}}")).contains("it is a hop-by-hop header"),
            "{name}"
        );
    }
    for ok in [
        "site:{header:Host}",
        "t:{header:X-Tenant}",
        "s:{header:x-shard-bin}",
    ] {
        let yaml = format!(
            "upstream: http://a:1\nroutes:\n  - {{ name: a, path: /a, resource: '{ok}' }}\n"
        );
        Config::parse(&yaml).unwrap_or_else(|e| panic!("{ok}: {e}"));
    }
}

/// A capture written as another router writes it would be literal text, the route would never
/// match, and its writes would pass unfenced: refused, with the braces form to write.
#[test]
fn captures_in_another_routers_syntax_are_refused() {
    let route = |path: &str| {
        err(&format!(
            "upstream: http://a:1\nroutes: [{{ name: a, path: '{path}' }}]\n"
        ))
    };
    assert_eq!(
        route("/a/:id"),
        "routes[0].path: `/a/:id`: `:id` is literal text here, so the route would never match \
         and its writes would pass unfenced; captures are written in braces: write `/a/{id}` at \
         line 2 column 27"
    );
    assert_eq!(
        route("/files/*"),
        "routes[0].path: `/files/*`: `*` is literal text here, so the route would never match \
         and its writes would pass unfenced; captures are written in braces: write \
         `/files/{*rest}` at line 2 column 27"
    );
    assert!(route("/users/<int:uid>/files/**").contains("write `/users/{uid}/files/{*rest}`"));
    assert!(route("/a/*path").contains("write `/a/{*path}`"));
    assert!(route("/a/:id?").contains("write `/a/{id}`"));
    // A colon inside a segment is literal text, as meant (`/v1/accounts:batchGet`).
    Config::parse("upstream: http://a:1\nroutes: [{ name: a, path: '/v1/{id}:undo' }]\n").unwrap();
}

/// `barrier_timeout` only bounds the wait of `ordering: serialize`: on another route it would
/// do nothing, so it is refused there; a serialized route prints the timeout in effect.
#[test]
fn a_barrier_timeout_needs_ordering_serialize() {
    assert_eq!(
        err("upstream: http://a:1\nroutes: [{ name: a, path: /a, barrier_timeout: 2s }]\n"),
        "routes[0]: route `a`: `barrier_timeout` is how long a write waits for its turn under \
         `ordering: serialize`, and this route does not serialize: add `ordering: serialize` or \
         remove `barrier_timeout` at line 2 column 10"
    );
    let c = Config::parse(
        "upstream: http://a:1\nroutes: [{ name: a, path: /a, ordering: serialize }, { name: b, path: /b }]\n",
    )
    .unwrap();
    assert_eq!(c.routes[0].barrier_timeout, Some(DEFAULT_BARRIER_TIMEOUT));
    assert_eq!(c.routes[1].barrier_timeout, None);
    let yaml = c.to_yaml();
    assert_eq!(yaml.matches("barrier_timeout: 5s").count(), 1, "{yaml}");
    assert_eq!(Config::parse(&yaml).unwrap().to_yaml(), yaml);
}
