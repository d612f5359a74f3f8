//! Lease timing as pure functions: renewal instants, acquisition backoff, local validity.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::config::AcquireConfig;

/// Renewal delay: TTL/3 with ±15 % jitter, so a fleet's heartbeats spread out. `unit` ∈ [0, 1).
pub fn renew_delay(ttl: Duration, unit: f64) -> Duration {
    (ttl / 3).mul_f64(0.85 + 0.30 * unit.clamp(0.0, 1.0))
}

/// Acquisition backoff: `min(max_delay, base_delay · 2^attempt + unit · jitter)`.
pub fn backoff(attempt: u32, config: &AcquireConfig, unit: f64) -> Duration {
    let exponential = config
        .base_delay
        .checked_mul(1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX))
        .unwrap_or(Duration::MAX);
    exponential
        .saturating_add(config.jitter.mul_f64(unit.clamp(0.0, 1.0)))
        .min(config.max_delay)
}

/// The local validity deadline: the *send* time of the request that the backend granted or
/// renewed, plus the TTL, minus the drift buffer. Measuring from the send time (not the
/// answer) makes the deadline conservative by the round trip. A deadline past the clock's
/// range (TTLs are bounded far below it) fails closed: valid until `sent`, i.e. not at all.
pub fn valid_until(sent: Instant, ttl: Duration, drift_buffer: Duration) -> Instant {
    sent.checked_add(ttl.saturating_sub(drift_buffer))
        .unwrap_or(sent)
}

/// A small, lock-free source of jitter (xorshift seeded from the clock): not for secrets.
pub fn unit() -> f64 {
    static STATE: AtomicU64 = AtomicU64::new(0);
    let mut x = STATE.load(Ordering::Relaxed);
    if x == 0 {
        x = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x9e37_79b9_7f4a_7c15, |d| d.as_nanos() as u64)
            | 1;
    }
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    STATE.store(x, Ordering::Relaxed);
    (x >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn renewals_fall_within_a_third_plus_minus_15_percent() {
        assert_eq!(renew_delay(ms(1500), 0.0), ms(425));
        assert_eq!(renew_delay(ms(1500), 0.5), ms(500));
        assert_eq!(renew_delay(ms(1500), 1.0), ms(575));
        for _ in 0..1000 {
            let d = renew_delay(ms(1500), unit());
            assert!(d >= ms(425) && d <= ms(575), "{d:?}");
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let c = AcquireConfig {
            base_delay: ms(50),
            max_delay: ms(2000),
            jitter: ms(100),
        };
        assert_eq!(backoff(0, &c, 0.0), ms(50));
        assert_eq!(backoff(1, &c, 0.0), ms(100));
        assert_eq!(backoff(3, &c, 0.5), ms(450));
        assert_eq!(backoff(6, &c, 0.0), ms(2000));
        assert_eq!(backoff(40, &c, 1.0), ms(2000));
    }

    #[test]
    fn validity_counts_from_the_send_time() {
        let sent = Instant::now();
        assert_eq!(valid_until(sent, ms(1500), ms(100)), sent + ms(1400));
        assert_eq!(valid_until(sent, ms(50), ms(100)), sent);
        assert_eq!(valid_until(sent, Duration::MAX, ms(100)), sent);
    }

    #[test]
    fn jitter_is_in_range_and_varies() {
        let samples: Vec<f64> = (0..100).map(|_| unit()).collect();
        assert!(samples.iter().all(|u| (0.0..1.0).contains(u)));
        assert!(samples.windows(2).any(|w| w[0] != w[1]));
    }
}
