//! The compare-and-raise decision, pure: what every fence store applies atomically to its
//! recorded maximum, and what the idempotency decision builds on.

use crate::config::EqualTokens;

/// The answer of a compare-and-raise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The token passed; the maximum is now at least the token. `previous` is the maximum
    /// before (`None`: first write ever seen for the resource).
    Admitted { previous: Option<u64> },
    /// The token is below the maximum (or equal, under `equal: reject`); nothing changed.
    Stale { current: u64 },
}

impl Verdict {
    /// Whether this admission raised the maximum (a new lease epoch for the resource).
    pub fn raised(&self, token: u64) -> bool {
        matches!(self, Verdict::Admitted { previous } if previous.is_none_or(|p| token > p))
    }
}

/// The fence decision: admit when `token >= current` (`>` under `equal: reject`).
pub fn decide(current: Option<u64>, token: u64, equal: EqualTokens) -> Verdict {
    match current {
        None => Verdict::Admitted { previous: None },
        Some(c) if token > c || (token == c && equal == EqualTokens::Allow) => {
            Verdict::Admitted { previous: Some(c) }
        }
        Some(c) => Verdict::Stale { current: c },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use EqualTokens::{Allow, Reject};

    #[test]
    fn decide_is_the_fence() {
        assert_eq!(decide(None, 0, Allow), Verdict::Admitted { previous: None });
        assert_eq!(
            decide(Some(5), 6, Allow),
            Verdict::Admitted { previous: Some(5) }
        );
        assert_eq!(
            decide(Some(5), 5, Allow),
            Verdict::Admitted { previous: Some(5) }
        );
        assert_eq!(decide(Some(5), 5, Reject), Verdict::Stale { current: 5 });
        assert_eq!(decide(Some(5), 4, Allow), Verdict::Stale { current: 5 });
        assert_eq!(
            decide(Some(5), 6, Reject),
            Verdict::Admitted { previous: Some(5) }
        );
    }

    #[test]
    fn raised_only_when_higher() {
        assert!(Verdict::Admitted { previous: None }.raised(0));
        assert!(Verdict::Admitted { previous: Some(1) }.raised(2));
        assert!(!Verdict::Admitted { previous: Some(2) }.raised(2));
        assert!(!Verdict::Stale { current: 3 }.raised(2));
    }
}
