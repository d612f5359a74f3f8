//! A route's `path` template (`/accounts/{id}`, `/files/{*rest}`), checked as the router will
//! read it, with errors that say what to write instead.

use serde::Serialize;

use super::checked::checked_from_str;

/// The router's limit on parameters in one path.
const MAX_CAPTURES: usize = 26;

/// A route path template such as `/accounts/{id}` or `/files/{*rest}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub struct PathTemplate {
    /// The template as written.
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

/// A path template that the router would not take, or would not read as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// The template does not start with `/`.
    #[error("`{path}` does not start with `/`: write `/{}`", path.trim_start_matches('/'))]
    NotAbsolute {
        /// The template as written.
        path: String,
    },
    /// A `}` that closes no `{`.
    #[error(
        "the `}}` in `{segment}` closes nothing: write `{{name}}` for a capture, or `}}}}` for a \
         literal `}}`"
    )]
    StrayClose {
        /// The path segment holding it.
        segment: String,
    },
    /// A `{` with no `}` in its segment.
    #[error(
        "`{open}` is not closed: write `{open}}}` for a capture, or `{{{{` for a literal `{{`"
    )]
    Unclosed {
        /// From the `{` to the end of its segment.
        open: String,
    },
    /// A capture without a name: `{}` or `{*}`.
    #[error(
        "`{{{star}}}` has no name: write `{{{star}{}}}`",
        if star.is_empty() { "id" } else { "rest" }
    )]
    NoName {
        /// `*` for a catch-all, else empty.
        star: &'static str,
    },
    /// A capture name with a character other than letters, digits, `_` and `-`.
    #[error(
        "`{{{star}{name}}}`: a capture name is letters, digits, `_` and `-`: write \
         `{{{star}{fixed}}}`"
    )]
    BadName {
        /// `*` for a catch-all, else empty.
        star: &'static str,
        /// The name as written.
        name: String,
        /// The name with every other character made `_`.
        fixed: String,
    },
    /// Two captures in one path segment.
    #[error(
        "`{segment}` has two captures: a path segment holds at most one (with literal text \
         around it); put them in separate segments"
    )]
    TwoCaptures {
        /// The segment as written.
        segment: String,
    },
    /// One capture name used twice.
    #[error("`{{{name}}}` is captured twice: give each capture its own name")]
    Duplicate {
        /// The name.
        name: String,
    },
    /// A `{*name}` catch-all that does not end the path.
    #[error(
        "`{{*{name}}}` takes the rest of the path, so it must end it: remove `{after}` after \
         it, or write `{{{name}}}` for one segment"
    )]
    CatchAllNotLast {
        /// The catch-all's name.
        name: String,
        /// What follows it.
        after: String,
    },
    /// More captures than the router takes in one path (26).
    #[error(
        "`{path}` has {count} captures: a path template has at most {}",
        MAX_CAPTURES
    )]
    TooManyCaptures {
        /// The template as written.
        path: String,
        /// How many captures it has.
        count: usize,
    },
    /// A capture written as another router writes it (`:id`, `<id>`, `*`): the router reads it
    /// as literal text, so the route would never match and its writes would pass unfenced.
    #[error(
        "`{path}`: `{segment}` is literal text here, so the route would never match and its \
         writes would pass unfenced; captures are written in braces: write `{fixed}`"
    )]
    ForeignCapture {
        /// The template as written.
        path: String,
        /// The first segment written so.
        segment: String,
        /// The template with each such segment written in braces.
        fixed: String,
    },
    /// A catch-all the router refused that the checks above let through: it must end the
    /// path.
    #[error("`{path}`: a `{{*name}}` capture must end the path")]
    RouterCatchAll {
        /// The template as written.
        path: String,
    },
    /// A segment the router refused that the checks above let through: it holds more than
    /// one capture.
    #[error("`{path}`: a path segment holds at most one capture")]
    RouterParamSegment {
        /// The template as written.
        path: String,
    },
    /// Anything else the router refused that the checks above let through.
    #[error(
        "`{path}` is not a path template: write literal segments and captures such as \
         `/accounts/{{id}}` or `/files/{{*rest}}`"
    )]
    RouterOther {
        /// The template as written.
        path: String,
    },
}

