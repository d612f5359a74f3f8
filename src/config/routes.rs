//! The `routes:` and `unmatched:` sections, and the checks across the routes of a list
//! (`routes`, `egress.routes`): unique names, captures that exist, and paths the router can
//! tell apart. Each route is checked against those before it as it is read, so that an error
//! carries the route's own line and column. The egress routes' list ([`super::egress`]) is
//! checked with the same parts.

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use super::{checked, values};
use super::{IdempotencyConfig, MethodCfg, PathTemplate, ResourceTemplate};

/// One of `routes`: which requests on a path are fenced, and on which resource.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Label for metrics and logs (`name`); required, unique, not empty.
    pub name: String,
    /// Path template, matched against the normalised request path (`path`); required.
    pub path: PathTemplate,
    /// Fenced methods; `None` means every method except GET, HEAD and OPTIONS.
    #[serde(
        default,
        deserialize_with = "values::methods",
        skip_serializing_if = "Option::is_none"
    )]
    pub methods: Option<Vec<MethodCfg>>,
    /// Resource id template; `None` means the normalised request path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<ResourceTemplate>,
    /// What a fenced write without a token gets (`missing_token`); default `reject`.
    #[serde(default)]
    pub missing_token: MissingToken,
    /// Whether writes of one resource wait for lower tokens in flight (`ordering`); default
    /// `none`.
    #[serde(default)]
    pub ordering: Ordering,
    /// How long a request waits for its turn under `ordering: serialize`; refused with
    /// `ordering: none`, where nothing waits. Filled in ([`DEFAULT_BARRIER_TIMEOUT`]) for a
    /// serialized route once the config is parsed, so it prints as in effect.
    #[serde(
        default,
        with = "crate::duration::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub barrier_timeout: Option<Duration>,
    /// `false`: every request on the route is forwarded unfenced (`fence`); default `true`.
    #[serde(default = "default_true", deserialize_with = "values::flag")]
    pub fence: bool,
    /// `false`: no idempotency keys on this route even though the `idempotency` section is
    /// there; `true`: requires that section. Absent: follow the section.
    #[serde(
        default,
        deserialize_with = "values::optional_flag",
        skip_serializing_if = "Option::is_none"
    )]
    pub idempotency: Option<bool>,
}

impl RouteConfig {
    /// How long a request waits for its turn (`ordering: serialize`).
    pub fn barrier_timeout(&self) -> Duration {
        self.barrier_timeout.unwrap_or(DEFAULT_BARRIER_TIMEOUT)
    }

    /// Whether idempotency keys apply to this route under `section`.
    pub fn idempotent(&self, section: Option<&IdempotencyConfig>) -> bool {
        self.fence && section.is_some() && self.idempotency != Some(false)
    }
}

/// What a fenced write without a token gets (`routes[].missing_token`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MissingToken {
    /// Refused with `428` `urn:fencegate:token-required` (`reject`, the default).
    #[default]
    Reject,
    /// Forwarded unfenced (`allow`).
    Allow,
}

/// Whether a route's admitted writes of one resource reach the upstream in token order
/// (`routes[].ordering`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ordering {
    /// Forwarded as soon as admitted (`none`, the default).
    #[default]
    None,
    /// The per-resource in-flight barrier: a write is forwarded once no write with a lower
    /// token is in flight, or refused with `503` after `barrier_timeout` (`serialize`).
    Serialize,
}

/// What a request on no route gets (`unmatched`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Unmatched {
    /// Forwarded unfenced (`forward`, the default).
    #[default]
    Forward,
    /// Refused with `404` `urn:fencegate:no-route`, whatever its method (`reject`).
    Reject,
}

/// `barrier_timeout` when a serialized route gives none.
pub const DEFAULT_BARRIER_TIMEOUT: Duration = Duration::from_secs(5);

fn default_true() -> bool {
    true
}

/// What the checks need of a route, ingress or egress.
pub(super) trait Shape {
    fn path(&self) -> &PathTemplate;
    fn methods(&self) -> Option<&[MethodCfg]>;
    /// `false`: the route fences nothing (`fence: false`), so it shadows no other route.
    fn fences(&self) -> bool;
}

impl Shape for RouteConfig {
    fn path(&self) -> &PathTemplate {
        &self.path
    }
    fn methods(&self) -> Option<&[MethodCfg]> {
        self.methods.as_deref()
    }
    fn fences(&self) -> bool {
        self.fence
    }
}

