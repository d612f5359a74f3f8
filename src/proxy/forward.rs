//! Header surgery for forwarding: hop-by-hop headers (RFC 9110 §7.6.1) and `X-Forwarded-*`.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Connection-specific headers that must not cross a proxy, prebuilt once.
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Removes hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the (few) headers finds nothing to strip in the common case, cheaper than
    // eight removals that each hash and probe.
    if !headers.keys().any(|k| HOP_BY_HOP.contains(k)) {
        return;
    }
    if headers.contains_key(header::CONNECTION) {
        let nominated: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .filter_map(|name| HeaderName::from_bytes(name.trim_ascii()).ok())
            .collect();
        for name in nominated {
            headers.remove(name);
        }
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Prepares request headers for the upstream: hop-by-hop gone, `Host` left to the client
/// (set from the upstream address), the client's address and scheme recorded.
pub fn request_headers(
    headers: &mut HeaderMap,
    peer: IpAddr,
    https: bool,
    authority: Option<&str>,
) {
    strip_hop_by_hop(headers);
    // The request target's authority (absolute-form, HTTP/2 `:authority`) wins over `Host`
    // (RFC 9112 §3.2.2).
    let host = match authority.and_then(|a| HeaderValue::from_str(a).ok()) {
        Some(authority) => {
            headers.remove(header::HOST);
            Some(authority)
        }
        None => headers.remove(header::HOST),
    };
    let forwarded_for = match headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
        Some(chain) => format!("{chain}, {peer}"),
        None => peer.to_string(),
    };
    // From the String's own buffer: one allocation, not two.
    if let Ok(value) = HeaderValue::from_maybe_shared(bytes::Bytes::from(forwarded_for)) {
        // Several X-Forwarded-For lines would be joined by the upstream anyway; keep one.
        headers.insert(X_FORWARDED_FOR.clone(), value);
    }
    headers.insert(
        X_FORWARDED_PROTO.clone(),
        HeaderValue::from_static(if https { "https" } else { "http" }),
    );
    match host {
        Some(host) => headers.insert(X_FORWARDED_HOST.clone(), host),
        None => headers.remove(&X_FORWARDED_HOST),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_hop_by_hop_and_nominated() {
        let mut h = HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, X-Secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        h.insert("fencing-token", HeaderValue::from_static("7"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert_eq!(h["fencing-token"], "7");
    }

    #[test]
    fn forwarded_headers() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("ledger.example"));
        h.insert("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        request_headers(&mut h, "127.0.0.9".parse().unwrap(), false, None);
        assert!(h.get("host").is_none());
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 127.0.0.9");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "ledger.example");

        let mut h2 = HeaderMap::new();
        request_headers(
            &mut h2,
            "::1".parse().unwrap(),
            true,
            Some("api.example:7440"),
        );
        assert_eq!(h2["x-forwarded-for"], "::1");
        assert_eq!(h2["x-forwarded-proto"], "https");
        assert_eq!(h2["x-forwarded-host"], "api.example:7440");
    }
}
