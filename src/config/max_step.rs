//! `token.max_step`: the most a token may exceed its resource's recorded maximum by, in
//! observed fencing (docs/configuration.md, "Poisoned tokens" in docs/operations.md).
//!
//! Without it, one write with `Fencing-Token: 9223372036854775807` raises the maximum to the
//! top of the grammar and every later token is stale for good. The default, 2^40, is far
//! above what the usual token sources advance by between two writes of one resource (an etcd
//! revision, shared by the whole cluster, takes over three years at a sustained 10,000 writes
//! per second to move 2^40; an INCR counter or a sequence moves once per grant) and far below
//! the absurd values (2^63−1, 2^62, nanosecond or millisecond timestamps). A resource with no
//! recorded maximum counts as 0, so a first token above the step is refused as well; a fresh
//! deployment in front of an etcd whose revision is already past 2^40 needs a larger step.

use std::fmt;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// The default step, 2^40 (1,099,511,627,776).
pub const DEFAULT_MAX_STEP: u64 = 1 << 40;

/// `token.max_step`: a whole number of at least 1, or `off` (also `none`) for no ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaxStep(Option<u64>);

impl MaxStep {
    /// No ceiling (`off`).
    pub const OFF: MaxStep = MaxStep(None);

    /// A ceiling of `step` (at least 1).
    pub fn of(step: u64) -> Option<MaxStep> {
        (step > 0).then_some(MaxStep(Some(step)))
    }

    /// The step, `None` when the ceiling is off.
    pub fn get(self) -> Option<u64> {
        self.0
    }
}

impl Default for MaxStep {
    fn default() -> Self {
        MaxStep(Some(DEFAULT_MAX_STEP))
    }
}

impl fmt::Display for MaxStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(step) => write!(f, "{step}"),
            None => f.write_str("off"),
        }
    }
}

impl Serialize for MaxStep {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Some(step) => s.serialize_u64(step),
            None => s.serialize_str("off"),
        }
    }
}

impl<'de> Deserialize<'de> for MaxStep {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StepVisitor)
    }
}

struct StepVisitor;

const WRITE: &str = "write a whole number of at least 1, like 1099511627776 (2^40, the default), \
                     or off";

fn refuse<E: de::Error>(value: impl fmt::Display) -> E {
    E::custom(format!("`{value}` is not a token step: {WRITE}"))
}

impl Visitor<'_> for StepVisitor {
    type Value = MaxStep;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(WRITE)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<MaxStep, E> {
        MaxStep::of(v).ok_or_else(|| {
            E::custom(
                "`0` would refuse every token above the recorded maximum: write a whole number \
                 of at least 1, or off to have no ceiling",
            )
        })
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<MaxStep, E> {
        Err(E::custom(format!(
            "`{v}` is too large (tokens are at most 9223372036854775807): write off to have no \
             ceiling"
        )))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<MaxStep, E> {
        // Only negative numbers arrive here.
        Err(refuse(v))
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<MaxStep, E> {
        Err(refuse(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<MaxStep, E> {
        Err(refuse(v))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<MaxStep, E> {
        Err(refuse(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<MaxStep, E> {
        match v {
            "off" | "none" => Ok(MaxStep::OFF),
            _ if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => Err(E::custom(format!(
                "`\"{v}\"` is quoted, so it is text: write {v} without quotes"
            ))),
            _ => Err(refuse(v)),
        }
    }

    fn visit_unit<E: de::Error>(self) -> Result<MaxStep, E> {
        Err(E::custom(format!("the value is empty: {WRITE}")))
    }
}
