//! Path normalisation (docs/requests.md): the resource id and the forwarded path come from one form.
//!
//! Dot segments are resolved (RFC 3986 §5.2.4), `//` is merged, percent-encoded unreserved
//! characters are decoded, the remaining escapes are upper-cased and raw non-ASCII bytes are
//! escaped. What would let two
//! spellings name different resources downstream is refused: encoded `/` or `\`, a raw `\`,
//! NUL and other control bytes, malformed escapes.

use std::borrow::Cow;

/// Why [`normalise`] refused a path (400 `invalid-path`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// The path does not start with `/` (`OPTIONS *`, say).
    #[error("the path must start with `/`")]
    NotOrigin,
    /// An encoded `/` or `\` (`%2F`, `%5C`).
    #[error("the path contains an encoded `/` or `\\`, which servers disagree on")]
    EncodedSeparator,
    /// A raw `\`.
    #[error("the path contains a `\\`, which some servers read as `/`")]
    Backslash,
    /// A raw `;` (`%3B` is allowed).
    #[error("the path contains a `;` path parameter, which some servers strip before routing")]
    PathParameter,
    /// A control byte (NUL included), raw or percent-encoded.
    #[error("the path contains a control character")]
    Control,
    /// A `%` not followed by two hex digits (`%zz`, `%4`).
    #[error("the path contains a malformed percent escape")]
    BadEscape,
}

/// Bytes that [`normalise`] passes over as they are: everything but `/` (which may start a
/// `//` or a dot segment), `\\`, `;`, `%`, control bytes and non-ASCII.
const PLAIN: [bool; 256] = {
    let mut plain = [false; 256];
    let mut b = 0x20;
    while b < 0x7f {
        plain[b] = !matches!(b as u8, b'/' | b'\\' | b';' | b'%');
        b += 1;
    }
    plain
};

/// Returns the normalised path, borrowing when the input is already normal.
pub fn normalise(path: &str) -> Result<Cow<'_, str>, PathError> {
    let bytes = path.as_bytes();
    if bytes.first() != Some(&b'/') {
        return Err(PathError::NotOrigin);
    }
    let mut needs_work = false;
    for (i, &b) in bytes.iter().enumerate() {
        // Most bytes of most paths are plain: one table load decides them.
        if PLAIN[usize::from(b)] {
            continue;
        }
        match b {
            b'\\' => return Err(PathError::Backslash),
            b';' => return Err(PathError::PathParameter),
            0..=0x1f | 0x7f => return Err(PathError::Control),
            b'%' | 0x80.. => needs_work = true,
            b'/' if matches!(bytes.get(i + 1), Some(b'/' | b'.')) => needs_work = true,
            _ => {}
        }
    }
    if !needs_work {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode_unreserved(bytes)?;
    Ok(Cow::Owned(remove_dot_segments(&decoded)))
}

/// Decodes `%XX` of unreserved characters, upper-cases the hex of the others.
fn decode_unreserved(bytes: &[u8]) -> Result<String, PathError> {
    let mut out = String::with_capacity(bytes.len());
    let mut i = 0;
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let escape = |out: &mut String, v: u8| {
        out.push('%');
        out.push(char::from(HEX[usize::from(v >> 4)]));
        out.push(char::from(HEX[usize::from(v & 0xf)]));
    };
    while i < bytes.len() {
        let b = bytes[i];
        if b >= 0x80 {
            // Raw UTF-8 is not allowed in a URI; its escaped form is the one spelling.
            escape(&mut out, b);
            i += 1;
            continue;
        }
        if b != b'%' {
            out.push(char::from(b));
            i += 1;
            continue;
        }
        let (hi, lo) = match (bytes.get(i + 1), bytes.get(i + 2)) {
            (Some(&h), Some(&l)) => (hex(h)?, hex(l)?),
            _ => return Err(PathError::BadEscape),
        };
        let value = hi << 4 | lo;
        match value {
            b'/' | b'\\' => return Err(PathError::EncodedSeparator),
            0..=0x1f | 0x7f => return Err(PathError::Control),
            v if v.is_ascii_alphanumeric() || matches!(v, b'-' | b'.' | b'_' | b'~') => {
                out.push(char::from(v));
            }
            v => escape(&mut out, v),
        }
        i += 3;
    }
    Ok(out)
}

fn hex(b: u8) -> Result<u8, PathError> {
    match b {
        b'0'..=b'9' => Ok(b - b'0'),
        b'a'..=b'f' => Ok(b - b'a' + 10),
        b'A'..=b'F' => Ok(b - b'A' + 10),
        _ => Err(PathError::BadEscape),
    }
}

