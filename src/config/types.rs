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
    /// The host, and the port when one is written.
    pub authority: http::uri::Authority,
}

impl UpstreamUrl {
    /// Whether the scheme is `https`.
    pub(crate) fn is_https(&self) -> bool {
        self.scheme == http::uri::Scheme::HTTPS
    }
}

/// An `upstream` that is not `http(s)://host:port`.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamUrlError {
    /// Not a URL at all.
    #[error("`{url}` is not a URL: {source}")]
    NotAUrl {
        /// As written.
        url: String,
        /// Why it does not parse.
        source: http::uri::InvalidUri,
    },
    /// The url, as written, has no scheme.
    #[error("`{0}` needs a scheme: http:// or https://")]
    NoScheme(String),
    /// The url, as written, has a scheme other than `http` and `https`.
    #[error("`{0}`: scheme must be http or https")]
    WrongScheme(String),
    /// The url, as written, has no host.
    #[error("`{0}` needs a host")]
    NoHost(String),
    /// The url, as written, has a path (other than `/`) or a query.
    #[error("`{0}`: the upstream is a host and port only; requests keep their own path")]
    HasPath(String),
}

impl TryFrom<String> for UpstreamUrl {
    type Error = UpstreamUrlError;

    fn try_from(raw: String) -> Result<Self, Self::Error> {
        let uri: Uri = match raw.parse() {
            Ok(uri) => uri,
            Err(source) => return Err(UpstreamUrlError::NotAUrl { url: raw, source }),
        };
        let Some(scheme) = uri.scheme().cloned() else {
            return Err(UpstreamUrlError::NoScheme(raw));
        };
        if scheme != http::uri::Scheme::HTTP && scheme != http::uri::Scheme::HTTPS {
            return Err(UpstreamUrlError::WrongScheme(raw));
        }
        let Some(authority) = uri.authority().cloned() else {
            return Err(UpstreamUrlError::NoHost(raw));
        };
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(UpstreamUrlError::HasPath(raw));
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

/// A header name that cannot be one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderNameError {
    /// Underscored names are refused on the wire as aliases, so one cannot be the token.
    #[error("`{0}`: header names with `_` are not allowed")]
    Underscore(String),
    /// The name, as written, is not a header name.
    #[error("`{0}` is not a valid header name")]
    Invalid(String),
}

impl TryFrom<String> for HeaderNameCfg {
    type Error = HeaderNameError;

    fn try_from(raw: String) -> Result<Self, Self::Error> {
        if raw.contains('_') {
            return Err(HeaderNameError::Underscore(raw));
        }
        match HeaderName::try_from(raw.as_str()) {
            Ok(name) => Ok(HeaderNameCfg(name)),
            Err(_) => Err(HeaderNameError::Invalid(raw)),
        }
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

/// A method that is not one as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MethodError {
    /// A method with a lowercase letter (`post` for `POST`).
    #[error(
        "`{method}`: methods are case-sensitive, did you mean `{}`?",
        method.to_ascii_uppercase()
    )]
    Lowercase {
        /// As written.
        method: String,
    },
    /// The method, as written, is not an HTTP method.
    #[error("`{0}` is not a valid HTTP method")]
    Invalid(String),
}

impl TryFrom<String> for MethodCfg {
    type Error = MethodError;

