//! Validated newtypes for configuration values.
//!
//! Each type parses from the YAML string form and refuses bad values at load time, so the
//! error carries the line, column and field path of the offending value.

use std::fmt;

use super::checked::checked_from_str;

use http::header::HeaderName;
use http::{Method, Uri};
use serde::Serialize;

/// The protected service: `http://host:port` or `https://host:port`, no path or query.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub struct UpstreamUrl {
    /// Scheme + authority, kept parsed so the hot path only appends a path.
    pub scheme: http::uri::Scheme,
    pub authority: http::uri::Authority,
}

impl UpstreamUrl {
    pub fn is_https(&self) -> bool {
        self.scheme == http::uri::Scheme::HTTPS
    }
}

impl TryFrom<String> for UpstreamUrl {
    type Error = String;

    fn try_from(raw: String) -> Result<Self, Self::Error> {
        let uri: Uri = raw
            .parse()
            .map_err(|e| format!("`{raw}` is not a URL: {e}"))?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| format!("`{raw}` needs a scheme: http:// or https://"))?;
        if scheme != http::uri::Scheme::HTTP && scheme != http::uri::Scheme::HTTPS {
            return Err(format!("`{raw}`: scheme must be http or https"));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| format!("`{raw}` needs a host"))?;
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(format!(
                "`{raw}`: the upstream is a host and port only; requests keep their own path"
            ));
        }
        Ok(UpstreamUrl { scheme, authority })
    }
}

impl From<UpstreamUrl> for String {
    fn from(u: UpstreamUrl) -> String {
        u.to_string()
    }
}

impl fmt::Display for UpstreamUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.scheme, self.authority)
    }
}

/// An HTTP header name, stored lowercase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub struct HeaderNameCfg(pub HeaderName);

impl TryFrom<String> for HeaderNameCfg {
    type Error = String;

    fn try_from(raw: String) -> Result<Self, Self::Error> {
        if raw.contains('_') {
            // Underscored names are refused on the wire as aliases, so one cannot be the token.
            return Err(format!("`{raw}`: header names with `_` are not allowed"));
        }
        HeaderName::try_from(raw.as_str())
            .map(HeaderNameCfg)
            .map_err(|_| format!("`{raw}` is not a valid header name"))
    }
}

impl From<HeaderNameCfg> for String {
    fn from(h: HeaderNameCfg) -> String {
        h.0.as_str().to_owned()
    }
}

/// An HTTP method as written in the config: uppercase, since methods are case-sensitive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub struct MethodCfg(pub Method);

impl TryFrom<String> for MethodCfg {
    type Error = String;

    fn try_from(raw: String) -> Result<Self, Self::Error> {
        if raw.bytes().any(|b| b.is_ascii_lowercase()) {
            return Err(format!(
                "`{raw}`: methods are case-sensitive, did you mean `{}`?",
                raw.to_ascii_uppercase()
            ));
        }
        Method::from_bytes(raw.as_bytes())
            .map(MethodCfg)
            .map_err(|_| format!("`{raw}` is not a valid HTTP method"))
    }
}

impl From<MethodCfg> for String {
    fn from(m: MethodCfg) -> String {
        m.0.as_str().to_owned()
    }
}

/// One piece of a resource template such as `account:{id}:{header:X-Tenant}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResourcePart {
    Literal(String),
    /// A capture of the route's path template.
    Capture(String),
    /// A request header value (must be visible ASCII).
    Header(HeaderName),
    /// A query parameter, percent-decoded.
    Query(String),
}

/// A parsed `resource:` template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub struct ResourceTemplate {
    pub parts: Vec<ResourcePart>,
    source: String,
}

impl ResourceTemplate {
    /// Names of path captures the template refers to.
    pub fn captures(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            ResourcePart::Capture(name) => Some(name.as_str()),
            _ => None,
        })
    }
}

impl TryFrom<String> for ResourceTemplate {
    type Error = String;

