//! Deserializers for the plain values of the configuration (whole numbers, booleans,
//! addresses, method lists) whose refusals say what to write in plain words, instead of the
//! Rust type a value was meant to become (`expected usize`, `invalid socket address syntax`).
//!
//! Each refusal is raised inside the YAML deserializer's call, so it keeps the value's line,
//! column and field path.

use std::fmt;
use std::marker::PhantomData;
use std::net::{IpAddr, SocketAddr};

use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};

use super::MethodCfg;

/// A whole number of bytes (`#[serde(deserialize_with = "values::Bytes::<16384>::de")]`); the
/// example in refusals is the field's default.
pub struct Bytes<const EXAMPLE: usize>;

impl<const EXAMPLE: usize> Bytes<EXAMPLE> {
    pub fn de<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
        d.deserialize_any(Whole {
            what: "a whole number of bytes",
            example: EXAMPLE,
        })
    }
}

/// A whole number of things (headers, connections, cached resources).
pub struct Count<const EXAMPLE: usize>;

impl<const EXAMPLE: usize> Count<EXAMPLE> {
    pub fn de<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
        d.deserialize_any(Whole {
            what: "a whole number",
            example: EXAMPLE,
        })
    }
}

struct Whole {
    what: &'static str,
    example: usize,
}

impl Whole {
    fn refuse<E: de::Error>(&self, value: impl fmt::Display) -> E {
        E::custom(format!(
            "`{value}` is not {}: write digits only, like {}",
            self.what, self.example
        ))
    }
}

impl Visitor<'_> for Whole {
    type Value = usize;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}, like {}", self.what, self.example)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<usize, E> {
        usize::try_from(v).map_err(|_| E::custom(format!("`{v}` is too large")))
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<usize, E> {
        usize::try_from(v).map_err(|_| E::custom(format!("`{v}` is too large")))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<usize, E> {
        // Only negative numbers arrive here.
        Err(self.refuse(v))
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<usize, E> {
        Err(self.refuse(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<usize, E> {
        Err(self.refuse(v))
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<usize, E> {
        Err(self.refuse(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<usize, E> {
        if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
            return Err(E::custom(format!(
                "`\"{v}\"` is quoted, so it is text: write {v} without quotes"
            )));
        }
        Err(self.refuse(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<usize, E> {
        Err(E::custom(format!(
            "the value is empty: write {}, like {}",
            self.what, self.example
        )))
    }
}

/// `true` or `false`.
pub fn flag<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    d.deserialize_any(Flag)
}

/// `true`, `false`, or absent (`null` too).
pub fn optional_flag<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    d.deserialize_any(OptionalFlag)
}

struct OptionalFlag;

impl Visitor<'_> for OptionalFlag {
    type Value = Option<bool>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("true or false")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<bool>, E> {
        Ok(None)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Option<bool>, E> {
        Ok(Some(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<bool>, E> {
        Flag.visit_str(v).map(Some)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Option<bool>, E> {
        Err(not_a_flag(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Option<bool>, E> {
        Err(not_a_flag(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Option<bool>, E> {
        Err(not_a_flag(v))
    }
}

struct Flag;

fn not_a_flag<E: de::Error>(value: impl fmt::Display) -> E {
    E::custom(format!("`{value}` is not a boolean: write true or false"))
}

impl Visitor<'_> for Flag {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("true or false")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<bool, E> {
        Ok(v)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<bool, E> {
        if v == "true" || v == "false" {
            return Err(E::custom(format!(
                "`\"{v}\"` is quoted, so it is text: write {v} without quotes"
            )));
        }
        Err(not_a_flag(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<bool, E> {
        Err(not_a_flag(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<bool, E> {
        Err(not_a_flag(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<bool, E> {
        Err(not_a_flag(v))
    }
}

/// An IP address and port (`0.0.0.0:7440`, `127.0.0.1:7442`, `[::]:7440`).
pub fn address<'de, D: Deserializer<'de>>(d: D) -> Result<SocketAddr, D::Error> {
    d.deserialize_str(Address)
}

struct Address;

impl Visitor<'_> for Address {
    type Value = SocketAddr;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an IP address and port, like 0.0.0.0:7440")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<SocketAddr, E> {
        parse_address(v).map_err(E::custom)
    }
}

/// A listener address that is not `ip:port`; `address` is as written, `port` as it reads it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressError {
    #[error(
        "`{address}` has no IP address: write 0.0.0.0:{port} (every interface) or \
         127.0.0.1:{port} (this host only)"
    )]
    NoIp { address: String, port: String },
    #[error("`{address}` has no port: write an IP address and port, like {address}:7440")]
    NoPort { address: String },
    #[error("`{address}` is not an IP address and port: write one like 0.0.0.0:7440")]
    Unreadable { address: String },
    #[error("`{address}`: a port is at most 65535")]
    PortTooLarge { address: String },
    #[error("`{address}`: an IPv6 address is written in brackets: [{ip}]:{port}")]
    UnbracketedIpv6 {
        address: String,
        ip: String,
        port: String,
    },
    #[error("`{address}`: write an IP address, not a host name: 127.0.0.1:{port}")]
    Localhost { address: String, port: String },
    #[error(
        "`{address}`: write an IP address, not a host name, like 0.0.0.0:{port} (every \
         interface) or 127.0.0.1:{port} (this host only)"
    )]
    HostName { address: String, port: String },
}

/// Parses `ip:port`; the refusal says what to write instead.
pub fn parse_address(v: &str) -> Result<SocketAddr, AddressError> {
    if let Ok(addr) = v.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let address = v.to_owned();
    let port_only = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    if port_only(v) {
        let port = address.clone();
        return Err(AddressError::NoIp { address, port });
    }
    let Some((host, port)) = v.rsplit_once(':') else {
        return Err(AddressError::NoPort { address });
    };
    if !port_only(port) {
        return Err(AddressError::Unreadable { address });
    }
    if port.parse::<u16>().is_err() {
        return Err(AddressError::PortTooLarge { address });
    }
    let port = port.to_owned();
    if host.is_empty() {
        return Err(AddressError::NoIp { address, port });
    }
    if host.parse::<IpAddr>().is_ok() {
        // An IPv6 address without brackets.
        let ip = host.to_owned();
        return Err(AddressError::UnbracketedIpv6 { address, ip, port });
    }
    if host.eq_ignore_ascii_case("localhost") {
        return Err(AddressError::Localhost { address, port });
    }
    Err(AddressError::HostName { address, port })
}

/// A route's `methods`: a non-empty list of methods.
pub fn methods<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<MethodCfg>>, D::Error> {
    d.deserialize_any(Methods(PhantomData))
}

struct Methods<'de>(PhantomData<&'de ()>);

impl<'de> Visitor<'de> for Methods<'de> {
    type Value = Option<Vec<MethodCfg>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of methods, like [PUT, DELETE]")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut methods = Vec::new();
        while let Some(method) = seq.next_element()? {
            methods.push(method);
        }
        if methods.is_empty() {
            return Err(de::Error::custom(
                "an empty list fences no method: leave `methods` out to fence every method \
                 but GET, HEAD and OPTIONS",
            ));
        }
        Ok(Some(methods))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        let method = MethodCfg::deserialize(de::value::StrDeserializer::<E>::new(v))?;
        Err(E::custom(format!(
            "`{v}` is one method, not a list: write [{}]",
            method.0
        )))
    }
}
