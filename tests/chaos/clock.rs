//! The run's common clock: microseconds since the harness started, monotonic.

use std::time::Instant;

use crate::checker::Micros;

#[derive(Clone, Copy)]
pub struct Clock {
    base: Instant,
}

impl Clock {
    pub fn new() -> Clock {
        Clock {
            base: Instant::now(),
        }
    }

    pub fn now(&self) -> Micros {
        self.base.elapsed().as_micros() as Micros
    }
}
