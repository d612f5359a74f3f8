//! The route table: which route a request is on, whether its method is fenced, and which
//! resource it writes to. Built once per configuration; matching allocates only the resource id.

use crate::fence::Token;
use std::borrow::Cow;
use std::collections::HashMap;

use http::{HeaderMap, Method};

use super::resource::{ResourceId, ResourceIdError};
use crate::config::{
    EgressRoute, MethodCfg, MissingToken, Ordering, PathTemplate, ResourcePart, ResourceTemplate,
    RouteConfig, Unmatched,
};

/// A configured route, ready for the hot path.
#[derive(Debug)]
pub struct Route {
    /// The route's `name` (`egress[i]` on the egress table), its label in metrics and logs.
    pub name: String,
    /// Position in the config, used to index per-route metrics without hashing labels.
    pub index: usize,
    /// `None`: every method but GET, HEAD and OPTIONS is fenced.
    fenced_methods: Option<Vec<Method>>,
    resource: Option<ResourceTemplate>,
    /// What a fenced write without a token gets (`missing_token`).
    pub missing_token: MissingToken,
    /// Whether admitted writes of one resource are forwarded in token order (`ordering`).
    pub ordering: Ordering,
    /// How long a write waits for its turn under `ordering: serialize` (`barrier_timeout`,
    /// 5 s by default).
    pub barrier_timeout: std::time::Duration,
    /// Whether the route fences at all (`fence`); false: every request on it is forwarded
    /// unfenced.
    pub fence: bool,
    /// The path template ends with `/`: a trailing slash in a request is then part of the match.
    slash_template: bool,
}

impl Route {
    /// Whether `method` is fenced on this route: never with `fence: false`; with `methods`, the
    /// listed ones in any case; without, every method but `GET`, `HEAD` and `OPTIONS`.
    pub fn fences(&self, method: &Method) -> bool {
        self.fence
            && match &self.fenced_methods {
                // Listed methods are fenced in any case: a server that folds `put` into `PUT`
                // must not get it unchecked. (Unlisted methods in any case stay fenced by
                // default, `get` included.)
                Some(methods) => methods
                    .iter()
                    .any(|m| m.as_str().eq_ignore_ascii_case(method.as_str())),
                None => !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS),
            }
    }
}

/// What the table says about one request.
#[derive(Debug)]
pub enum Matched<'a> {
    /// No route; the `unmatched` policy applies.
    None,
    /// On a route, but this method is not fenced there.
    Pass(&'a Route),
    /// A fenced write to `resource`.
    Fence {
        /// The first route on the path's template that fences the method.
        route: &'a Route,
        /// The resource id, built from the route's `resource` template (by default, the
        /// decoded path).
        resource: ResourceId,
    },
}

/// Why the resource id could not be built; the request is refused with 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceError {
    /// The named header (from `{header:Name}`) is missing, empty, not ASCII, sent more than
    /// once, or has a `_` alias in the request.
    #[error("the request has no usable `{0}` header, which names the resource")]
    Header(String),
    /// The named query parameter (from `{query:name}`) is missing, sent more than once (also
    /// when `;` is read as a separator), not UTF-8, empty, or holds a control character.
    #[error("the request has no usable `{0}` query parameter, which names the resource")]
    Query(String),
    /// The resource id is longer than `limits.max_resource_bytes`, the limit it holds.
    #[error("the resource id is longer than {0} bytes")]
    TooLong(usize),
    /// The `Connection` header names the header (named) that names the resource.
    #[error(
        "the Connection header names `{0}`, which names the resource: it would be stripped in \
         transit, and the upstream would not see the value the fence checked"
    )]
    ConnectionNominated(String),
    /// The named `-bin` header (gRPC binary metadata) is not base64.
    #[error("the `{0}` header, which names the resource, is not base64 (gRPC binary metadata)")]
    NotBase64(String),
    /// The fenced path does not percent-decode to UTF-8.
    #[error("the path does not decode to UTF-8 text, so it names no resource")]
    NotText,
    /// What the template built is not a resource id (empty, or with a control character).
    #[error("the request names no resource: {0}")]
    NotAnId(ResourceIdError),
}