    fn try_from(raw: String) -> Result<Self, Self::Error> {
        let mut parts = Vec::new();
        let mut rest = raw.as_str();
        while !rest.is_empty() {
            match rest.find(['{', '}']) {
                None => {
                    parts.push(ResourcePart::Literal(rest.to_owned()));
                    break;
                }
                Some(i) if rest.as_bytes()[i] == b'}' => {
                    return Err(format!("`{raw}`: unmatched `}}`"));
                }
                Some(i) => {
                    if i > 0 {
                        parts.push(ResourcePart::Literal(rest[..i].to_owned()));
                    }
                    let close = rest[i..]
                        .find('}')
                        .ok_or_else(|| format!("`{raw}`: unclosed `{{`"))?;
                    let inner = &rest[i + 1..i + close];
                    parts.push(parse_placeholder(&raw, inner)?);
                    rest = &rest[i + close + 1..];
                }
            }
        }
        if parts.is_empty() {
            return Err("the resource template is empty".to_owned());
        }
        Ok(ResourceTemplate { parts, source: raw })
    }
}

fn parse_placeholder(raw: &str, inner: &str) -> Result<ResourcePart, String> {
    let valid_name = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    if let Some(name) = inner.strip_prefix("header:") {
        return HeaderName::try_from(name)
            .map(ResourcePart::Header)
            .map_err(|_| format!("`{raw}`: `{name}` is not a valid header name"));
    }
    if let Some(name) = inner.strip_prefix("query:") {
        if !valid_name(name) {
            return Err(format!(
                "`{raw}`: `{name}` is not a valid query parameter name"
            ));
        }
        return Ok(ResourcePart::Query(name.to_owned()));
    }
    let name = inner.strip_prefix('*').unwrap_or(inner);
    if !valid_name(name) {
        return Err(format!(
            "`{raw}`: `{{{inner}}}` must be {{capture}}, {{header:Name}} or {{query:name}}"
        ));
    }
    Ok(ResourcePart::Capture(name.to_owned()))
}

impl From<ResourceTemplate> for String {
    fn from(t: ResourceTemplate) -> String {
        t.source
    }
}

/// The router's limit on parameters in one path.
const MAX_CAPTURES: usize = 26;

/// A route path template such as `/accounts/{id}` or `/files/{*rest}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub struct PathTemplate {
    pub source: String,
    /// Capture names in order, without the `*` of a catch-all.
    pub captures: Vec<String>,
}

impl PathTemplate {
    /// The template with every capture name dropped (`/a/{}/{*}`): two templates that differ
    /// only in their capture names match the same paths.
    pub fn shape(&self) -> String {
        let mut out = String::with_capacity(self.source.len());
        for piece in pieces(&self.source) {
            match piece {
                Piece::Literal(s) => out.push_str(s),
                Piece::Capture { catch_all, .. } => {
                    out.push_str(if catch_all { "{*}" } else { "{}" })
                }
            }
        }
        out
    }

    /// A request path this template matches: every capture filled with `x`.
    pub fn example(&self) -> String {
        let mut out = String::with_capacity(self.source.len());
        for piece in pieces(&self.source) {
            match piece {
                Piece::Literal("{{") => out.push('{'),
                Piece::Literal("}}") => out.push('}'),
                Piece::Literal(s) => out.push_str(s),
                Piece::Capture { .. } => out.push('x'),
            }
        }
        out
    }
}

/// A piece of a path template, as the router reads it (`{{` and `}}` are literal braces).
#[derive(Debug, PartialEq, Eq)]
enum Piece<'a> {
    Literal(&'a str),
    Capture { catch_all: bool },
}

/// The pieces of a template that [`check_path`] accepted.
fn pieces(raw: &str) -> impl Iterator<Item = Piece<'_>> {
    let mut rest = raw;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        if rest.starts_with("{{") || rest.starts_with("}}") {
            let (piece, after) = rest.split_at(2);
            rest = after;
            return Some(Piece::Literal(piece));
        }
        if let Some(inner) = rest.strip_prefix('{') {
            let close = inner.find('}').unwrap_or(inner.len());
            let catch_all = inner.starts_with('*');
            rest = inner.get(close + 1..).unwrap_or_default();
            return Some(Piece::Capture { catch_all });
        }
        let end = rest.find(['{', '}']).unwrap_or(rest.len()).max(1);
        let (piece, after) = rest.split_at(end);
        rest = after;
        Some(Piece::Literal(piece))
    })
}

