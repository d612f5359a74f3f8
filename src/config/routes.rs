//! The `routes:` and `unmatched:` sections, and the checks across the routes of a list
//! (`routes`, `egress.routes`): unique names, captures that exist, and paths the router can
//! tell apart. Each route is checked against those before it as it is read, so that an error
//! carries the route's own line and column. The egress routes' list ([`super::egress`]) is
//! checked with the same parts.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use super::{checked, values};
use super::{IdempotencyConfig, MethodCfg, PathTemplate, ResourceTemplate};

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub name: String,
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
    #[serde(default)]
    pub missing_token: MissingToken,
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

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MissingToken {
    #[default]
    Reject,
    Allow,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Ordering {
    #[default]
    None,
    Serialize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Unmatched {
    #[default]
    Forward,
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
    checked::from_seq_each(
        d,
        "a route: a mapping with `name` and `path`",
        move |earlier: &[RouteConfig], route: &RouteConfig| {
            if route.name.is_empty() {
                return Err(RouteError::NoName);
            }
            if let Some(j) = earlier.iter().position(|r| r.name == route.name) {
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
            paths.add(earlier, route)
        },
    )
}

/// A route that the routes before it in its list, or its own path, leave no room for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("`name` is empty: give the route a name, which labels its metrics and logs")]
    NoName,
    #[error(
        "route `{name}`: `barrier_timeout` is how long a write waits for its turn under \
         `ordering: serialize`, and this route does not serialize: add `ordering: serialize` or \
         remove `barrier_timeout`"
    )]
    BarrierWithoutSerialize { name: String },
    #[error(
        "name `{name}` is already used by routes[{other}] `{other_path}`: give each route its \
         own name"
    )]
    NameTaken {
        name: String,
        other: usize,
        other_path: String,
    },
    /// `field` (`resource`, `lease`) uses a capture its path does not have.
    #[error(
        "{field} `{template}` uses `{{{capture}}}`, which path `{path}` does not capture; {}",
        captures_note(captures)
    )]
    UnknownCapture {
        field: &'static str,
        template: String,
        capture: String,
        path: String,
        captures: Vec<String>,
    },
    #[error(
        "{list}[{other}] and {list}[{index}] both fence {method} on `{path}`, so \
         {list}[{index}] would never see it: give them disjoint `methods`"
    )]
    SameMethod {
        list: &'static str,
        other: usize,
        index: usize,
        method: String,
        path: String,
    },
    #[error(
        "path `{path}` overlaps the paths of earlier routes, and the router cannot tell which \
         one a request is on: give it a distinct literal segment"
    )]
    Overlaps { path: String },
    #[error(
        "two routes match the same paths: {list}[{other}] `{other_path}` and {list}[{index}] \
         `{path}`; merge them, or write both as `{other_path}` and give them different `methods`"
    )]
    SamePaths {
        list: &'static str,
        other: usize,
        other_path: String,
        index: usize,
        path: String,
    },
    /// `example`: a request path both match, when the router can say.
    #[error(
        "two routes match some of the same paths: {list}[{other}] `{other_path}` and \
         {list}[{index}] `{path}`{}; give them distinct literal segments or merge them",
        example_note(example)
    )]
    SharedPaths {
        list: &'static str,
        other: usize,
        other_path: String,
        index: usize,
        path: String,
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
}

impl Paths {
    pub(super) fn new(list: &'static str) -> Self {
        Paths {
            list,
            router: matchit::Router::new(),
        }
    }

    /// Adds the route after `earlier`, or says why the router cannot have it.
    pub(super) fn add<R: Shape>(&mut self, earlier: &[R], route: &R) -> Result<(), RouteError> {
        let (list, i, path) = (self.list, earlier.len(), route.path());
        let same: Vec<(usize, &R)> = earlier
            .iter()
            .enumerate()
            .filter(|(_, r)| r.path().source == path.source)
            .collect();
        if !same.is_empty() {
            // One path, several routes: allowed when they fence different methods, else the
            // later one would never see the method.
            for (j, other) in same {
                if let Some(method) = shared_fenced_method(other, route) {
                    return Err(RouteError::SameMethod {
                        list,
                        other: j,
                        index: i,
                        method,
                        path: path.source.clone(),
                    });
                }
            }
            return Ok(());
        }
        if self.router.insert(path.source.as_str(), ()).is_ok() {
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
