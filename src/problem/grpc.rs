//! gRPC requests answered the gRPC way (docs/grpc.md). A gRPC client cannot read a 409
//! problem+json: it sees a transport error. A refusal of a gRPC request is instead a
//! *trailers-only* response (HTTP 200, `content-type: application/grpc`, `grpc-status`,
//! `grpc-message` percent-encoded as the gRPC HTTP/2 protocol says), with the same detail
//! headers the problem+json refusal carries (`fencing-token-current`, `retry-after`).
//!
//! A refusal is made once, as problem+json ([`super::refusal::Refusal::response`]), which notes its gRPC
//! status in the response's extensions ([`mark`]); [`Answered`] turns it into the gRPC form when
//! the request was a gRPC call. Upstream responses pass untouched, trailers included: the fence
//! decides on the request's headers, so streaming calls are never held up by it.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::header::{HeaderMap, HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, TE};
use http::{Response, StatusCode, Version};
use percent_encoding::{AsciiSet, CONTROLS};

use crate::body::ProxyBody;

/// gRPC status codes fencegate answers with (grpc/doc/statuscodes.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Code {
    /// 3: the request is wrong whatever the system's state (a malformed or missing token, a
    /// resource that cannot be told).
    InvalidArgument = 3,
    /// 4: the upstream did not answer in time.
    DeadlineExceeded = 4,
    /// 8: a message larger than fencegate reads whole.
    ResourceExhausted = 8,
    /// 9: the request is well formed but the system is not in a state to run it (a reused
    /// idempotency key, no lease held): retrying as is will not help.
    FailedPrecondition = 9,
    /// 10: "a sequencer check failure": a stale or unissued fencing token, or a concurrent
    /// attempt with the same idempotency key.
    Aborted = 10,
    /// 12: no route for this method (`unmatched: reject`).
    Unimplemented = 12,
    /// 14: fencegate, its store or the upstream could not be asked: retry later.
    Unavailable = 14,
}

impl Code {
    /// For `grpc-status`.
    pub fn as_u8(self) -> u8 {
        self as u8
    }
}

/// What a refusal's response carries for its gRPC form, in the response's extensions.
#[derive(Debug, Clone)]
struct Status {
    code: Code,
    message: String,
}

/// Notes a refusal's gRPC status (`code`, and `detail`, its message) on its problem+json
/// response.
pub fn mark(response: &mut Response<ProxyBody>, code: Code, detail: String) {
    response.extensions_mut().insert(Status {
        code,
        message: detail,
    });
}

use crate::headers::is_grpc;

/// Whether a request is a gRPC call over HTTP/2, the only transport gRPC has: its refusals
/// are answered in gRPC form, and it goes upstream over HTTP/2 (gRPC servers speak nothing
/// else, and the status travels in trailers). HTTP/1 requests, the usual case, are never
/// asked for their content type.
pub fn is_call(version: Version, headers: &HeaderMap) -> bool {
    version == Version::HTTP_2 && is_grpc(headers)
}

/// A gRPC call's headers on their way upstream: `TE: trailers` again (hop-by-hop, so
/// stripped with the others), which the gRPC protocol requires and some servers check.
pub fn upstream_headers(headers: &mut HeaderMap) {
    headers.insert(TE, HeaderValue::from_static("trailers"));
}

/// Bytes `grpc-message` percent-encodes: everything outside space and visible ASCII, and `%`
/// itself (gRPC over HTTP/2, "Responses").
const GRPC_MESSAGE: &AsciiSet = &CONTROLS.add(b'%');

/// `message`, percent-encoded for `grpc-message`.
pub fn encode_message(message: &str) -> HeaderValue {
    let encoded = percent_encoding::utf8_percent_encode(message, GRPC_MESSAGE).to_string();
    HeaderValue::try_from(encoded).expect("percent-encoded text is a valid header value")
}

static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
static GRPC_MESSAGE_HEADER: HeaderName = HeaderName::from_static("grpc-message");

/// A refusal's response in its gRPC form: trailers-only, with the refusal's own headers
/// (`fencing-token-current`, `retry-after`). Any other response (the upstream's) is returned
/// as is.
pub fn answer(response: Response<ProxyBody>) -> Response<ProxyBody> {
    let Some(status) = response.extensions().get::<Status>().cloned() else {
        return response;
    };
    let (mut parts, _problem) = response.into_parts();
    parts.status = StatusCode::OK;
    parts.headers.remove(CONTENT_LENGTH);
    parts
        .headers
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    parts.headers.insert(
        &GRPC_STATUS,
        HeaderValue::from(u16::from(status.code.as_u8())),
    );
    parts
        .headers
        .insert(&GRPC_MESSAGE_HEADER, encode_message(&status.message));
    Response::from_parts(parts, ProxyBody::empty())
}

