//! The compare-and-raise decision, pure: what every fence store applies atomically to its
//! recorded maximum, and what the idempotency decision builds on.

use super::Token;
use crate::config::EqualTokens;

/// What a token is held to besides being at least the recorded maximum: `token.equal`, and
/// `token.max_step`, the most it may exceed the maximum by (`None`: no ceiling). A resource
/// with no recorded maximum counts as 0 for the step, so a first token above the step is
/// refused too: one absurd first write would otherwise lock a new resource for good.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    /// Whether a token equal to the maximum passes (`token.equal`).
    pub equal: EqualTokens,
    /// How far above the maximum a token may be (`token.max_step`); `None`: no ceiling.
    pub max_step: Option<u64>,
}

impl Rule {
    /// The lowest maximum `token` may be raised from: `Some(f)` (at least 1) when the step
    /// refuses a resource whose maximum is below `f` (or absent); `None` when the step allows
    /// `token` over any maximum. The stores put this bound in the same atomic step that
    /// compares (a Lua comparison, an SQL `WHERE`, an etcd compare).
    pub fn floor(&self, token: Token) -> Option<Token> {
        let step = self.max_step?;
        token.checked_sub(step).filter(|f| *f > Token::ZERO)
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
    Admitted {
        /// The maximum before.
        previous: Option<Token>,
    },
    /// The token is below the maximum (or equal, under `equal: reject`); nothing changed.
    Stale {
        /// The recorded maximum.
        current: Token,
    },
    /// The token exceeds the maximum (`None`: there is none, counted as 0) by more than
    /// `token.max_step`; nothing changed.
    TooFar {
        /// The recorded maximum.
        current: Option<Token>,
    },
}

impl Verdict {
    /// Whether this admission raised the maximum (a new lease epoch for the resource).
    pub fn raised(&self, token: Token) -> bool {
        matches!(self, Verdict::Admitted { previous } if previous.is_none_or(|p| token > p))
    }
}

/// The fence decision: admit when `token >= current` (`>` under `equal: reject`) and, with a
/// ceiling, `token - current <= max_step` (a missing maximum counts as 0).
pub fn decide(current: Option<Token>, token: Token, rule: Rule) -> Verdict {
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

    fn t(value: u32) -> Token {
        Token::from(value)
    }

    #[test]
    fn decide_is_the_fence() {
        let (allow, reject) = (Rule::from(Allow), Rule::from(Reject));
        assert_eq!(
            decide(None, t(0), allow),
            Verdict::Admitted { previous: None }
        );
        assert_eq!(
            decide(Some(t(5)), t(6), allow),
            Verdict::Admitted {
                previous: Some(t(5))
            }
        );
        assert_eq!(
            decide(Some(t(5)), t(5), allow),
            Verdict::Admitted {
                previous: Some(t(5))
            }
        );
        assert_eq!(
            decide(Some(t(5)), t(5), reject),
            Verdict::Stale { current: t(5) }
        );
        assert_eq!(
            decide(Some(t(5)), t(4), allow),
            Verdict::Stale { current: t(5) }
        );
        assert_eq!(
            decide(Some(t(5)), t(6), reject),
            Verdict::Admitted {
                previous: Some(t(5))
            }
        );
        assert_eq!(
            decide(Some(t(5)), Token::MAX, allow),
            Verdict::Admitted {
                previous: Some(t(5))
            }
        );
    }

    #[test]
    fn the_step_is_a_ceiling_above_the_maximum() {
        let rule = Rule {
            equal: Allow,
            max_step: Some(100),
        };
        assert_eq!(
            decide(Some(t(5)), t(105), rule),
            Verdict::Admitted {
                previous: Some(t(5))
            }
        );
        assert_eq!(
            decide(Some(t(5)), t(106), rule),
            Verdict::TooFar {
                current: Some(t(5))
            }
        );
        assert_eq!(
            decide(Some(t(5)), Token::MAX, rule),
            Verdict::TooFar {
                current: Some(t(5))
            }
        );
        // Stale is stale whatever the step.
        assert_eq!(
            decide(Some(t(500)), t(4), rule),
            Verdict::Stale { current: t(500) }
        );
        // No maximum: measured from 0.
        assert_eq!(
            decide(None, t(100), rule),
            Verdict::Admitted { previous: None }
        );
        assert_eq!(
            decide(None, t(101), rule),
            Verdict::TooFar { current: None }
        );
        assert_eq!(
            decide(Some(t(0)), t(101), rule),
            Verdict::TooFar {
                current: Some(t(0))
            }
        );
        assert_eq!((rule.floor(t(100)), rule.floor(t(101))), (None, Some(t(1))));
        assert_eq!(rule.floor(t(1_000)), Some(t(900)));
        let largest = Rule {
            equal: Reject,
            max_step: Some(u64::MAX),
        };
        assert_eq!(largest.floor(Token::MAX), None);
    }

    #[test]
    fn raised_only_when_higher() {
        assert!(Verdict::Admitted { previous: None }.raised(t(0)));
        assert!(Verdict::Admitted {
            previous: Some(t(1))
        }
        .raised(t(2)));
        assert!(!Verdict::Admitted {
            previous: Some(t(2))
        }
        .raised(t(2)));
        assert!(!Verdict::Stale { current: t(3) }.raised(t(2)));
        assert!(!Verdict::TooFar {
            current: Some(t(3))
        }
        .raised(t(9)));
    }
}