/// Resolves `.` and `..`, merges empty segments, keeps a trailing slash.
fn remove_dot_segments(path: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    let mut trailing_slash = false;
    let segments: Vec<&str> = path[1..].split('/').collect();
    let last = segments.len() - 1;
    for (i, segment) in segments.into_iter().enumerate() {
        match segment {
            "" | "." => trailing_slash = i == last,
            ".." => {
                out.pop();
                trailing_slash = i == last;
            }
            s => {
                out.push(s);
                trailing_slash = false;
            }
        }
    }
    let mut result = String::with_capacity(path.len());
    for segment in &out {
        result.push('/');
        result.push_str(segment);
    }
    if result.is_empty() || trailing_slash {
        result.push('/');
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast path's table passes over exactly the bytes that need no look: every other
    /// ASCII byte is refused or sends the path to the slow path (or, for `/`, is looked at).
    #[test]
    fn plain_bytes_are_exactly_those_left_as_they_are() {
        for b in 0u8..0x80 {
            let path = format!("/a{}a", char::from(b));
            let result = normalise(&path);
            let kept = matches!(result, Ok(Cow::Borrowed(_)));
            if PLAIN[usize::from(b)] {
                assert!(kept, "{b:#x}: {result:?}");
            } else if b != b'/' {
                assert!(!kept, "{b:#x} passed unlooked");
            }
        }
        assert!((0x80..=0xff).all(|b| !PLAIN[b]));
    }

    fn norm(p: &str) -> Result<String, PathError> {
        normalise(p).map(Cow::into_owned)
    }

    #[test]
    fn normal_paths_are_borrowed() {
        assert!(matches!(normalise("/accounts/42"), Ok(Cow::Borrowed(_))));
        assert!(matches!(normalise("/a.b/c-d_e~f"), Ok(Cow::Borrowed(_))));
    }

    #[test]
    fn resolves_dots_and_merges_slashes() {
        assert_eq!(norm("/a/./b").unwrap(), "/a/b");
        assert_eq!(norm("//a").unwrap(), "/a");
        assert_eq!(norm("/a//b///c").unwrap(), "/a/b/c");
        assert_eq!(norm("/a/b/../c").unwrap(), "/a/c");
        assert_eq!(norm("/../../a").unwrap(), "/a");
        assert_eq!(norm("/a/..").unwrap(), "/");
        assert_eq!(norm("/a/b/.").unwrap(), "/a/b/");
        assert_eq!(norm("/a/").unwrap(), "/a/");
        assert_eq!(norm("/a//").unwrap(), "/a/");
        assert_eq!(norm("/").unwrap(), "/");
        assert_eq!(norm("//").unwrap(), "/");
        assert_eq!(norm("/a/.b/..c").unwrap(), "/a/.b/..c");
    }

    #[test]
    fn decodes_unreserved_only() {
        assert_eq!(norm("/%61ccounts/%34%32").unwrap(), "/accounts/42");
        assert_eq!(norm("/a/%2e%2E/b").unwrap(), "/b");
        assert_eq!(norm("/a%20b").unwrap(), "/a%20b");
        assert_eq!(norm("/a%3ab").unwrap(), "/a%3Ab");
        assert_eq!(norm("/%7e%2D%5f").unwrap(), "/~-_");
        // Raw UTF-8 and its escaped spelling are one path.
        assert_eq!(norm("/accounts/\u{e9}").unwrap(), "/accounts/%C3%A9");
        assert_eq!(norm("/x//\u{e9}").unwrap(), "/x/%C3%A9");
        assert_eq!(norm("/accounts/%c3%a9").unwrap(), "/accounts/%C3%A9");
    }

    #[test]
    fn refuses_ambiguous_paths() {
        assert_eq!(norm("/a%2Fb"), Err(PathError::EncodedSeparator));
        assert_eq!(norm("/a%2fb"), Err(PathError::EncodedSeparator));
        assert_eq!(norm("/a%5Cb"), Err(PathError::EncodedSeparator));
        assert_eq!(norm("/a\\b"), Err(PathError::Backslash));
        assert_eq!(norm("/a%00"), Err(PathError::Control));
        assert_eq!(norm("/a%0a"), Err(PathError::Control));
        assert_eq!(norm("/a\x01"), Err(PathError::Control));
        assert_eq!(norm("/a%"), Err(PathError::BadEscape));
        assert_eq!(norm("/a%4"), Err(PathError::BadEscape));
        assert_eq!(norm("/a%zz"), Err(PathError::BadEscape));
        assert_eq!(norm("/accounts/1;v=2"), Err(PathError::PathParameter));
        assert_eq!(norm("/a%3Bb").unwrap(), "/a%3Bb");
        assert_eq!(norm("a/b"), Err(PathError::NotOrigin));
        assert_eq!(norm("*"), Err(PathError::NotOrigin));
        assert_eq!(norm(""), Err(PathError::NotOrigin));
    }

    #[test]
    fn normalising_twice_changes_nothing() {
        for p in ["/a/./b", "//a", "/%61/%2e%2e/c", "/x%20y//z/../", "/a/b/."] {
            let once = norm(p).unwrap();
            assert_eq!(norm(&once).unwrap(), once, "{p}");
        }
    }
}
