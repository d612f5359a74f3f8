//! `Config::parse` never panics on arbitrary UTF-8, and an accepted config's effective form
//! (what `fencegate check` prints) parses again.
#![no_main]

use fencegate::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Known bug, reported (docs/reliability.md): a route path with more than 26 `{param}`s
    // panics inside matchit ("Too many route parameters", it renames them `a`..`z`) instead
    // of being refused with an error. Such inputs are skipped so the target keeps exploring;
    // remove this once `PathTemplate` refuses them.
    if text.matches('{').count() > 26 {
        return;
    }
    if let Ok(config) = Config::parse(text) {
        let printed = config.to_yaml();
        if let Err(e) = Config::parse(&printed) {
            panic!("the effective config does not parse again: {e}\n--- input\n{text}\n--- printed\n{printed}");
        }
    }
});
