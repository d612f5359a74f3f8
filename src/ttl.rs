//! TTL derivation (design: TTL = p99 work + p99 RTT + safety margin [+ drift buffer], rounded
//! up, and never below [`MIN_TTL`]), with the renewal interval (TTL/3) and the dedup window
//! (TTL + p99 work).

use std::time::Duration;

use serde::Serialize;

#[derive(Debug, Clone, Copy)]
pub struct TtlInputs {
    pub p99_work: Duration,
    pub p99_rtt: Duration,
    pub safety_margin: Duration,
    pub drift_buffer: Duration,
    pub round_to: Duration,
}

/// The shortest lease TTL. A lease is renewed every TTL/3; below this, a renewal's round trip
/// and the scheduler's delays take up too much of the interval for renewal to be relied on. A
/// TTL written in the config below it is refused; a derived one is raised to it.
pub const MIN_TTL: Duration = Duration::from_millis(30);

/// The longest lease TTL, acquisition `wait` and drain timeout accepted, from the config or
/// from an API request. Far above any sensible lease (a lease is renewed every TTL/3, so a
/// long TTL only delays the takeover after a crash) and far below what would overflow the
/// monotonic clock when added to it.
pub const MAX_LEASE_DURATION: Duration = Duration::from_secs(3600);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Derived {
    pub base: Duration,
    /// The base rounded up to a multiple of `round_to`.
    pub rounded: Duration,
    /// The lease TTL: `rounded`, or [`MIN_TTL`] if that is longer.
    pub ttl: Duration,
    pub renew_every: Duration,
    pub dedup_window: Duration,
}

/// Latency budgets that do not derive a TTL.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DerivationError {
    /// `round_to` is zero.
    #[error("round_to must be greater than zero")]
    ZeroRoundTo,
    /// The budgets (or the TTL plus the p99 work, the dedup window) overflow a duration.
    #[error("the inputs add up to more than a duration can hold")]
    Overflow,
    /// The budgets add up to zero.
    #[error("the inputs add up to zero; a lease needs a positive TTL")]
    Zero,
    /// The TTL, rounded up, is more nanoseconds than 64 bits hold.
    #[error("TTL too large")]
    TooLarge,
}

pub fn derive(i: &TtlInputs) -> Result<Derived, DerivationError> {
    if i.round_to.is_zero() {
        return Err(DerivationError::ZeroRoundTo);
    }
    let base = [i.p99_rtt, i.safety_margin, i.drift_buffer]
        .into_iter()
        .try_fold(i.p99_work, Duration::checked_add)
        .ok_or(DerivationError::Overflow)?;
    if base.is_zero() {
        return Err(DerivationError::Zero);
    }
    let step = i.round_to.as_nanos();
    let ttl_nanos = base.as_nanos().div_ceil(step) * step;
    let rounded =
        Duration::from_nanos(u64::try_from(ttl_nanos).map_err(|_| DerivationError::TooLarge)?);
    let ttl = rounded.max(MIN_TTL);
    Ok(Derived {
        base,
        rounded,
        ttl,
        renew_every: ttl / 3,
        dedup_window: ttl
            .checked_add(i.p99_work)
            .ok_or(DerivationError::Overflow)?,
    })
}

impl Derived {
    /// Whether the rounded TTL was below [`MIN_TTL`] and raised to it.
    pub fn raised_to_floor(&self) -> bool {
        self.ttl > self.rounded
    }

    /// The warning to show when the TTL was raised to [`MIN_TTL`].
    pub fn floor_warning(&self) -> Option<String> {
        self.raised_to_floor().then(|| {
            format!(
                "the derived ttl {} is below the {} floor, under which a lease cannot be \
                 renewed reliably: the lease ttl is {}",
                millis(self.rounded),
                millis(MIN_TTL),
                millis(self.ttl)
            )
        })
    }
}

/// The `ttl --json` document: milliseconds, for scripts.
#[derive(Serialize)]
pub struct DerivedJson {
    pub base_ms: u128,
    pub ttl_ms: u128,
    pub renew_every_ms: u128,
    pub dedup_window_ms: u128,
}

impl From<Derived> for DerivedJson {
    fn from(d: Derived) -> Self {
        DerivedJson {
            base_ms: d.base.as_millis(),
            ttl_ms: d.ttl.as_millis(),
            renew_every_ms: d.renew_every.as_millis(),
            dedup_window_ms: d.dedup_window.as_millis(),
        }
    }
}