/// The routes of one configuration, matched by path template: [`RouteTable::new`] for
/// `routes`, [`RouteTable::egress`] for `egress.routes`.
pub struct RouteTable {
    /// Path template → indexes of the routes sharing it, in config order.
    router: matchit::Router<Vec<usize>>,
    routes: Vec<Route>,
    /// What a request on no route gets (`unmatched`; `forward` on the egress table).
    pub unmatched: Unmatched,
    max_resource_bytes: usize,
}

impl RouteTable {
    /// Builds the table; the config was validated at load, so insertion cannot conflict.
    pub fn new(configs: &[RouteConfig], unmatched: Unmatched, max_resource_bytes: usize) -> Self {
        let routes = configs.iter().enumerate().map(|(index, c)| {
            let route = Route {
                name: c.name.clone(),
                index,
                fenced_methods: fenced_methods(c.methods.as_deref()),
                resource: c.resource.clone(),
                missing_token: c.missing_token,
                ordering: c.ordering,
                barrier_timeout: c.barrier_timeout(),
                fence: c.fence,
                slash_template: slash_template(&c.path),
            };
            (&c.path, route)
        });
        Self::build(routes, unmatched, max_resource_bytes)
    }

    /// The egress table (`egress.routes`): every route fences its methods, its resource is the
    /// lease whose token is attached, and it is named `egress[i]` (in metrics and logs). A
    /// request on no route is forwarded as it is.
    pub fn egress(configs: &[EgressRoute], max_resource_bytes: usize) -> Self {
        let routes = configs.iter().enumerate().map(|(index, c)| {
            let route = Route {
                name: format!("egress[{index}]"),
                index,
                fenced_methods: fenced_methods(c.methods.as_deref()),
                resource: Some(c.lease.clone()),
                missing_token: MissingToken::Reject,
                ordering: Ordering::None,
                barrier_timeout: std::time::Duration::ZERO,
                fence: true,
                slash_template: slash_template(&c.path),
            };
            (&c.path, route)
        });
        Self::build(routes, Unmatched::Forward, max_resource_bytes)
    }

    /// Routes sharing a path template are grouped under it, in config order.
    fn build<'a>(
        configured: impl Iterator<Item = (&'a PathTemplate, Route)>,
        unmatched: Unmatched,
        max_resource_bytes: usize,
    ) -> Self {
        let mut router = matchit::Router::new();
        let mut groups: Vec<(String, Vec<usize>)> = Vec::new();
        // Path → its group in `groups`: found by lookup, so that building a table of
        // thousands of routes takes time linear in their number.
        let mut group_of: HashMap<&str, usize> = HashMap::new();
        let routes = configured
            .map(|(path, route)| {
                match group_of.get(path.source.as_str()) {
                    Some(&g) => groups[g].1.push(route.index),
                    None => {
                        group_of.insert(&path.source, groups.len());
                        groups.push((path.source.clone(), vec![route.index]));
                    }
                }
                route
            })
            .collect();
        for (path, members) in groups {
            router
                .insert(path, members)
                .expect("route paths are validated when the config is loaded");
        }
        RouteTable {
            router,
            routes,
            unmatched,
            max_resource_bytes,
        }
    }