pin_project_lite::pin_project! {
    /// A request's handling, its refusals answered in gRPC form when the request was a gRPC
    /// call (see [`answer`]).
    pub struct Answered<H> {
        #[pin]
        handling: H,
        grpc: bool,
    }
}

impl<H> Answered<H> {
    /// `grpc`: whether the request was a gRPC call ([`is_call`]).
    pub fn new(handling: H, grpc: bool) -> Self {
        Answered { handling, grpc }
    }
}

impl<H> Future for Answered<H>
where
    H: Future<Output = Result<Response<ProxyBody>, Infallible>>,
{
    type Output = Result<Response<ProxyBody>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let grpc = *this.grpc;
        this.handling
            .poll(cx)
            .map(|answered| answered.map(|r| if grpc { answer(r) } else { r }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fence::token::TokenError;
    use crate::problem::refusal::{Refusal, Subject, Unavailable};
    use crate::store::StoreError;

    fn headers(content_type: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(CONTENT_TYPE, HeaderValue::from_str(content_type).unwrap());
        h
    }

    #[test]
    fn grpc_calls_are_told_by_their_content_type() {
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc;charset=utf-8",
            // Media types are case-insensitive (RFC 9110 §8.3.1), and gRPC servers agree.
            "Application/GRPC",
            "APPLICATION/Grpc+proto",
            "application/gRPC;charset=utf-8",
        ] {
            assert!(is_grpc(&headers(yes)), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/json",
            "application/grpcx",
            "Application/GRPC-Web",
            "application/grp",
        ] {
            assert!(!is_grpc(&headers(no)), "{no}");
        }
        assert!(!is_grpc(&HeaderMap::new()));
        assert!(is_call(Version::HTTP_2, &headers("application/grpc")));
        assert!(!is_call(Version::HTTP_11, &headers("application/grpc")));
    }

    #[test]
    fn messages_are_percent_encoded_as_grpc_says() {
        assert_eq!(encode_message("token 3 is below 5"), "token 3 is below 5");
        assert_eq!(encode_message("100% sure"), "100%25 sure");
        assert_eq!(encode_message("a\nb\tc"), "a%0Ab%09c");
        assert_eq!(encode_message("§3.2 `x`"), "%C2%A73.2 `x`");
    }

    #[test]
    fn a_stale_refusal_becomes_trailers_only_aborted_with_its_headers() {
        let subject = Subject {
            route: Some("accounts"),
            resource: Some("account:1"),
            token: Some(3.into()),
        };
        let token_header = HeaderName::from_static("fencing-token");
        let problem = Refusal::Stale { current: 5.into() }.response(&subject, &token_header);
        let r = answer(problem);
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()[CONTENT_TYPE], "application/grpc");
        assert_eq!(r.headers()["grpc-status"], "10");
        assert_eq!(
            r.headers()["grpc-message"],
            "token 3 is below 5, the highest token recorded for account:1; the write was not forwarded"
        );
        assert_eq!(r.headers()["fencing-token-current"], "5");
        assert!(http_body::Body::is_end_stream(r.body()));
    }

    #[test]
    fn each_refusal_has_its_code() {
        let cases = [
            (Refusal::Unissued { latest: None }, 10),
            (Refusal::InvalidToken(TokenError::Grammar), 3),
            (Refusal::TokenRequired, 3),
            (Refusal::IdempotencyKeyReused, 9),
            (Refusal::LeaseNotHeld, 9),
            (
                Refusal::StoreUnavailable(Unavailable::Store(StoreError::unreachable("down"))),
                14,
            ),
            (Refusal::BarrierTimeout, 14),
            (Refusal::UpstreamError("reset".into()), 14),
            (
                Refusal::UpstreamTimeout(std::time::Duration::from_secs(1)),
                4,
            ),
            (Refusal::RequestTooLarge { limit: 1 }, 8),
            (Refusal::NoRoute, 12),
        ];
        for (refusal, want) in cases {
            assert_eq!(refusal.kind().grpc.as_u8(), want, "{refusal:?}");
        }
    }

    #[test]
    fn other_responses_pass_untouched() {
        let mut upstream = Response::new(ProxyBody::empty());
        *upstream.status_mut() = StatusCode::CONFLICT;
        let r = answer(upstream);
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert!(r.headers().get("grpc-status").is_none());
    }
}