    fn try_from(raw: String) -> Result<Self, Self::Error> {
        if raw.bytes().any(|b| b.is_ascii_lowercase()) {
            return Err(MethodError::Lowercase { method: raw });
        }
        match Method::from_bytes(raw.as_bytes()) {
            Ok(method) => Ok(MethodCfg(method)),
            Err(_) => Err(MethodError::Invalid(raw)),
        }
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
    /// Text taken as written.
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
    /// The template's pieces, in order; together their values make the resource id.
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

/// A `resource` (or `lease`) template that cannot be read; `template` is as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResourceTemplateError {
    /// A `}` that closes no `{`.
    #[error("`{template}`: unmatched `}}`")]
    UnmatchedClose {
        /// The template as written.
        template: String,
    },
    /// A `{` with no `}` after it.
    #[error("`{template}`: unclosed `{{`")]
    Unclosed {
        /// The template as written.
        template: String,
    },
    /// An empty template.
    #[error("the resource template is empty")]
    Empty,
    /// A `{header:Name}` whose name is not a header name.
    #[error("`{template}`: `{name}` is not a valid header name")]
    BadHeader {
        /// The template as written.
        template: String,
        /// The name as written.
        name: String,
    },
    /// A `{query:name}` whose name is empty or not letters, digits, `_` and `-`.
    #[error("`{template}`: `{name}` is not a valid query parameter name")]
    BadQuery {
        /// The template as written.
        template: String,
        /// The name as written.
        name: String,
    },
    /// A header the proxy strips or rewrites on its way upstream: the upstream would see
    /// another value than the one the fence checked.
    #[error("`{template}`: `{name}` cannot name a resource: {why}")]
    RewrittenHeader {
        /// The template as written.
        template: String,
        /// The header's name as written.
        name: String,
        /// What the proxy does to the header.
        why: &'static str,
    },
    /// Braces holding neither a capture name (letters, digits, `_` and `-`), `header:Name`
    /// nor `query:name`.
    #[error("`{template}`: `{{{inner}}}` must be {{capture}}, {{header:Name}} or {{query:name}}")]
    BadPlaceholder {
        /// The template as written.
        template: String,
        /// What the braces hold.
        inner: String,
    },
}

impl TryFrom<String> for ResourceTemplate {
    type Error = ResourceTemplateError;

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
                    return Err(ResourceTemplateError::UnmatchedClose {
                        template: raw.clone(),
                    });
                }
                Some(i) => {
                    if i > 0 {
                        parts.push(ResourcePart::Literal(rest[..i].to_owned()));
                    }
                    let close =
                        rest[i..]
                            .find('}')
                            .ok_or_else(|| ResourceTemplateError::Unclosed {
                                template: raw.clone(),
                            })?;
                    let inner = &rest[i + 1..i + close];
                    parts.push(parse_placeholder(&raw, inner)?);
                    rest = &rest[i + close + 1..];
                }
            }
        }
        if parts.is_empty() {
            return Err(ResourceTemplateError::Empty);
        }
        Ok(ResourceTemplate { parts, source: raw })
    }
}

fn parse_placeholder(raw: &str, inner: &str) -> Result<ResourcePart, ResourceTemplateError> {
    let valid_name = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    if let Some(name) = inner.strip_prefix("header:") {
        let header = HeaderName::try_from(name).map_err(|_| ResourceTemplateError::BadHeader {
            template: raw.to_owned(),
            name: name.to_owned(),
        })?;
        if let Some(why) = rewritten(&header) {
            return Err(ResourceTemplateError::RewrittenHeader {
                template: raw.to_owned(),
                name: name.to_owned(),
                why,
            });
        }
        return Ok(ResourcePart::Header(header));
    }
    if let Some(name) = inner.strip_prefix("query:") {
        if !valid_name(name) {
            return Err(ResourceTemplateError::BadQuery {
                template: raw.to_owned(),
                name: name.to_owned(),
            });
        }
        return Ok(ResourcePart::Query(name.to_owned()));
    }
    let name = inner.strip_prefix('*').unwrap_or(inner);
    if !valid_name(name) {
        return Err(ResourceTemplateError::BadPlaceholder {
            template: raw.to_owned(),
            inner: inner.to_owned(),
        });
    }
    Ok(ResourcePart::Capture(name.to_owned()))
}

/// Why a header cannot name a resource, for the headers the proxy strips or rewrites before
/// the upstream sees them: the fence would check one value and the upstream act on another.
fn rewritten(name: &HeaderName) -> Option<&'static str> {
    if crate::headers::is_hop_by_hop(name.as_str()) {
        return Some("it is a hop-by-hop header, removed before the request is forwarded");
    }
    Some(match name.as_str() {
        "x-forwarded-host" => {
            "fencegate sets it to the host the client addressed before forwarding; name the \
             resource by `{header:Host}`, which is that host"
        }
        "x-forwarded-for" | "x-forwarded-proto" => {
            "fencegate rewrites it before forwarding (the client's address, the scheme)"
        }
        _ => return None,
    })
}

impl From<ResourceTemplate> for String {
    fn from(t: ResourceTemplate) -> String {
        t.source
    }
}

checked_from_str!(UpstreamUrl, HeaderNameCfg, MethodCfg, ResourceTemplate);