    /// The routes in config order: `routes()[i].index` is `i`.
    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// Matches a normalised path. `authority` is the request target's (absolute form, HTTP/2
    /// `:authority`), which `{header:Host}` reads before the `Host` header, as the proxy
    /// reports it upstream in `X-Forwarded-Host` (RFC 9112 §3.2.2).
    pub fn lookup(
        &self,
        method: &Method,
        path: &str,
        query: Option<&str>,
        authority: Option<&str>,
        headers: &HeaderMap,
    ) -> Result<Matched<'_>, (Option<&Route>, ResourceError)> {
        // `/accounts/42/` is `/accounts/42` to most frameworks, so it must be to the fence too:
        // unless the path matches a template written with a trailing slash, the path without
        // its slash is matched first, so that both spellings land on the same route with the
        // same captures (a catch-all would otherwise capture the slash, or match in place of the
        // route the slashless path is on).
        // Routes match, and captures name resources, in the decoded path: a framework hands its
        // handler `u:1` for `/accounts/u%3A1` and for `/accounts/u:1`, so both must be one
        // resource to the fence too. (`normalise` refuses an encoded `/`, so decoding cannot
        // move a segment boundary.) A path that decodes to no text is matched as it is, and
        // names no resource.
        let decoded = match path.contains('%') {
            // Most paths have no escape: nothing to decode, nothing to validate again.
            false => Ok(Cow::Borrowed(path)),
            true => percent_encoding::percent_decode_str(path).decode_utf8(),
        };
        let text = decoded.is_ok();
        let path: &str = match &decoded {
            Ok(decoded) => decoded,
            Err(_) => path,
        };
        let trimmed = path.strip_suffix('/').filter(|p| !p.is_empty());
        let exact = self.router.at(path).ok();
        let found = match (trimmed, exact) {
            (_, Some(found)) if self.routes[found.value[0]].slash_template => found,
            (Some(trimmed), exact) => match (self.router.at(trimmed), exact) {
                (Ok(found), _) | (Err(_), Some(found)) => found,
                (Err(_), None) => return Ok(Matched::None),
            },
            (None, Some(found)) => found,
            (None, None) => return Ok(Matched::None),
        };
        let path = trimmed.unwrap_or(path);
        let candidates = found.value.iter().map(|&i| &self.routes[i]);
        let Some(route) = candidates.clone().find(|r| r.fences(method)) else {
            let first = candidates
                .clone()
                .next()
                .expect("route groups are never empty");
            return Ok(Matched::Pass(first));
        };
        if !text {
            return Err((Some(route), ResourceError::NotText));
        }
        let resource = match &route.resource {
            None => path.to_owned(),
            Some(template) => {
                let mut id = String::with_capacity(64);
                for part in &template.parts {
                    match part {
                        ResourcePart::Literal(s) => id.push_str(s),
                        ResourcePart::Capture(name) => {
                            id.push_str(found.params.get(name).unwrap_or_default())
                        }
                        ResourcePart::Header(name) if name == http::header::HOST => {
                            let host = match authority {
                                Some(authority) => Ok(Cow::Borrowed(authority)),
                                None => header_value(headers, name),
                            };
                            id.push_str(&host.map_err(|e| (Some(route), e))?)
                        }
                        ResourcePart::Header(name) => {
                            id.push_str(&header_value(headers, name).map_err(|e| (Some(route), e))?)
                        }
                        ResourcePart::Query(name) => {
                            id.push_str(&query_value(query, name).map_err(|e| (Some(route), e))?)
                        }
                    }
                }
                id
            }
        };
        if resource.len() > self.max_resource_bytes {
            return Err((Some(route), ResourceError::TooLong(self.max_resource_bytes)));
        }
        let resource =
            ResourceId::new(resource).map_err(|e| (Some(route), ResourceError::NotAnId(e)))?;
        Ok(Matched::Fence { route, resource })
    }
}

/// `None`: the default, every method but GET, HEAD and OPTIONS.
fn fenced_methods(methods: Option<&[MethodCfg]>) -> Option<Vec<Method>> {
    methods.map(|m| m.iter().map(|m| m.0.clone()).collect())
}

/// The path template ends with `/` (and is not just `/`).
fn slash_template(path: &PathTemplate) -> bool {
    path.source.len() > 1 && path.source.ends_with('/')
}