/// `routes`.
pub(super) fn routes<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<RouteConfig>, D::Error> {
    let mut paths = Paths::new("routes");
    // Name → index of the route that has it: each route is checked against those before it
    // by lookup, so that a list of thousands of routes loads in time linear in its length.
    let mut names: HashMap<String, usize> = HashMap::new();
    checked::from_seq_each(
        d,
        "a route: a mapping with `name` and `path`",
        move |earlier: &[RouteConfig], route: &RouteConfig| {
            if route.name.is_empty() {
                return Err(RouteError::NoName);
            }
            if let Some(&j) = names.get(&route.name) {
                return Err(RouteError::NameTaken {
                    name: route.name.clone(),
                    other: j,
                    other_path: earlier[j].path.source.clone(),
                });
            }
            if route.barrier_timeout.is_some() && route.ordering != Ordering::Serialize {
                return Err(RouteError::BarrierWithoutSerialize {
                    name: route.name.clone(),
                });
            }
            if let Some(template) = &route.resource {
                uses_captures("resource", template, &route.path)?;
            }
            paths.add(earlier, route)?;
            names.insert(route.name.clone(), earlier.len());
            Ok(())
        },
    )
}

/// A route that the routes before it in its list, or its own path, leave no room for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// A route whose `name` is empty.
    #[error("`name` is empty: give the route a name, which labels its metrics and logs")]
    NoName,
    /// `barrier_timeout` on a route without `ordering: serialize`.
    #[error(
        "route `{name}`: `barrier_timeout` is how long a write waits for its turn under \
         `ordering: serialize`, and this route does not serialize: add `ordering: serialize` or \
         remove `barrier_timeout`"
    )]
    BarrierWithoutSerialize {
        /// The route's name.
        name: String,
    },
    /// A route named as an earlier one is.
    #[error(
        "name `{name}` is already used by routes[{other}] `{other_path}`: give each route its \
         own name"
    )]
    NameTaken {
        /// The name both have.
        name: String,
        /// The earlier route's index in the list.
        other: usize,
        /// The earlier route's path.
        other_path: String,
    },
    /// `field` (`resource`, `lease`) uses a capture its path does not have.
    #[error(
        "{field} `{template}` uses `{{{capture}}}`, which path `{path}` does not capture; {}",
        captures_note(captures)
    )]
    UnknownCapture {
        /// `resource` or `lease`.
        field: &'static str,
        /// The template as written.
        template: String,
        /// The capture it uses, without braces.
        capture: String,
        /// The route's path template.
        path: String,
        /// The captures `path` has.
        captures: Vec<String>,
    },
    /// A route on the same path as an earlier one that fences a method the earlier one
    /// fences: it would never see that method.
    #[error(
        "{list}[{other}] and {list}[{index}] both fence {method} on `{path}`, so \
         {list}[{index}] would never see it: give them disjoint `methods`"
    )]
    SameMethod {
        /// `routes` or `egress.routes`.
        list: &'static str,
        /// The earlier route's index in the list.
        other: usize,
        /// This route's index in the list.
        index: usize,
        /// A method both fence.
        method: String,
        /// The path both are on.
        path: String,
    },
    /// A path that overlaps those of earlier routes, so that the router cannot tell which
    /// route a request is on.
    #[error(
        "path `{path}` overlaps the paths of earlier routes, and the router cannot tell which \
         one a request is on: give it a distinct literal segment"
    )]
    Overlaps {
        /// This route's path.
        path: String,
    },
    /// A path that matches the same paths as an earlier route's, its captures named
    /// otherwise.
    #[error(
        "two routes match the same paths: {list}[{other}] `{other_path}` and {list}[{index}] \
         `{path}`; merge them, or write both as `{other_path}` and give them different `methods`"
    )]
    SamePaths {
        /// `routes` or `egress.routes`.
        list: &'static str,
        /// The earlier route's index in the list.
        other: usize,
        /// The earlier route's path.
        other_path: String,
        /// This route's index in the list.
        index: usize,
        /// This route's path.
        path: String,
    },
    /// A path that matches some of the same paths as an earlier route's.
    #[error(
        "two routes match some of the same paths: {list}[{other}] `{other_path}` and \
         {list}[{index}] `{path}`{}; give them distinct literal segments or merge them",
        example_note(example)
    )]
    SharedPaths {
        /// `routes` or `egress.routes`.
        list: &'static str,
        /// The earlier route's index in the list.
        other: usize,
        /// The earlier route's path.
        other_path: String,
        /// This route's index in the list.
        index: usize,
        /// This route's path.
        path: String,
        /// A request path both match, when the router can say.
        example: Option<String>,
    },
}

