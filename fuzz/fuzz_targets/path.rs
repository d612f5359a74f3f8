//! `normalise` never panics; its output is a fixed point, starts with `/`, and holds no `//`,
//! no dot segment, no encoded `/` or `\`, no control byte (SPEC §4).
#![no_main]

use fencegate::fence::path::normalise;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(path) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(out) = normalise(path) else {
        return;
    };
    let out = out.into_owned();
    assert!(out.starts_with('/'), "{path:?} -> {out:?}");
    assert_eq!(
        normalise(&out).map(|o| o.into_owned()),
        Ok(out.clone()),
        "not idempotent: {path:?} -> {out:?}"
    );
    for bad in ["//", "/./", "/../"] {
        assert!(!out.contains(bad), "{path:?} -> {out:?} contains {bad}");
    }
    assert!(
        !out.ends_with("/.") && !out.ends_with("/.."),
        "{path:?} -> {out:?}"
    );
    let upper = out.to_ascii_uppercase();
    assert!(
        !upper.contains("%2F") && !upper.contains("%5C"),
        "{path:?} -> {out:?}"
    );
    assert!(
        !out.bytes()
            .any(|b| b < 0x20 || b == 0x7f || b == b'\\' || b >= 0x80),
        "{path:?} -> {out:?}"
    );
});
