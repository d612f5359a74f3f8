//! The fencing token: its type, its grammar on the wire and header hygiene (docs/requests.md).

use std::fmt;

use http::header::{HeaderMap, HeaderName, HeaderValue, CONNECTION};

/// Largest token: tokens are signed 64-bit in every store we talk to.
pub const MAX_TOKEN: u64 = i64::MAX as u64;

/// A fencing token: an integer from 0 to 2^63 − 1 ([`MAX_TOKEN`]), the range every store
/// holds as a signed 64-bit integer, so a `Token` always fits the store it is written to.
///
/// Built by parsing a header ([`Token::parse`], [`token_from_headers`]), from a number that is
/// checked ([`Token::new`], `TryFrom<u64>`, `TryFrom<i64>`), or from a `u32`, which always fits.
///
/// ```
/// use fencegate::fence::Token;
///
/// let token = Token::parse(b"42").unwrap();
/// assert_eq!(token, Token::from(42u32));
/// assert_eq!(token.get(), 42);
/// assert!(Token::new(u64::MAX).is_none());
/// assert!(Token::try_from(-1i64).is_err());
/// ```
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(try_from = "u64", into = "u64")]
pub struct Token(u64);

impl Token {
    /// The lowest token, 0.
    pub const ZERO: Token = Token(0);
    /// The highest token, 2^63 − 1.
    pub const MAX: Token = Token(MAX_TOKEN);

    /// `value` as a token; `None` above [`MAX_TOKEN`].
    pub const fn new(value: u64) -> Option<Token> {
        if value <= MAX_TOKEN {
            Some(Token(value))
        } else {
            None
        }
    }

    /// The token's value.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The token as the signed 64-bit integer the stores keep; never negative.
    pub const fn to_i64(self) -> i64 {
        self.0 as i64
    }

    /// Parses the header grammar `0|[1-9][0-9]{0,18}` with a value of at most 2^63 − 1.
    pub fn parse(raw: &[u8]) -> Result<Token, TokenError> {
        parse_token(raw).map(Token)
    }

    /// The token after this one; `None` after [`Token::MAX`]: the token space is spent.
    pub const fn next(self) -> Option<Token> {
        Token::new(self.0 + 1)
    }