fn header_value<'h>(
    headers: &'h HeaderMap,
    name: &http::HeaderName,
) -> Result<Cow<'h, str>, ResourceError> {
    // `X_Tenant` is `X-Tenant` to servers that fold `_` into `-` (CGI-style `HTTP_X_TENANT`):
    // with both present the downstream may pick the other value, so neither names the resource.
    if headers
        .keys()
        .any(|k| crate::fence::token::is_alias(k, name))
    {
        return Err(ResourceError::Header(name.to_string()));
    }
    // A header the Connection header names is stripped on its way: the upstream would see
    // none, and fall back to whatever it does without one.
    if crate::fence::token::connection_nominates(headers, name) {
        return Err(ResourceError::ConnectionNominated(name.to_string()));
    }
    let mut values = headers.get_all(name).iter();
    let value = match (values.next(), values.next()) {
        (Some(v), None) => v
            .to_str()
            .ok()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| ResourceError::Header(name.to_string()))?,
        _ => return Err(ResourceError::Header(name.to_string())),
    };
    if name.as_str().ends_with("-bin") {
        return canonical_base64(value)
            .map(Cow::Owned)
            .ok_or_else(|| ResourceError::NotBase64(name.to_string()));
    }
    Ok(Cow::Borrowed(value))
}

/// gRPC binary metadata (`-bin` headers) in its one spelling: gRPC servers read `AQ==` and
/// `AQ` (padded or not, any unused bits) as the same bytes, so the fence names the resource
/// by those bytes, written again as unpadded standard base64. `None`: not base64.
fn canonical_base64(value: &str) -> Option<String> {
    use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
    use base64::Engine;
    const LENIENT: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new()
            .with_decode_padding_mode(DecodePaddingMode::Indifferent)
            .with_decode_allow_trailing_bits(true),
    );
    let bytes = LENIENT.decode(value).ok()?;
    Some(base64::engine::general_purpose::STANDARD_NO_PAD.encode(bytes))
}

fn query_value(query: Option<&str>, name: &str) -> Result<String, ResourceError> {
    let missing = || ResourceError::Query(name.to_owned());
    let query = query.unwrap_or_default();
    let found = single_value(query.split('&'), name).ok_or_else(missing)?;
    // Some servers also split on `;` (Rack 2, Go before 1.17, Python before 3.9.2) and keep
    // the last of two values. Unless both readings give this one value, the query names two
    // resources, and neither can be trusted.
    if query.contains(';') && single_value(query.split(['&', ';']), name) != Some(found) {
        return Err(missing());
    }
    let decoded = form_decode(found).ok_or_else(missing)?;
    if decoded.is_empty() || decoded.chars().any(char::is_control) {
        return Err(missing());
    }
    Ok(decoded.into_owned())
}

/// A query key or value as form parsers read it (`application/x-www-form-urlencoded`, which
/// most frameworks apply to queries): `+` is a space, then percent-decoded. `None`: not UTF-8.
fn form_decode(raw: &str) -> Option<Cow<'_, str>> {
    if !raw.contains('+') {
        return percent_encoding::percent_decode_str(raw).decode_utf8().ok();
    }
    let spaced = raw.replace('+', " ");
    let decoded = percent_encoding::percent_decode_str(&spaced)
        .decode_utf8()
        .ok()?;
    Some(Cow::Owned(decoded.into_owned()))
}

/// The value of the one pair named `name` among `pairs`; `None` when there is none, or more
/// than one (the downstream may pick either, so neither names the resource).
fn single_value<'q>(pairs: impl Iterator<Item = &'q str>, name: &str) -> Option<&'q str> {
    let mut found = None;
    for pair in pairs {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        // Keys compare decoded: `sh%61rd` is `shard` to any downstream that decodes them.
        if form_decode(key).is_some_and(|key| key == name) {
            if found.is_some() {
                return None;
            }
            found = Some(value);
        }
    }
    found
}

