//! problem+json bodies (RFC 9457), the same on every listener: the proxy's refusals, the lease
//! API and the admin listener answer `type`, `title`, `status`, `detail`, then what the problem
//! is about. [`refusal`] holds every reason the fence answers instead of the upstream, in
//! one table; [`grpc`] answers them the gRPC way to gRPC calls.

pub mod grpc;
pub mod refusal;

use http::header::{HeaderValue, ALLOW, CONTENT_TYPE};
use http::{Method, Response, StatusCode};
use serde_json::{json, Value};

use crate::body::ProxyBody;

/// A problem+json body (RFC 9457): `type`, `title`, `status`, `detail`, then the members added
/// with [`Problem::with`], in that order.
pub struct Problem {
    status: StatusCode,
    body: Value,
}

impl Problem {
    /// `kind` is the whole type URI (`urn:fencegate:…`); `title` is the same for every
    /// problem of that type; `detail` says what happened to this request.
    pub fn new(status: StatusCode, kind: &str, title: &str, detail: impl Into<String>) -> Self {
        Problem {
            status,
            body: json!({
                "type": kind,
                "title": title,
                "status": status.as_u16(),
                "detail": detail.into(),
            }),
        }
    }

    #[cfg(test)]
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The type URI.
    #[cfg(test)]
    pub fn kind(&self) -> &str {
        self.body["type"].as_str().unwrap_or_default()
    }

    pub fn detail(&self) -> &str {
        self.body["detail"].as_str().unwrap_or_default()
    }

    /// Adds a member after the standard ones (`resource`, `token`, …).
    pub fn with(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.body[key] = value.into();
        self
    }

    pub fn response(self) -> Response<ProxyBody> {
        let mut response = Response::new(ProxyBody::local(self.body.to_string()));
        *response.status_mut() = self.status;
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        response
    }
}

/// `405` for a method that `path` (as documented, e.g. `/v1/leases/{resource}`) does not
/// accept: `Allow` lists the methods it does (RFC 9110 §15.5.6), and so does the detail.
pub fn method_not_allowed(method: &Method, path: &str, allowed: &[Method]) -> Response<ProxyBody> {
    let names: Vec<&str> = allowed.iter().map(Method::as_str).collect();
    let listed = match names.as_slice() {
        [] => String::new(),
        [only] => (*only).to_owned(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    };
    let mut response = Problem::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "urn:fencegate:method-not-allowed",
        "Method not allowed",
        format!("{path} accepts {listed}, not {method}"),
    )
    .response();
    let allow = HeaderValue::from_str(&names.join(", ")).expect("method names are header-safe");
    response.headers_mut().insert(ALLOW, allow);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_405_lists_the_allowed_methods_in_allow_and_detail() {
        let r = method_not_allowed(
            &Method::PUT,
            "/v1/leases/{resource}",
            &[Method::GET, Method::POST, Method::DELETE],
        );
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(r.headers()[ALLOW], "GET, POST, DELETE");
        assert_eq!(r.headers()[CONTENT_TYPE], "application/problem+json");
        let one = method_not_allowed(&Method::POST, "/v1/leases", &[Method::GET]);
        assert_eq!(one.headers()[ALLOW], "GET");
    }
}
