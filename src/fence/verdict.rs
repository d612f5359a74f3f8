//! The compare-and-raise decision, pure: what every fence store applies atomically to its
//! recorded maximum, and what the idempotency decision builds on.

use crate::config::EqualTokens;

/// What a token is held to besides being at least the recorded maximum: `token.equal`, and
/// `token.max_step`, the most it may exceed the maximum by (`None`: no ceiling). A resource
/// with no recorded maximum counts as 0 for the step, so a first token above the step is
/// refused too: one absurd first write would otherwise lock a new resource for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub equal: EqualTokens,
    pub max_step: Option<u64>,
}

impl Rule {
    /// The lowest maximum `token` may be raised from: `Some(f)` (at least 1) when the step
    /// refuses a resource whose maximum is below `f` (or absent); `None` when the step allows
    /// `token` over any maximum. The stores put this bound in the same atomic step that
    /// compares (a Lua comparison, an SQL `WHERE`, an etcd compare).
    pub fn floor(&self, token: u64) -> Option<u64> {
        let step = self.max_step?;
        token.checked_sub(step).filter(|f| *f > 0)
    }
}

/// `token.equal` alone, no ceiling.
impl From<EqualTokens> for Rule {
    fn from(equal: EqualTokens) -> Self {
        Rule {
            equal,
            max_step: None,
        }
    }
}

/// The answer of a compare-and-raise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The token passed; the maximum is now at least the token. `previous` is the maximum
    /// before (`None`: first write ever seen for the resource).
    Admitted { previous: Option<u64> },
    /// The token is below the maximum (or equal, under `equal: reject`); nothing changed.
    Stale { current: u64 },
    /// The token exceeds the maximum (`None`: there is none, counted as 0) by more than
    /// `token.max_step`; nothing changed.
    TooFar { current: Option<u64> },
}

impl Verdict {
    /// Whether this admission raised the maximum (a new lease epoch for the resource).
    pub fn raised(&self, token: u64) -> bool {
        matches!(self, Verdict::Admitted { previous } if previous.is_none_or(|p| token > p))
    }
}

/// The fence decision: admit when `token >= current` (`>` under `equal: reject`) and, with a
/// ceiling, `token - current <= max_step` (a missing maximum counts as 0).
pub fn decide(current: Option<u64>, token: u64, rule: Rule) -> Verdict {
    match current {
        Some(c) if token < c || (token == c && rule.equal == EqualTokens::Reject) => {
            Verdict::Stale { current: c }
        }
        _ if rule
            .floor(token)
            .is_some_and(|f| current.is_none_or(|c| c < f)) =>
        {
            Verdict::TooFar { current }
        }
        _ => Verdict::Admitted { previous: current },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use EqualTokens::{Allow, Reject};

    #[test]
    fn decide_is_the_fence() {
        let (allow, reject) = (Rule::from(Allow), Rule::from(Reject));
        assert_eq!(decide(None, 0, allow), Verdict::Admitted { previous: None });
        assert_eq!(
            decide(Some(5), 6, allow),
            Verdict::Admitted { previous: Some(5) }
        );
        assert_eq!(
            decide(Some(5), 5, allow),
            Verdict::Admitted { previous: Some(5) }
        );
        assert_eq!(decide(Some(5), 5, reject), Verdict::Stale { current: 5 });
        assert_eq!(decide(Some(5), 4, allow), Verdict::Stale { current: 5 });
        assert_eq!(
            decide(Some(5), 6, reject),
            Verdict::Admitted { previous: Some(5) }
        );
        assert_eq!(
            decide(Some(5), u64::MAX, allow),
            Verdict::Admitted { previous: Some(5) }
        );
    }

    #[test]
    fn the_step_is_a_ceiling_above_the_maximum() {
        let rule = Rule {
            equal: Allow,
            max_step: Some(100),
        };
        assert_eq!(
            decide(Some(5), 105, rule),
            Verdict::Admitted { previous: Some(5) }
        );
        assert_eq!(
            decide(Some(5), 106, rule),
            Verdict::TooFar { current: Some(5) }
        );
        assert_eq!(
            decide(Some(5), i64::MAX as u64, rule),
            Verdict::TooFar { current: Some(5) }
        );
        // Stale is stale whatever the step.
        assert_eq!(decide(Some(500), 4, rule), Verdict::Stale { current: 500 });
        // No maximum: measured from 0.
        assert_eq!(
            decide(None, 100, rule),
            Verdict::Admitted { previous: None }
        );
        assert_eq!(decide(None, 101, rule), Verdict::TooFar { current: None });
        assert_eq!(
            decide(Some(0), 101, rule),
            Verdict::TooFar { current: Some(0) }
        );
        assert_eq!((rule.floor(100), rule.floor(101)), (None, Some(1)));
        assert_eq!(rule.floor(1_000), Some(900));
        let largest = Rule {
            equal: Reject,
            max_step: Some(u64::MAX),
        };
        assert_eq!(largest.floor(u64::MAX), None);
    }

    #[test]
    fn raised_only_when_higher() {
        assert!(Verdict::Admitted { previous: None }.raised(0));
        assert!(Verdict::Admitted { previous: Some(1) }.raised(2));
        assert!(!Verdict::Admitted { previous: Some(2) }.raised(2));
        assert!(!Verdict::Stale { current: 3 }.raised(2));
        assert!(!Verdict::TooFar { current: Some(3) }.raised(9));
    }
}