    /// The token `step` below this one; `None` below 0.
    pub const fn checked_sub(self, step: u64) -> Option<Token> {
        match self.0.checked_sub(step) {
            Some(value) => Some(Token(value)),
            None => None,
        }
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::str::FromStr for Token {
    type Err = TokenError;
    fn from_str(s: &str) -> Result<Token, TokenError> {
        Token::parse(s.as_bytes())
    }
}

/// Every `u32` is a token.
impl From<u32> for Token {
    fn from(value: u32) -> Token {
        Token(u64::from(value))
    }
}

impl From<Token> for u64 {
    fn from(token: Token) -> u64 {
        token.0
    }
}

impl From<Token> for i64 {
    fn from(token: Token) -> i64 {
        token.to_i64()
    }
}

/// `value` as a token, in tests (whose values are well inside the range).
#[cfg(test)]
pub(crate) fn tk(value: u64) -> Token {
    Token::new(value).expect("a test token is at most 2^63-1")
}

/// The token as a header value (its canonical decimal).
impl From<Token> for HeaderValue {
    fn from(token: Token) -> HeaderValue {
        HeaderValue::from(token.0)
    }
}

/// The token as a JSON number.
impl From<Token> for serde_json::Value {
    fn from(token: Token) -> serde_json::Value {
        serde_json::Value::from(token.0)
    }
}

/// A number outside the token range (a negative one, or one above [`MAX_TOKEN`]), as a store
/// or a lease backend might answer it: such an answer is corrupt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{0} is not a fencing token (0 to 9223372036854775807)")]
pub struct OutOfRange(pub i128);

impl TryFrom<u64> for Token {
    type Error = OutOfRange;
    fn try_from(value: u64) -> Result<Token, OutOfRange> {
        Token::new(value).ok_or(OutOfRange(i128::from(value)))
    }
}

impl TryFrom<i64> for Token {
    type Error = OutOfRange;
    fn try_from(value: i64) -> Result<Token, OutOfRange> {
        u64::try_from(value)
            .map(Token)
            .map_err(|_| OutOfRange(i128::from(value)))
    }
}

/// Why a token header was refused; each maps to 400 `invalid-token`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not `0|[1-9][0-9]{0,18}`: empty, a sign, spaces, leading zeros, anything but digits.
    #[error("the token must be a decimal integer from 0 to 9223372036854775807 without sign, spaces or leading zeros")]
    Grammar,
    /// Digits only, but a value above 2^63 − 1 ([`MAX_TOKEN`]).
    #[error("the token exceeds 9223372036854775807")]
    TooLarge,
    /// More than one token header line.
    #[error("more than one token header")]
    Duplicate,
    /// A header whose name is the token header's once `_` is read as `-` (`fencing_token`),
    /// spelled as sent.
    #[error("a header spelled `{0}` aliases the token header; use `-`, not `_`")]
    Alias(String),
    /// The `Connection` header names the token header.
    #[error("the Connection header names the token header, which would strip it in transit")]
    ConnectionNominated,
}

/// Parses `0|[1-9][0-9]{0,18}` with a value of at most 2^63-1, as a bare number
/// ([`Token::parse`] gives the [`Token`]).
pub fn parse_token(raw: &[u8]) -> Result<u64, TokenError> {
    match raw {
        [] => Err(TokenError::Grammar),
        [b'0'] => Ok(0),
        [b'0', ..] => Err(TokenError::Grammar),
        _ if raw.len() > 19 => {
            if raw.iter().all(u8::is_ascii_digit) {
                Err(TokenError::TooLarge)
            } else {
                Err(TokenError::Grammar)
            }
        }
        _ => {
            let mut value: u64 = 0;
            for &b in raw {
                if !b.is_ascii_digit() {
                    return Err(TokenError::Grammar);
                }
                // 19 digits fit in u64 (max 9_999_999_999_999_999_999 < 2^64).
                value = value * 10 + u64::from(b - b'0');
            }
            if value > MAX_TOKEN {
                Err(TokenError::TooLarge)
            } else {
                Ok(value)
            }
        }
    }
}

/// Extracts the token from a request's headers.
///
/// `Ok(None)` means no token header at all. Duplicates, `_`-aliases (which some servers fold
/// into the real name behind our back) and a `Connection` header naming the token are refused.
pub fn token_from_headers(
    headers: &HeaderMap,
    name: &HeaderName,
) -> Result<Option<Token>, TokenError> {
    // One walk over the header lines finds the token (and any second one), an alias, and a
    // `Connection` line naming the token: cheaper than a lookup by name, which hashes it.
    let mut first = None;
    let mut duplicate = false;
    let mut nominated = false;
    let mut alias = None;
    for (key, value) in headers {
        if key == name {
            duplicate |= first.is_some();
            first = first.or(Some(value));
        } else if key == CONNECTION {
            nominated |= names(value, name);
        } else if alias.is_none() && is_alias(key, name) {
            alias = Some(key);
        }
    }
    if duplicate {
        return Err(TokenError::Duplicate);
    }
    if nominated {
        return Err(TokenError::ConnectionNominated);
    }
    if let Some(alias) = alias {
        return Err(TokenError::Alias(alias.as_str().to_owned()));
    }
    first.map(|v| Token::parse(v.as_bytes())).transpose()
}

/// Whether a `Connection` header names `name`: a proxy strips such a header in transit.
pub fn connection_nominates(headers: &HeaderMap, name: &HeaderName) -> bool {
    headers
        .get_all(CONNECTION)
        .iter()
        .any(|value| names(value, name))
}

/// Whether one `Connection` line lists `name` among its options.
fn names(connection: &HeaderValue, name: &HeaderName) -> bool {
    connection
        .as_bytes()
        .split(|&b| b == b',')
        .map(<[u8]>::trim_ascii)
        .any(|option| option.eq_ignore_ascii_case(name.as_str().as_bytes()))
}

/// `fencing_token` for `fencing-token`: same name once `_` is read as `-`, but not equal.
/// One pass: the token header itself, the usual candidate of its length, is told apart in the
/// same walk that compares it.
pub(crate) fn is_alias(candidate: &HeaderName, name: &HeaderName) -> bool {
    let (c, n) = (candidate.as_str().as_bytes(), name.as_str().as_bytes());
    if c.len() != n.len() {
        return false;
    }
    let mut underscore = false;
    for (&a, &b) in c.iter().zip(n) {
        if a == b'_' && b == b'-' {
            underscore = true;
        } else if a != b {
            return false;
        }
    }
    underscore
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn grammar_accepts_canonical_integers() {
        assert_eq!(parse_token(b"0"), Ok(0));
        assert_eq!(parse_token(b"7"), Ok(7));
        assert_eq!(parse_token(b"1234567890"), Ok(1_234_567_890));
        assert_eq!(parse_token(b"9223372036854775807"), Ok(MAX_TOKEN));
    }

    #[test]
    fn grammar_refuses_every_other_form() {
        for bad in [
            &b""[..],
            b"+5",
            b"05",
            b" 5",
            b"5 ",
            b"-1",
            b"1e3",
            b"0x10",
            b"5.0",
            b"\t5",
            b"00",
            b"1_000",
            b"\xd9\xa3",
            b"a",
        ] {
            assert_eq!(parse_token(bad), Err(TokenError::Grammar), "{bad:?}");
        }
        assert_eq!(
            parse_token(b"9223372036854775808"),
            Err(TokenError::TooLarge)
        );
        assert_eq!(
            parse_token(b"18446744073709551616"),
            Err(TokenError::TooLarge)
        );
        assert_eq!(
            parse_token(b"99999999999999999999"),
            Err(TokenError::TooLarge)
        );
    }

    #[test]
    fn every_u63_roundtrips() {
        for v in [
            0,
            1,
            9,
            10,
            99,
            100,
            4_294_967_296,
            MAX_TOKEN - 1,
            MAX_TOKEN,
        ] {
            assert_eq!(parse_token(v.to_string().as_bytes()), Ok(v));
        }
    }

    fn name() -> HeaderName {
        HeaderName::from_static("fencing-token")
    }

    #[test]
    fn header_hygiene() {
        let mut h = HeaderMap::new();
        assert_eq!(token_from_headers(&h, &name()), Ok(None));
        h.insert("fencing-token", HeaderValue::from_static("12"));
        assert_eq!(
            token_from_headers(&h, &name()),
            Ok(Some(Token::from(12u32)))
        );

        let mut dup = h.clone();
        dup.append("fencing-token", HeaderValue::from_static("12"));
        assert_eq!(
            token_from_headers(&dup, &name()),
            Err(TokenError::Duplicate)
        );

        let mut alias = h.clone();
        alias.insert("fencing_token", HeaderValue::from_static("99"));
        assert_eq!(
            token_from_headers(&alias, &name()),
            Err(TokenError::Alias("fencing_token".into()))
        );

        // Same length, one letter off, no `_`: another header, not an alias.
        let mut other = h.clone();
        other.insert("fencing-tokem", HeaderValue::from_static("99"));
        assert_eq!(
            token_from_headers(&other, &name()),
            Ok(Some(Token::from(12u32)))
        );
        let mut mixed = h.clone();
        mixed.insert("fencing_tokem", HeaderValue::from_static("99"));
        assert_eq!(
            token_from_headers(&mixed, &name()),
            Ok(Some(Token::from(12u32)))
        );

        let mut conn = h.clone();
        conn.insert(
            "connection",
            HeaderValue::from_static("keep-alive, Fencing-Token"),
        );
        assert_eq!(
            token_from_headers(&conn, &name()),
            Err(TokenError::ConnectionNominated)
        );

        // Every line of a repeated header counts: a second Connection line, a third token.
        let mut second_line = h.clone();
        second_line.append("connection", HeaderValue::from_static("keep-alive"));
        second_line.append("connection", HeaderValue::from_static("fencing-token"));
        assert_eq!(
            token_from_headers(&second_line, &name()),
            Err(TokenError::ConnectionNominated)
        );
        let mut third = dup.clone();
        third.append("fencing-token", HeaderValue::from_static("12"));
        assert_eq!(
            token_from_headers(&third, &name()),
            Err(TokenError::Duplicate)
        );

        let mut harmless = h.clone();
        harmless.insert("connection", HeaderValue::from_static("keep-alive"));
        harmless.insert("x_other", HeaderValue::from_static("1"));
        assert_eq!(
            token_from_headers(&harmless, &name()),
            Ok(Some(Token::from(12u32)))
        );
    }
}
