//! Durations as the configuration, the lease API and the command line write them.
//!
//! Accepted: a number and a unit, or several in a row: `30s`, `30 s`, `1500ms`, `1.5s`,
//! `2m30s`, `1h`; units `ns`, `us`, `ms`, `s`, `m`, `h`, `d` and their long forms ([`unit`]).
//! A bare number has no unit and is refused with a message that says what to write. Printed
//! back in one unit, the largest that holds the value exactly (`1500ms`, `30s`, `5m`, `1h`), so
//! what `check` prints loads again and reads as the docs write it.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Visitor};
use serde::{Deserializer, Serializer};

/// What to write instead, appended to every refusal.
const HINT: &str = "write 30s, 1500ms, 1m";

/// Parses a duration; the error is a sentence for a person (`` `30` is not a duration: … ``).
pub fn parse(s: &str) -> Result<Duration, String> {
    let trimmed = s.trim();
    if trimmed.is_empty() {
        return Err(format!("an empty value is not a duration: {HINT}"));
    }
    read(trimmed).ok_or_else(|| format!("`{s}` is not a duration: {HINT}"))
}

/// `s` as spans of a number (digits, and a fraction after a `.`) and a unit, optionally
/// separated by whitespace; `0` alone is zero. `None`: not that, or a fraction finer than a
/// nanosecond, or more than a [`Duration`] holds.
fn read(s: &str) -> Option<Duration> {
    if s == "0" {
        return Some(Duration::ZERO);
    }
    let digits = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let mut nanos: u128 = 0;
    let mut rest = s;
    loop {
        let n = digits(rest);
        if n == 0 {
            return None;
        }
        let (whole, after) = rest.split_at(n);
        let (fraction, after) = match after.strip_prefix('.') {
            Some(after) => {
                let n = digits(after);
                if n == 0 {
                    return None;
                }
                let (fraction, after) = after.split_at(n);
                (Some(fraction), after)
            }
            None => (None, after),
        };
        let after = after.trim_start();
        let n = after
            .find(|c: char| !c.is_ascii_alphabetic() && c != 'µ')
            .unwrap_or(after.len());
        let (name, after) = after.split_at(n);
        let per = unit(name)?;
        let mut span = whole.parse::<u128>().ok()?.checked_mul(per)?;
        if let Some(fraction) = fraction {
            let parts = fraction.parse::<u128>().ok()?.checked_mul(per)?;
            let denominator = 10u128.checked_pow(u32::try_from(fraction.len()).ok()?)?;
            if parts % denominator != 0 {
                return None;
            }
            span = span.checked_add(parts / denominator)?;
        }
        nanos = nanos.checked_add(span)?;
        rest = after.trim_start();
        if rest.is_empty() {
            break;
        }
    }
    let secs = u64::try_from(nanos / 1_000_000_000).ok()?;
    let subsec = u32::try_from(nanos % 1_000_000_000).ok()?;
    Some(Duration::new(secs, subsec))
}

/// The nanoseconds in one `name`: `ns`, `us` (`µs`), `ms`, `s`, `m`, `h`, `d`, `w`, `M`
/// (30.44 days), `y` (365.25 days), and their long forms (`nsec`, `usec`, `msec`, `millis`,
/// `sec`, `secs`, `second(s)`, `min`, `mins`, `minute(s)`, `hr`, `hrs`, `hour(s)`, `day(s)`,
/// `wk`, `wks`, `week(s)`, `month(s)`, `yr`, `yrs`, `year(s)`).
fn unit(name: &str) -> Option<u128> {
    const SEC: u128 = 1_000_000_000;
    Some(match name {
        "nanos" | "nsec" | "ns" => 1,
        "usec" | "us" | "µs" => 1_000,
        "millis" | "msec" | "ms" => 1_000_000,
        "seconds" | "second" | "secs" | "sec" | "s" => SEC,
        "minutes" | "minute" | "min" | "mins" | "m" => 60 * SEC,
        "hours" | "hour" | "hr" | "hrs" | "h" => 3_600 * SEC,
        "days" | "day" | "d" => 86_400 * SEC,
        "weeks" | "week" | "wk" | "wks" | "w" => 7 * 86_400 * SEC,
        "months" | "month" | "M" => 2_630_016 * SEC,
        "years" | "year" | "yr" | "yrs" | "y" => 31_557_600 * SEC,
        _ => return None,
    })
}

/// The refusal of a value that is not a duration at all (a bare number, a boolean).
pub fn refusal(value: impl fmt::Display) -> String {
    format!("`{value}` is not a duration: {HINT}")
}

/// Displays a duration in the one unit that holds it exactly: `1500ms`, `30s`, `5m`, `2h`.
pub fn display(d: Duration) -> Display {
    Display(d)
}

