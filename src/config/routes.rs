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
    #[serde(default = "default_barrier_timeout", with = "crate::duration")]
    pub barrier_timeout: Duration,
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

fn default_barrier_timeout() -> Duration {
    Duration::from_secs(5)
}

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
                return Err(
                    "`name` is empty: give the route a name, which labels its metrics and logs"
                        .into(),
                );
            }
            if let Some(j) = earlier.iter().position(|r| r.name == route.name) {
                return Err(format!(
                    "name `{}` is already used by routes[{j}] `{}`: give each route its own name",
                    route.name, earlier[j].path.source
                ));
            }
            if let Some(template) = &route.resource {
                uses_captures("resource", template, &route.path)?;
            }
            paths.add(earlier, route)
        },
    )
}

/// Every `{capture}` of `template` (the `field` of a route) is one of `path`'s.
pub(super) fn uses_captures(
    field: &str,
    template: &ResourceTemplate,
    path: &PathTemplate,
) -> Result<(), String> {
    for capture in template.captures() {
        if path.captures.iter().any(|c| c == capture) {
            continue;
        }
        let has = match path.captures.as_slice() {
            [] => "it has no captures".to_owned(),
            names => format!(
                "it captures {}",
                names
                    .iter()
                    .map(|n| format!("`{{{n}}}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        return Err(format!(
            "{field} `{}` uses `{{{capture}}}`, which path `{}` does not capture; {has}",
            String::from(template.clone()),
            path.source
        ));
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
    pub(super) fn add<R: Shape>(&mut self, earlier: &[R], route: &R) -> Result<(), String> {
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
                if let Some(m) = shared_fenced_method(other, route) {
                    return Err(format!(
                        "{list}[{j}] and {list}[{i}] both fence {m} on `{}`, so {list}[{i}] would \
                         never see it: give them disjoint `methods`",
                        path.source
                    ));
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
            return Err(format!(
                "path `{}` overlaps the paths of earlier routes, and the router cannot tell which \
                 one a request is on: give it a distinct literal segment",
                path.source
            ));
        };
        let other = other.path();
        if other.shape() == path.shape() {
            return Err(format!(
                "two routes match the same paths: {list}[{j}] `{}` and {list}[{i}] `{}`; merge \
                 them, or write both as `{}` and give them different `methods`",
                other.source, path.source, other.source
            ));
        }
        let example = path.example();
        let mut both = [other, path].into_iter().map(|p| {
            let mut one = matchit::Router::new();
            one.insert(p.source.as_str(), ()).is_ok() && one.at(&example).is_ok()
        });
        let example = if both.all(|matched| matched) {
            format!(" (`{example}` matches both)")
        } else {
            String::new()
        };
        Err(format!(
            "two routes match some of the same paths: {list}[{j}] `{}` and {list}[{i}] `{}`{example}; \
             give them distinct literal segments or merge them",
            other.source, path.source
        ))
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
