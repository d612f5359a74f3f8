//! `parse_token` and `token_from_headers` never panic, accept exactly the canonical decimal
//! form of 0..=2^63-1, and refuse every header arrangement SPEC §4 refuses.
#![no_main]

use fencegate::fence::token::{parse_token, token_from_headers, TokenError, MAX_TOKEN};
use http::header::{HeaderMap, HeaderName, HeaderValue, CONNECTION};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The grammar: accepted means canonical, in range, and printed back identically.
    match parse_token(data) {
        Ok(v) => {
            assert!(v <= MAX_TOKEN);
            assert_eq!(
                v.to_string().as_bytes(),
                data,
                "non-canonical form accepted"
            );
        }
        Err(TokenError::TooLarge) => {
            assert!(data.iter().all(u8::is_ascii_digit) && data[0] != b'0');
        }
        Err(TokenError::Grammar) => {
            let canonical = !data.is_empty()
                && data.iter().all(u8::is_ascii_digit)
                && (data == b"0" || data[0] != b'0')
                && data.len() <= 19;
            assert!(!canonical, "canonical {data:?} refused");
        }
        Err(other) => panic!("parse_token returned a header error: {other:?}"),
    }

    // Headers: each input line `name: value` becomes a header when http accepts it.
    let name = HeaderName::from_static("fencing-token");
    let mut headers = HeaderMap::new();
    for line in data.split(|&b| b == b'\n') {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
        ) else {
            continue;
        };
        headers.append(k, v);
    }
    let tokens: Vec<&HeaderValue> = headers.get_all(&name).iter().collect();
    let aliased = headers.keys().any(|k| {
        k != name
            && k.as_str().len() == name.as_str().len()
            && k.as_str().replace('_', "-") == name.as_str()
    });
    let nominated = headers.get_all(CONNECTION).iter().any(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .any(|o| o.trim_ascii().eq_ignore_ascii_case(b"fencing-token"))
    });
    match token_from_headers(&headers, &name) {
        Ok(Some(v)) => {
            assert_eq!(tokens.len(), 1);
            assert!(!aliased && !nominated);
            assert_eq!(parse_token(tokens[0].as_bytes()), Ok(v.get()));
        }
        Ok(None) => assert!(tokens.is_empty() && !aliased && !nominated),
        Err(TokenError::Duplicate) => assert!(tokens.len() > 1),
        Err(TokenError::ConnectionNominated) => assert!(nominated),
        Err(TokenError::Alias(_)) => assert!(aliased),
        Err(TokenError::Grammar | TokenError::TooLarge) => {
            assert_eq!(tokens.len(), 1);
            assert!(parse_token(tokens[0].as_bytes()).is_err());
        }
    }
});