fn captures_note(captures: &[String]) -> String {
    match captures {
        [] => "it has no captures".to_owned(),
        names => format!(
            "it captures {}",
            names
                .iter()
                .map(|n| format!("`{{{n}}}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn example_note(example: &Option<String>) -> String {
    match example {
        Some(example) => format!(" (`{example}` matches both)"),
        None => String::new(),
    }
}

/// Every `{capture}` of `template` (the `field` of a route) is one of `path`'s.
pub(super) fn uses_captures(
    field: &'static str,
    template: &ResourceTemplate,
    path: &PathTemplate,
) -> Result<(), RouteError> {
    for capture in template.captures() {
        if path.captures.iter().any(|c| c == capture) {
            continue;
        }
        return Err(RouteError::UnknownCapture {
            field,
            template: String::from(template.clone()),
            capture: capture.to_owned(),
            path: path.source.clone(),
            captures: path.captures.clone(),
        });
    }
    Ok(())
}

/// The path templates of one list, in a router as the list is read.
pub(super) struct Paths {
    list: &'static str,
    router: matchit::Router<()>,
    /// Path template → indexes of the routes on it, in list order: a route finds those on
    /// its path by lookup, not by a scan of every route before it (which made loading a list
    /// quadratic in its length).
    on_path: HashMap<String, Vec<usize>>,
}

impl Paths {
    pub(super) fn new(list: &'static str) -> Self {
        Paths {
            list,
            router: matchit::Router::new(),
            on_path: HashMap::new(),
        }
    }

    /// Adds the route after `earlier`, or says why the router cannot have it.
    pub(super) fn add<R: Shape>(&mut self, earlier: &[R], route: &R) -> Result<(), RouteError> {
        let (list, i, path) = (self.list, earlier.len(), route.path());
        if let Some(same) = self.on_path.get_mut(&path.source) {
            // One path, several routes: allowed when they fence different methods, else the
            // later one would never see the method.
            for &j in same.iter() {
                if let Some(method) = shared_fenced_method(&earlier[j], route) {
                    return Err(RouteError::SameMethod {
                        list,
                        other: j,
                        index: i,
                        method,
                        path: path.source.clone(),
                    });
                }
            }
            same.push(i);
            return Ok(());
        }
        if self.router.insert(path.source.as_str(), ()).is_ok() {
            self.on_path.insert(path.source.clone(), vec![i]);
            return Ok(());
        }
        // Find the route it conflicts with: the first earlier path that conflicts on its own.
        let partner = earlier.iter().enumerate().find(|(_, other)| {
            let mut pair = matchit::Router::new();
            pair.insert(other.path().source.as_str(), ()).is_ok()
                && pair.insert(path.source.as_str(), ()).is_err()
        });
        let Some((j, other)) = partner else {
            return Err(RouteError::Overlaps {
                path: path.source.clone(),
            });
        };
        let other = other.path();
        if other.shape() == path.shape() {
            return Err(RouteError::SamePaths {
                list,
                other: j,
                other_path: other.source.clone(),
                index: i,
                path: path.source.clone(),
            });
        }
        let example = path.example();
        let mut both = [other, path].into_iter().map(|p| {
            let mut one = matchit::Router::new();
            one.insert(p.source.as_str(), ()).is_ok() && one.at(&example).is_ok()
        });
        let example = both.all(|matched| matched).then_some(example);
        Err(RouteError::SharedPaths {
            list,
            other: j,
            other_path: other.source.clone(),
            index: i,
            path: path.source.clone(),
            example,
        })
    }
}

/// A method both routes would fence, if any.
fn shared_fenced_method<R: Shape>(a: &R, b: &R) -> Option<String> {
    if !a.fences() || !b.fences() {
        return None;
    }
    let fenced = |r: &R, m: &http::Method| match r.methods() {
        Some(list) => list.iter().any(|x| x.0 == *m),
        None => !matches!(
            *m,
            http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
        ),
    };
    let candidates: Vec<http::Method> = match (a.methods(), b.methods()) {
        (Some(list), _) | (None, Some(list)) => list.iter().map(|m| m.0.clone()).collect(),
        (None, None) => vec![http::Method::POST],
    };
    candidates
        .into_iter()
        .find(|m| fenced(a, m) && fenced(b, m))
        .map(|m| m.to_string())
}
