//! The fence's decisions, as pure functions over values (no sockets, no clocks).

pub mod barrier;
pub mod method;
#[cfg(test)]
mod model;
pub mod path;
pub mod routes;
pub mod token;
pub mod verdict;