pub fn render(i: &TtlInputs, d: &Derived) -> String {
    let h = millis;
    let rounding = if d.raised_to_floor() {
        format!(
            "base rounded up to a multiple of {} is {}, raised to the {} floor",
            h(i.round_to),
            h(d.rounded),
            h(MIN_TTL)
        )
    } else {
        format!("base rounded up to a multiple of {}", h(i.round_to))
    };
    format!(
        "base          {}  (p99 work {} + p99 rtt {} + safety margin {} + drift buffer {})\n\
         ttl           {}  ({rounding})\n\
         renew every   {}  (ttl / 3, with ±15% jitter)\n\
         dedup window  {}  (ttl + p99 work)\n",
        h(d.base),
        h(i.p99_work),
        h(i.p99_rtt),
        h(i.safety_margin),
        h(i.drift_buffer),
        h(d.ttl),
        h(d.renew_every),
        h(d.dedup_window),
    )
}

/// `1040ms`, `333.333ms`: one unit, so the sums in the output can be checked by eye.
fn millis(d: Duration) -> String {
    let micros = d.as_micros();
    if micros % 1000 == 0 {
        format!("{}ms", micros / 1000)
    } else {
        format!("{}.{:03}ms", micros / 1000, micros % 1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn inputs(work: u64, rtt: u64, margin: u64, drift: u64, round: u64) -> TtlInputs {
        TtlInputs {
            p99_work: ms(work),
            p99_rtt: ms(rtt),
            safety_margin: ms(margin),
            drift_buffer: ms(drift),
            round_to: ms(round),
        }
    }

    #[test]
    fn the_design_example() {
        let d = derive(&inputs(800, 40, 200, 0, 500)).unwrap();
        assert_eq!(d.base, ms(1040));
        assert_eq!(d.ttl, ms(1500));
        assert_eq!(d.renew_every, ms(500));
        assert_eq!(d.dedup_window, ms(2300));
    }

    #[test]
    fn exact_multiples_are_kept_and_drift_counts() {
        assert_eq!(derive(&inputs(800, 0, 200, 0, 500)).unwrap().ttl, ms(1000));
        assert_eq!(
            derive(&inputs(800, 40, 200, 100, 500)).unwrap().ttl,
            ms(1500)
        );
        assert_eq!(
            derive(&inputs(800, 40, 200, 500, 500)).unwrap().ttl,
            ms(2000)
        );
        assert_eq!(derive(&inputs(30, 0, 0, 0, 1)).unwrap().ttl, ms(30));
    }

    /// A derived TTL below the floor is raised to it, and says so.
    #[test]
    fn a_ttl_below_the_floor_is_raised_to_it() {
        let i = inputs(5, 1, 1, 0, 1);
        let d = derive(&i).unwrap();
        assert_eq!((d.base, d.rounded, d.ttl), (ms(7), ms(7), ms(30)));
        assert_eq!((d.renew_every, d.dedup_window), (ms(10), ms(35)));
        assert_eq!(
            d.floor_warning().as_deref(),
            Some(
                "the derived ttl 7ms is below the 30ms floor, under which a lease cannot be \
                 renewed reliably: the lease ttl is 30ms"
            )
        );
        assert_eq!(
            render(&i, &d),
            "base          7ms  (p99 work 5ms + p99 rtt 1ms + safety margin 1ms + drift buffer 0ms)\n\
             ttl           30ms  (base rounded up to a multiple of 1ms is 7ms, raised to the 30ms floor)\n\
             renew every   10ms  (ttl / 3, with ±15% jitter)\n\
             dedup window  35ms  (ttl + p99 work)\n"
        );
        let exact = derive(&inputs(20, 5, 5, 0, 1)).unwrap();
        assert_eq!(exact.ttl, ms(30));
        assert_eq!(exact.floor_warning(), None);
    }

    #[test]
    fn renders_in_milliseconds() {
        let i = inputs(800, 40, 200, 0, 500);
        let text = render(&i, &derive(&i).unwrap());
        assert!(text.starts_with("base          1040ms"), "{text}");
        assert!(text.contains("ttl           1500ms"), "{text}");
        assert_eq!(millis(ms(1000) / 3), "333.333ms");
    }

    #[test]
    fn refuses_degenerate_inputs() {
        assert!(derive(&inputs(800, 40, 200, 0, 0)).is_err());
        assert!(derive(&inputs(0, 0, 0, 0, 500)).is_err());
    }

    #[test]
    fn refuses_inputs_too_large_to_add_up() {
        let mut i = inputs(800, 40, 200, 0, 500);
        i.p99_work = Duration::MAX;
        assert_eq!(derive(&i), Err(DerivationError::Overflow));
        assert_eq!(
            DerivationError::Overflow.to_string(),
            "the inputs add up to more than a duration can hold"
        );
    }
}
