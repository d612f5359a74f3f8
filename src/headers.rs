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

/// The position of a hop-by-hop header in [`HOP_BY_HOP`] (`name` in lower case, as header
/// names are kept). A string match: cheaper than comparing header names one by one.
fn hop_index(name: &str) -> Option<usize> {
    Some(match name {
        "connection" => 0,
        "proxy-connection" => 1,
        "keep-alive" => 2,
        "proxy-authenticate" => 3,
        "proxy-authorization" => 4,
        "te" => 5,
        "transfer-encoding" => 6,
        "upgrade" => 7,
        _ => return None,
    })
}

/// Whether `name` (lower case) is a hop-by-hop header, which never crosses a proxy.
pub fn is_hop_by_hop(name: &str) -> bool {
    hop_index(name).is_some()
}

/// Removes hop-by-hop headers, including every header the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the (few) header names notes which hop-by-hop ones are there; only those
    // are removed (a removal hashes and probes). Upstreams usually send `Connection:
    // keep-alive` and nothing else of the kind, so that is one removal. The names, not the
    // values: walking a map's names is a plain slice walk, its values a linked walk.
    let mut present = 0u8;
    for name in headers.keys() {
        if let Some(i) = hop_index(name.as_str()) {
            present |= 1 << i;
        }
    }
    if present == 0 {
        return;
    }
    if present & 1 != 0 {
        // `Connection` and, after it, the headers it nominates (besides `keep-alive`, which is
        // hop-by-hop anyway). One lookup finds its values and removes them.
        if let header::Entry::Occupied(connection) = headers.entry(header::CONNECTION) {
            let mut nominated: Vec<HeaderName> = Vec::new();
            for value in connection.iter() {
                // What upstreams send; it nominates nothing. Compared as is first: upstreams
                // write it in lower case, and that costs a fraction of a case-blind compare.
                let value = value.as_bytes();
                if value == b"keep-alive" || value.eq_ignore_ascii_case(b"keep-alive") {
                    continue;
                }
                for token in value.split(|&b| b == b',') {
                    let token = token.trim_ascii();
                    if token.is_empty() || token.eq_ignore_ascii_case(b"keep-alive") {
                        continue;
                    }
                    // A token that is no header name names no header here.
                    if let Ok(name) = HeaderName::from_bytes(token) {
                        nominated.push(name);
                    }
                }
            }
            connection.remove();
            for name in nominated {
                headers.remove(name);
            }
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate().skip(1) {
        if present & (1 << i) != 0 {
            headers.remove(name);
        }
    }
}

/// The `X-Forwarded-For` entry for a client address (made once per client connection).
pub fn peer_value(peer: IpAddr) -> HeaderValue {
    HeaderValue::from_maybe_shared(bytes::Bytes::from(peer.to_string()))
        .expect("an IP address is a valid header value")
}

/// Prepares request headers for the upstream: hop-by-hop gone, `Host` set to `upstream_host`
/// (or left for the client to set from the request URI when `None`), the client's address
/// (`peer`, from [`peer_value`]), scheme and original host recorded. Each header costs one
/// map operation: the old `Host` comes back from the insert that replaces it.
pub fn request_headers(
    headers: &mut HeaderMap,
    peer: HeaderValue,
    https: bool,
    authority: Option<&str>,
    upstream_host: Option<HeaderValue>,
) {
    strip_hop_by_hop(headers);
    let client_host = match upstream_host {
        Some(upstream) => headers.insert(header::HOST, upstream),
        None => headers.remove(header::HOST),
    };
    // The request target's authority (absolute-form, HTTP/2 `:authority`) wins over `Host`
    // (RFC 9112 §3.2.2).
    let host = match authority.and_then(|a| HeaderValue::from_str(a).ok()) {
        Some(authority) => Some(authority),
        None => client_host,
    };
    match headers.entry(&X_FORWARDED_FOR) {
        header::Entry::Vacant(entry) => {
            entry.insert(peer);
        }
        header::Entry::Occupied(mut entry) => {
            if let Ok(chain) = entry.get().to_str() {
                let joined = format!("{chain}, {}", peer.to_str().unwrap_or_default());
                // From the String's own buffer: one allocation, not two.
                if let Ok(value) = HeaderValue::from_maybe_shared(bytes::Bytes::from(joined)) {
                    // Several X-Forwarded-For lines would be joined by the upstream anyway;
                    // keep one.
                    entry.insert(value);
                }
            }
        }
    }
    headers.insert(
        &X_FORWARDED_PROTO,
        HeaderValue::from_static(if https { "https" } else { "http" }),
    );
    match host {
        Some(host) => headers.insert(&X_FORWARDED_HOST, host),
        None => headers.remove(&X_FORWARDED_HOST),
    };
}

/// Whether a request is a gRPC call: `content-type: application/grpc`, alone or with a
/// `+format` or parameters (`application/grpc+proto`), in any case (media types are
/// case-insensitive, RFC 9110 §8.3.1, and gRPC servers compare them so). gRPC-Web
/// (`application/grpc-web`), which carries its status in the body, is not. Asked of a
/// response's headers too, to tell a gRPC answer (see [`crate::idempotency::recording`]).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return false;
    };
    let Some((prefix, rest)) = value.as_bytes().split_at_checked(GRPC.len()) else {
        return false;
    };
    prefix.eq_ignore_ascii_case(GRPC) && matches!(rest.first(), None | Some(b'+' | b';'))
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
    fn the_string_match_names_every_hop_by_hop_header_at_its_place() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_index(name.as_str()), Some(i), "{name}");
        }
        assert_eq!(hop_index("content-length"), None);
    }

    #[test]
    fn strips_every_line_of_a_nominated_header_and_keeps_the_rest() {
        let mut h = HeaderMap::new();
        h.append("connection", HeaderValue::from_static("keep-alive"));
        h.append("connection", HeaderValue::from_static(" X-Hop ,Close"));
        h.append("x-hop", HeaderValue::from_static("1"));
        h.append("x-hop", HeaderValue::from_static("2"));
        h.insert("close", HeaderValue::from_static("c"));
        h.insert("content-length", HeaderValue::from_static("3"));
        h.insert("proxy-connection", HeaderValue::from_static("keep-alive"));
        strip_hop_by_hop(&mut h);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["content-length"]);

        let mut untouched = HeaderMap::new();
        untouched.insert("content-type", HeaderValue::from_static("text/plain"));
        strip_hop_by_hop(&mut untouched);
        assert_eq!(untouched.len(), 1);
    }

    /// `request_headers` for a plain-HTTP request from 127.0.0.9 in origin form.
    fn forward_plain(h: &mut HeaderMap, upstream_host: Option<HeaderValue>) {
        request_headers(
            h,
            peer_value("127.0.0.9".parse().unwrap()),
            false,
            None,
            upstream_host,
        );
    }

    /// A forwarding header the client sent is replaced (or joined, for X-Forwarded-For), also
    /// when its `Connection` header named it and it went with the hop-by-hop ones.
    #[test]
    fn forwarded_headers_the_client_sent_or_nominated() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("ledger.example"));
        h.insert(
            "connection",
            HeaderValue::from_static("x-forwarded-for, X-Forwarded-Host"),
        );
        h.insert("x-forwarded-for", HeaderValue::from_static("10.6.6.6"));
        h.insert(
            "x-forwarded-host",
            HeaderValue::from_static("spoofed.example"),
        );
        h.append("x-forwarded-proto", HeaderValue::from_static("https"));
        h.append("x-forwarded-proto", HeaderValue::from_static("ftp"));
        forward_plain(&mut h, None);
        assert_eq!(h["x-forwarded-for"], "127.0.0.9");
        assert_eq!(h.get_all("x-forwarded-for").iter().count(), 1);
        assert_eq!(h["x-forwarded-host"], "ledger.example");
        assert_eq!(h.get_all("x-forwarded-host").iter().count(), 1);
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h.get_all("x-forwarded-proto").iter().count(), 1);
        assert!(h.get("connection").is_none());
    }

    #[test]
    fn forwarded_headers() {
        let mut h = HeaderMap::new();
        h.insert("host", HeaderValue::from_static("ledger.example"));
        h.insert("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        forward_plain(&mut h, None);
        assert!(h.get("host").is_none());
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 127.0.0.9");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "ledger.example");

        let mut h2 = HeaderMap::new();
        request_headers(
            &mut h2,
            peer_value("::1".parse().unwrap()),
            true,
            Some("api.example:7440"),
            None,
        );
        assert_eq!(h2["x-forwarded-for"], "::1");
        assert_eq!(h2["x-forwarded-proto"], "https");
        assert_eq!(h2["x-forwarded-host"], "api.example:7440");

        // The upstream's Host replaces the client's, which is recorded; several
        // X-Forwarded-For lines become one.
        let mut h3 = HeaderMap::new();
        h3.insert("host", HeaderValue::from_static("ledger.example"));
        h3.append("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        h3.append("x-forwarded-for", HeaderValue::from_static("10.0.0.2"));
        forward_plain(&mut h3, Some(HeaderValue::from_static("127.0.0.1:8080")));
        assert_eq!(h3["host"], "127.0.0.1:8080");
        assert_eq!(h3.get_all("x-forwarded-proto").iter().count(), 1);
        assert_eq!(h3.get_all("host").iter().count(), 1);
        assert_eq!(h3.get_all("x-forwarded-for").iter().count(), 1);
        assert_eq!(h3["x-forwarded-for"], "10.0.0.1, 127.0.0.9");
        assert_eq!(h3["x-forwarded-host"], "ledger.example");
    }
}