/// [`display`] of `d` rounded to the nearest millisecond (durations under half a millisecond
/// as they are), for derived values such as `ttl / 3` that rarely fall on a whole unit.
pub fn display_ms(d: Duration) -> Display {
    let ms = (d.as_nanos() + 500_000) / 1_000_000;
    match u64::try_from(ms) {
        Ok(0) | Err(_) => Display(d),
        Ok(ms) => Display(Duration::from_millis(ms)),
    }
}

/// See [`display`].
#[derive(Clone, Copy)]
pub struct Display(Duration);

impl fmt::Display for Display {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.is_zero() {
            return f.write_str("0s");
        }
        let nanos = d.as_nanos();
        if nanos % 1_000_000 != 0 {
            return if nanos % 1_000 == 0 {
                write!(f, "{}us", nanos / 1_000)
            } else {
                write!(f, "{nanos}ns")
            };
        }
        let millis = d.as_millis();
        if millis % 1_000 != 0 {
            return write!(f, "{millis}ms");
        }
        let secs = d.as_secs();
        if secs % 3_600 == 0 {
            write!(f, "{}h", secs / 3_600)
        } else if secs % 60 == 0 {
            write!(f, "{}m", secs / 60)
        } else {
            write!(f, "{secs}s")
        }
    }
}

impl fmt::Debug for Display {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

struct DurationVisitor;

impl Visitor<'_> for DurationVisitor {
    type Value = Duration;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a duration ({HINT})")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
        parse(v).map_err(E::custom)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
        Err(E::custom(refusal(v)))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
        Err(E::custom(refusal(v)))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Duration, E> {
        Err(E::custom(refusal(v)))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Duration, E> {
        Err(E::custom(refusal(v)))
    }
}

/// `#[serde(with = "crate::duration")]` for a `Duration` field.
pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&display(*d))
}

/// `#[serde(with = "crate::duration")]` for a `Duration` field.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    d.deserialize_any(DurationVisitor)
}

/// `#[serde(with = "crate::duration::option")]` for an `Option<Duration>` field.
pub mod option {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.collect_str(&display(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        struct OptionVisitor;
        impl<'de> Visitor<'de> for OptionVisitor {
            type Value = Option<Duration>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a duration ({HINT})")
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(None)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
                super::deserialize(d).map(Some)
            }
        }
        d.deserialize_option(OptionVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_values_print_to_the_millisecond() {
        let third = |ms: u64| display_ms(Duration::from_millis(ms) / 3).to_string();
        assert_eq!(third(5000), "1667ms");
        assert_eq!(third(1500), "500ms");
        assert_eq!(third(3000), "1s");
        assert_eq!(display_ms(Duration::from_micros(300)).to_string(), "300us");
        assert_eq!(display_ms(Duration::ZERO).to_string(), "0s");
    }

    #[test]
    fn parses_the_documented_forms() {
        for (text, want) in [
            ("30s", Duration::from_secs(30)),
            ("30 s", Duration::from_secs(30)),
            ("1500ms", Duration::from_millis(1500)),
            ("1.5s", Duration::from_millis(1500)),
            ("2m30s", Duration::from_secs(150)),
            ("1h", Duration::from_secs(3600)),
        ] {
            assert_eq!(parse(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn reads_long_units_and_exact_fractions() {
        for (text, want) in [
            ("0", Duration::ZERO),
            ("2 hours 5 mins", Duration::from_secs(7500)),
            ("1day", Duration::from_secs(86_400)),
            ("1w", Duration::from_secs(7 * 86_400)),
            ("1.5h", Duration::from_secs(5400)),
            ("0.25ms", Duration::from_micros(250)),
            ("1.000000001s", Duration::new(1, 1)),
            ("3µs", Duration::from_micros(3)),
            ("1M", Duration::from_secs(2_630_016)),
            ("1y", Duration::from_secs(31_557_600)),
        ] {
            assert_eq!(parse(text), Ok(want), "{text}");
        }
        for text in [
            "1.5ns",
            "0.0000000001s",
            "1.",
            ".5s",
            "1 0s",
            "1h30",
            "30s,",
            "1e3s",
            "-1s",
            "1S",
            "s",
            "18446744073709551616s",
        ] {
            assert!(parse(text).is_err(), "{text}");
        }
    }

    #[test]
    fn a_bare_number_says_what_to_write() {
        assert_eq!(
            parse("30").unwrap_err(),
            "`30` is not a duration: write 30s, 1500ms, 1m"
        );
        assert_eq!(
            parse("").unwrap_err(),
            "an empty value is not a duration: write 30s, 1500ms, 1m"
        );
    }

    #[test]
    fn displays_in_the_largest_exact_unit() {
        for (d, want) in [
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_secs(30), "30s"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(300), "5m"),
            (Duration::from_secs(7200), "2h"),
            (Duration::from_micros(1500), "1500us"),
            (Duration::from_nanos(7), "7ns"),
            (Duration::ZERO, "0s"),
        ] {
            assert_eq!(display(d).to_string(), want);
            assert_eq!(parse(want), Ok(d), "{want} reads back");
        }
    }
}