/// The `{…}` form of a segment written as a capture in another router's syntax: `:id` and
/// `:id?` (Express, Rails), `<id>` and `<int:id>` (Flask), `*`, `**` and `*rest` (globs and
/// wildcards); `None` for a segment that is not one.
fn braced(segment: &str) -> Option<String> {
    if segment.contains('{') {
        return None;
    }
    if let Some(name) = segment.strip_prefix(':').filter(|n| !n.is_empty()) {
        return Some(format!("{{{}}}", name.trim_end_matches(['?', '*', '+'])));
    }
    if let Some(inner) = segment.strip_prefix('<').and_then(|s| s.strip_suffix('>')) {
        let name = inner.rsplit(':').next().unwrap_or(inner);
        return Some(format!("{{{name}}}"));
    }
    if segment.contains('*') {
        let name = segment.trim_start_matches('*');
        return Some(match name {
            "" => "{*rest}".to_owned(),
            name if !name.contains('*') => format!("{{*{name}}}"),
            _ => "{*rest}".to_owned(),
        });
    }
    None
}

/// Checks a path template's syntax, saying what to write instead; returns its capture names.
fn check_path(raw: &str) -> Result<Vec<String>, PathError> {
    if !raw.starts_with('/') {
        return Err(PathError::NotAbsolute {
            path: raw.to_owned(),
        });
    }
    let segments: Vec<&str> = raw.split('/').collect();
    if let Some(segment) = segments.iter().find(|s| braced(s).is_some()) {
        let fixed: Vec<String> = segments
            .iter()
            .map(|s| braced(s).unwrap_or_else(|| (*s).to_owned()))
            .collect();
        return Err(PathError::ForeignCapture {
            path: raw.to_owned(),
            segment: (*segment).to_owned(),
            fixed: fixed.join("/"),
        });
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
                return Err(PathError::StrayClose {
                    segment: segment(segment_start).to_owned(),
                });
            }
            (b'{', _) => {
                let after = &raw[i..];
                let end = after.find('/').unwrap_or(after.len());
                let Some(close) = after[..end].find('}') else {
                    return Err(PathError::Unclosed {
                        open: after[..end].to_owned(),
                    });
                };
                let inner = &after[1..close];
                let (name, star) = match inner.strip_prefix('*') {
                    Some(name) => (name, "*"),
                    None => (inner, ""),
                };
                if name.is_empty() {
                    return Err(PathError::NoName { star });
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
                    return Err(PathError::BadName {
                        star,
                        name: name.to_owned(),
                        fixed,
                    });
                }
                in_segment += 1;
                if in_segment > 1 {
                    return Err(PathError::TwoCaptures {
                        segment: segment(segment_start).to_owned(),
                    });
                }
                if captures.iter().any(|c| c == name) {
                    return Err(PathError::Duplicate {
                        name: name.to_owned(),
                    });
                }
                captures.push(name.to_owned());
                i += close + 1;
                if !star.is_empty() && i < raw.len() {
                    return Err(PathError::CatchAllNotLast {
                        name: name.to_owned(),
                        after: raw[i..].to_owned(),
                    });
                }
            }
            _ => i += 1,
        }
    }
    if captures.len() > MAX_CAPTURES {
        return Err(PathError::TooManyCaptures {
            path: raw.to_owned(),
            count: captures.len(),
        });
    }
    Ok(captures)
}

impl TryFrom<String> for PathTemplate {
    type Error = PathError;

    fn try_from(raw: String) -> Result<Self, Self::Error> {
        let captures = check_path(&raw)?;
        // The router is the authority on what it accepts; a throwaway insert reports anything
        // the checks above let through, in plain words.
        let mut probe = matchit::Router::new();
        probe.insert(raw.as_str(), ()).map_err(|e| {
            let path = raw.clone();
            match e {
                matchit::InsertError::InvalidCatchAll => PathError::RouterCatchAll { path },
                matchit::InsertError::InvalidParamSegment => PathError::RouterParamSegment { path },
                _ => PathError::RouterOther { path },
            }
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

checked_from_str!(PathTemplate);