/// What a request is about (route, resource, token), as its log lines and a refusal's body
/// name it.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Subject<'a> {
    pub route: Option<&'a str>,
    pub resource: Option<&'a str>,
    pub token: Option<Token>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn table(yaml_routes: &str) -> RouteTable {
        let config = Config::parse(&format!(
            "upstream: http://127.0.0.1:1\nroutes:\n{yaml_routes}"
        ))
        .unwrap();
        RouteTable::new(&config.routes, config.unmatched, 64)
    }

    fn fenced(m: Matched<'_>) -> (String, String) {
        match m {
            Matched::Fence { route, resource } => (route.name.clone(), resource.into()),
            other => panic!("expected a fenced match, got {other:?}"),
        }
    }

    #[test]
    fn default_methods_fence_writes_and_unknown_methods() {
        let t = table("  - { name: acc, path: '/accounts/{id}', resource: 'account:{id}' }\n");
        let h = HeaderMap::new();
        for m in ["POST", "PUT", "PATCH", "DELETE", "PURGE", "LOCK"] {
            let method = Method::from_bytes(m.as_bytes()).unwrap();
            let (name, res) = fenced(t.lookup(&method, "/accounts/7", None, None, &h).unwrap());
            assert_eq!((name.as_str(), res.as_str()), ("acc", "account:7"));
        }
        for m in [Method::GET, Method::HEAD, Method::OPTIONS] {
            assert!(matches!(
                t.lookup(&m, "/accounts/7", None, None, &h),
                Ok(Matched::Pass(_))
            ));
        }
        assert!(matches!(
            t.lookup(&Method::PUT, "/other", None, None, &h),
            Ok(Matched::None)
        ));
    }

    #[test]
    fn one_trailing_slash_is_the_same_resource() {
        let t = table("  - { name: acc, path: '/accounts/{id}', resource: 'account:{id}' }\n  - { name: all, path: /ledger }\n");
        let h = HeaderMap::new();
        assert_eq!(
            fenced(
                t.lookup(&Method::PUT, "/accounts/7/", None, None, &h)
                    .unwrap()
            )
            .1,
            "account:7"
        );
        assert_eq!(
            fenced(t.lookup(&Method::PUT, "/ledger/", None, None, &h).unwrap()).1,
            "/ledger"
        );
        assert!(matches!(
            t.lookup(&Method::PUT, "/accounts/7/x", None, None, &h),
            Ok(Matched::None)
        ));
        let t = table(concat!(
            "  - { name: files, path: '/files/{*p}', resource: 'file:{p}' }\n",
            "  - { name: acc, path: '/accounts/{id}', resource: 'account:{id}' }\n",
            "  - { name: slash, path: '/slash/{id}/', resource: 's:{id}' }\n",
            "  - { name: other, path: '/{*rest}', fence: false }\n",
        ));
        assert_eq!(
            fenced(
                t.lookup(&Method::PUT, "/files/a/b/", None, None, &h)
                    .unwrap()
            )
            .1,
            "file:a/b"
        );
        assert_eq!(
            fenced(
                t.lookup(&Method::PUT, "/accounts/7/", None, None, &h)
                    .unwrap()
            )
            .1,
            "account:7"
        );
        assert_eq!(
            fenced(t.lookup(&Method::PUT, "/slash/7/", None, None, &h).unwrap()).1,
            "s:7"
        );
    }

    #[test]
    fn same_path_routes_split_by_method() {
        let t = table(concat!(
            "  - { name: put, path: '/x/{id}', methods: [PUT], resource: 'p:{id}' }\n",
            "  - { name: del, path: '/x/{id}', methods: [DELETE], resource: 'd:{id}' }\n",
        ));
        let h = HeaderMap::new();
        assert_eq!(
            fenced(t.lookup(&Method::PUT, "/x/1", None, None, &h).unwrap()).1,
            "p:1"
        );
        assert_eq!(
            fenced(t.lookup(&Method::DELETE, "/x/1", None, None, &h).unwrap()).1,
            "d:1"
        );
        assert!(
            matches!(t.lookup(&Method::POST, "/x/1", None, None, &h), Ok(Matched::Pass(r)) if r.name == "put")
        );
    }

    #[test]
    fn header_and_query_parts() {
        let t = table("  - { name: q, path: '/jobs/{*rest}', resource: '{header:x-tenant}/{query:shard}/{rest}' }\n");
        let mut h = HeaderMap::new();
        h.insert("x-tenant", "acme".parse().unwrap());
        let m = t
            .lookup(
                &Method::POST,
                "/jobs/a/b",
                Some("x=1&shard=s%201"),
                None,
                &h,
            )
            .unwrap();
        assert_eq!(fenced(m).1, "acme/s 1/a/b");
        // `+` is a space, as form parsers read queries; `%2B` is a `+`.
        for (query, shard) in [
            ("shard=s+1", "s 1"),
            ("sh%61rd=s%2B1", "s+1"),
            ("shard+=2&shard=3", "3"),
        ] {
            let m = t
                .lookup(&Method::POST, "/jobs/a", Some(query), None, &h)
                .unwrap();
            assert_eq!(fenced(m).1, format!("acme/{shard}/a"), "{query}");
        }
        assert_eq!(
            t.lookup(&Method::POST, "/jobs/a", Some("shard=1&shard=2"), None, &h)
                .unwrap_err()
                .1,
            ResourceError::Query("shard".into())
        );
        assert_eq!(
            t.lookup(&Method::POST, "/jobs/a", None, None, &HeaderMap::new())
                .unwrap_err()
                .1,
            ResourceError::Header("x-tenant".into())
        );
        let long = format!("/jobs/{}", "z".repeat(80));
        assert_eq!(
            t.lookup(&Method::POST, &long, Some("shard=1"), None, &h)
                .unwrap_err()
                .1,
            ResourceError::TooLong(64)
        );
        // A tab is legal in a header value, but no part of a resource id: the stores key
        // records by the id and a control byte, so no id may hold one.
        let mut tab = HeaderMap::new();
        tab.insert("x-tenant", "ac\tme".parse().unwrap());
        assert_eq!(
            t.lookup(&Method::POST, "/jobs/a", Some("shard=1"), None, &tab)
                .unwrap_err()
                .1,
            ResourceError::NotAnId(ResourceIdError::Control)
        );
    }

    /// Frameworks hand their handlers decoded captures: every spelling of one decoded id is
    /// one resource, and a path that decodes to no text names none.
    #[test]
    fn captures_and_paths_name_resources_decoded() {
        let t = table(concat!(
            "  - { name: acc, path: '/accounts/{id}', resource: 'account:{id}' }\n",
            "  - { name: raw, path: '/raw/{*rest}' }\n",
        ));
        let h = HeaderMap::new();
        for path in ["/accounts/u:1", "/accounts/u%3A1", "/accounts/u%3A1/"] {
            let (_, res) = fenced(t.lookup(&Method::PUT, path, None, None, &h).unwrap());
            assert_eq!(res, "account:u:1", "{path}");
        }
        let (_, res) = fenced(
            t.lookup(&Method::PUT, "/accounts/caf%C3%A9%20x", None, None, &h)
                .unwrap(),
        );
        assert_eq!(res, "account:café x");
        let (_, res) = fenced(
            t.lookup(&Method::PUT, "/raw/a%3Fb/c", None, None, &h)
                .unwrap(),
        );
        assert_eq!(res, "/raw/a?b/c");
        assert_eq!(
            t.lookup(&Method::PUT, "/accounts/%FF", None, None, &h)
                .unwrap_err()
                .1,
            ResourceError::NotText
        );
        // Off the fenced routes, a path that is no text is not the fence's business.
        assert!(matches!(
            t.lookup(&Method::GET, "/accounts/%FF", None, None, &h),
            Ok(Matched::Pass(_))
        ));
        assert!(matches!(
            t.lookup(&Method::PUT, "/other/%FF", None, None, &h),
            Ok(Matched::None)
        ));
    }

    /// A resource header the `Connection` header nominates would not reach the upstream;
    /// binary metadata is named in one base64 spelling; `Host` is the request target's
    /// authority when it has one.
    #[test]
    fn header_parts_are_read_as_the_upstream_reads_them() {
        let t = table(concat!(
            "  - { name: t, path: /t, resource: 'tenant:{header:X-Tenant}' }\n",
            "  - { name: b, path: /b, resource: 'shard:{header:x-shard-bin}' }\n",
            "  - { name: s, path: /s, resource: 'site:{header:host}' }\n",
        ));
        let headers = |lines: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in lines {
                h.append(*k, http::HeaderValue::from_static(v));
            }
            h
        };
        let at = |path: &str, authority: Option<&str>, h: &HeaderMap| {
            t.lookup(&Method::POST, path, None, authority, h)
        };
        let h = headers(&[("x-tenant", "fresh"), ("connection", "close, X-Tenant")]);
        assert_eq!(
            at("/t", None, &h).unwrap_err().1,
            ResourceError::ConnectionNominated("x-tenant".into())
        );
        for spelling in ["AQ", "AQ==", "AR==", "AR", "AQ="] {
            let h = headers(&[("x-shard-bin", spelling)]);
            assert_eq!(
                fenced(at("/b", None, &h).unwrap()).1,
                "shard:AQ",
                "{spelling}"
            );
        }
        for bad in ["AQ,Ag", "A", "AQ!", "AQ==="] {
            let mut h = HeaderMap::new();
            h.insert("x-shard-bin", http::HeaderValue::from_str(bad).unwrap());
            assert_eq!(
                at("/b", None, &h).unwrap_err().1,
                ResourceError::NotBase64("x-shard-bin".into()),
                "{bad}"
            );
        }
        let h = headers(&[("host", "b.example")]);
        assert_eq!(fenced(at("/s", None, &h).unwrap()).1, "site:b.example");
        assert_eq!(
            fenced(at("/s", Some("a.example"), &h).unwrap()).1,
            "site:a.example"
        );
        let h = headers(&[("host", "b.example"), ("connection", "host")]);
        assert_eq!(
            at("/s", None, &h).unwrap_err().1,
            ResourceError::ConnectionNominated("host".into())
        );
    }

    #[test]
    fn egress_routes_fence_writes_with_their_lease() {
        let config = Config::parse(concat!(
            "upstream: http://127.0.0.1:1\n",
            "leases: { backend: { kind: embedded }, ttl: 1s }\n",
            "egress:\n  upstream: http://127.0.0.1:2\n  routes:\n",
            "    - { path: '/accounts/{id}', lease: 'account:{id}' }\n",
            "    - { path: '/jobs/{id}', lease: 'jobs', methods: [DELETE] }\n",
        ))
        .unwrap();
        let t = RouteTable::egress(&config.egress.unwrap().routes, 64);
        let h = HeaderMap::new();
        let (name, res) = fenced(
            t.lookup(&Method::PUT, "/accounts/7", None, None, &h)
                .unwrap(),
        );
        assert_eq!((name.as_str(), res.as_str()), ("egress[0]", "account:7"));
        let route = &t.routes()[0];
        assert_eq!(route.missing_token, MissingToken::Reject);
        assert_eq!(route.ordering, Ordering::None);
        let (name, res) = fenced(
            t.lookup(&Method::DELETE, "/jobs/1", None, None, &h)
                .unwrap(),
        );
        assert_eq!((name.as_str(), res.as_str()), ("egress[1]", "jobs"));
        assert!(matches!(
            t.lookup(&Method::PUT, "/jobs/1", None, None, &h),
            Ok(Matched::Pass(r)) if r.name == "egress[1]"
        ));
        assert!(matches!(
            t.lookup(&Method::GET, "/accounts/7", None, None, &h),
            Ok(Matched::Pass(_))
        ));
        assert_eq!(t.unmatched, Unmatched::Forward);
    }

    #[test]
    fn unfenced_route_passes_everything() {
        let t = table("  - { name: h, path: /healthz, fence: false }\n");
        assert!(matches!(
            t.lookup(&Method::POST, "/healthz", None, None, &HeaderMap::new()),
            Ok(Matched::Pass(_))
        ));
    }
}