/// Checks a path template's syntax, saying what to write instead; returns its capture names.
fn check_path(raw: &str) -> Result<Vec<String>, String> {
    if !raw.starts_with('/') {
        return Err(format!(
            "`{raw}` does not start with `/`: write `/{}`",
            raw.trim_start_matches('/')
        ));
    }
    let valid_name = |s: &str| {
        s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    let bytes = raw.as_bytes();
    let mut captures: Vec<String> = Vec::new();
    let (mut segment_start, mut in_segment, mut i) = (0, 0, 0);
    let segment = |start: usize| raw[start..].split('/').next().unwrap_or_default();
    while i < raw.len() {
        match (bytes[i], bytes.get(i + 1)) {
            (b'/', _) => {
                (segment_start, in_segment) = (i + 1, 0);
                i += 1;
            }
            (b'{', Some(b'{')) | (b'}', Some(b'}')) => i += 2,
            (b'}', _) => {
                return Err(format!(
                    "the `}}` in `{}` closes nothing: write `{{name}}` for a capture, or `}}}}` \
                     for a literal `}}`",
                    segment(segment_start)
                ));
            }
            (b'{', _) => {
                let after = &raw[i..];
                let end = after.find('/').unwrap_or(after.len());
                let Some(close) = after[..end].find('}') else {
                    let open = &after[..end];
                    return Err(format!(
                        "`{open}` is not closed: write `{open}}}` for a capture, or `{{{{` for a \
                         literal `{{`"
                    ));
                };
                let inner = &after[1..close];
                let (name, star) = match inner.strip_prefix('*') {
                    Some(name) => (name, "*"),
                    None => (inner, ""),
                };
                if name.is_empty() {
                    let suggestion = if star.is_empty() { "id" } else { "rest" };
                    return Err(format!(
                        "`{{{inner}}}` has no name: write `{{{star}{suggestion}}}`"
                    ));
                }
                if !valid_name(name) {
                    let fixed: String = name
                        .chars()
                        .map(|c| {
                            if c.is_ascii_alphanumeric() || c == '-' {
                                c
                            } else {
                                '_'
                            }
                        })
                        .collect();
                    return Err(format!(
                        "`{{{inner}}}`: a capture name is letters, digits, `_` and `-`: write \
                         `{{{star}{fixed}}}`"
                    ));
                }
                in_segment += 1;
                if in_segment > 1 {
                    return Err(format!(
                        "`{}` has two captures: a path segment holds at most one (with literal \
                         text around it); put them in separate segments",
                        segment(segment_start)
                    ));
                }
                if captures.iter().any(|c| c == name) {
                    return Err(format!(
                        "`{{{name}}}` is captured twice: give each capture its own name"
                    ));
                }
                captures.push(name.to_owned());
                i += close + 1;
                if !star.is_empty() && i < raw.len() {
                    return Err(format!(
                        "`{{*{name}}}` takes the rest of the path, so it must end it: remove \
                         `{}` after it, or write `{{{name}}}` for one segment",
                        &raw[i..]
                    ));
                }
            }
            _ => i += 1,
        }
    }
    if captures.len() > MAX_CAPTURES {
        return Err(format!(
            "`{raw}` has {} captures: a path template has at most {MAX_CAPTURES}",
            captures.len()
        ));
    }
    Ok(captures)
}

impl TryFrom<String> for PathTemplate {
    type Error = String;

    fn try_from(raw: String) -> Result<Self, Self::Error> {
        let captures = check_path(&raw)?;
        // The router is the authority on what it accepts; a throwaway insert reports anything
        // the checks above let through, in plain words.
        let mut probe = matchit::Router::new();
        probe.insert(raw.as_str(), ()).map_err(|e| match e {
            matchit::InsertError::InvalidCatchAll => {
                format!("`{raw}`: a `{{*name}}` capture must end the path")
            }
            matchit::InsertError::InvalidParamSegment => {
                format!("`{raw}`: a path segment holds at most one capture")
            }
            _ => format!(
                "`{raw}` is not a path template: write literal segments and captures such as \
                 `/accounts/{{id}}` or `/files/{{*rest}}`"
            ),
        })?;
        Ok(PathTemplate {
            source: raw,
            captures,
        })
    }
}

impl From<PathTemplate> for String {
    fn from(p: PathTemplate) -> String {
        p.source
    }
}

checked_from_str!(
    UpstreamUrl,
    HeaderNameCfg,
    MethodCfg,
    ResourceTemplate,
    PathTemplate
);
