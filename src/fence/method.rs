//! Method override headers: `X-HTTP-Method-Override`, `X-HTTP-Method` and
//! `X-Method-Override` make many frameworks (Express's method-override, Rails and Symfony
//! behind some proxies, ASP.NET, Google's APIs) treat a `GET` or `POST` as the method they
//! name. The fence must then treat it so too, or a `DELETE` sent as
//! `GET` + `X-HTTP-Method-Override: DELETE` passes unfenced.

use http::header::{HeaderMap, HeaderValue};
use http::Method;

/// The headers read as a method override, in lower case as header names are kept.
pub const OVERRIDE_HEADERS: [&str; 3] = [
    "x-http-method-override",
    "x-http-method",
    "x-method-override",
];

/// Why a method override was refused (400 `invalid-request`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverrideError {
    /// More than one override header line, of one name or of several.
    #[error(
        "more than one method override header (X-HTTP-Method-Override, X-HTTP-Method, \
         X-Method-Override); send at most one"
    )]
    Repeated,
    /// The override header (named, in lower case) does not hold one method token.
    #[error("the method override header `{0}` does not name an HTTP method")]
    Malformed(&'static str),
    /// `X_HTTP_Method_Override`: servers that fold `_` into `-` (WSGI, CGI, Rack) read it as
    /// the override, so it would change the method behind the fence's back.
    #[error(
        "a header spelled `{0}` aliases the method override header `{1}`, which servers that \
         fold `_` into `-` honour; use `-`, not `_`"
    )]
    Alias(String, &'static str),
}

/// The method a request's override header names (upper-cased: frameworks compare it without
/// regard to case), `None` when it has none. One header line, naming one method token, or
/// an error.
pub fn method_override(headers: &HeaderMap) -> Result<Option<Method>, OverrideError> {
    // One walk over the header lines, names compared as strings (most differ in length at
    // once): cheaper, on every request on a route, than three lookups that hash each name.
    let mut found: Option<(&'static str, &HeaderValue)> = None;
    for (name, value) in headers {
        let name = name.as_str();
        // The three names differ in length: the length finds the one a header could be, and
        // most headers are none of them.
        let Some(&known) = OVERRIDE_HEADERS.iter().find(|h| h.len() == name.len()) else {
            continue;
        };
        if name != known {
            // An override spelled with `_` where the name has `-`.
            if is_alias(name, known) {
                return Err(OverrideError::Alias(name.to_owned(), known));
            }
            continue;
        }
        if found.is_some() {
            return Err(OverrideError::Repeated);
        }
        found = Some((known, value));
    }
    let Some((name, value)) = found else {
        return Ok(None);
    };
    let malformed = || OverrideError::Malformed(name);
    let raw = value.as_bytes().trim_ascii();
    if raw.is_empty() || raw.len() > 32 {
        return Err(malformed());
    }
    // RFC 9110 §9.1: a method is a token; a comma or space would be a list or a trick.
    let tchar = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b);
    if !raw.iter().all(tchar) {
        return Err(malformed());
    }
    Method::from_bytes(&raw.to_ascii_uppercase())
        .map(Some)
        .map_err(|_| malformed())
}

/// `candidate` is `name` once each `_` is read as `-`, but not `name` itself.
fn is_alias(candidate: &str, name: &str) -> bool {
    candidate.len() == name.len()
        && candidate != name
        && candidate
            .bytes()
            .zip(name.bytes())
            .all(|(c, n)| c == n || (c == b'_' && n == b'-'))
}

const _: () = {
    // [`method_override`] tells the names apart by their length.
    let [a, b, c] = OVERRIDE_HEADERS;
    assert!(a.len() != b.len() && b.len() != c.len() && a.len() != c.len());
};

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(lines: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in lines {
            h.append(*n, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn names_the_method_in_any_case() {
        assert_eq!(method_override(&headers(&[])), Ok(None));
        for name in [
            "x-http-method-override",
            "x-http-method",
            "x-method-override",
        ] {
            assert_eq!(
                method_override(&headers(&[(name, "delete")])),
                Ok(Some(Method::DELETE))
            );
        }
        assert_eq!(
            method_override(&headers(&[("x-http-method-override", " PATCH ")])),
            Ok(Some(Method::PATCH))
        );
        assert_eq!(
            method_override(&headers(&[("x-http-method", "PURGE")])),
            Ok(Some(Method::from_bytes(b"PURGE").unwrap()))
        );
    }

    #[test]
    fn repeated_or_malformed_is_refused() {
        let repeated = [
            headers(&[
                ("x-http-method-override", "DELETE"),
                ("x-http-method", "DELETE"),
            ]),
            headers(&[
                ("x-http-method-override", "DELETE"),
                ("x-http-method-override", "DELETE"),
            ]),
            headers(&[("x-method-override", "PUT"), ("x-http-method", "GET")]),
        ];
        for h in repeated {
            assert_eq!(method_override(&h), Err(OverrideError::Repeated));
        }
        for (alias, known) in [
            ("x_http_method_override", "x-http-method-override"),
            ("x-http_method-override", "x-http-method-override"),
            ("x_http_method", "x-http-method"),
            ("x_method_override", "x-method-override"),
        ] {
            // Alone, or beside a well-spelled override: servers may read either.
            for beside in [None, Some(known)] {
                let mut h = HeaderMap::new();
                h.insert(alias, HeaderValue::from_static("PUT"));
                if let Some(known) = beside {
                    h.insert(known, HeaderValue::from_static("PUT"));
                }
                assert_eq!(
                    method_override(&h),
                    Err(OverrideError::Alias(alias.to_owned(), known)),
                    "{alias}"
                );
            }
        }
        // Other names with `_` are no override.
        let h = headers(&[("x_http_method_overrides", "PUT"), ("x_request_id", "1")]);
        assert_eq!(method_override(&h), Ok(None));
        for bad in ["", "DELETE, PUT", "DE LETE", "DELETE;", &*"A".repeat(33)] {
            let mut h = HeaderMap::new();
            h.insert("x-http-method", HeaderValue::from_str(bad).unwrap());
            assert_eq!(
                method_override(&h),
                Err(OverrideError::Malformed("x-http-method")),
                "{bad:?}"
            );
        }
    }
}
