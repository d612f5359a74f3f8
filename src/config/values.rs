//! Deserializers for plain values of the configuration whose refusals say what to write in
//! plain words.
//!
//! Each refusal is raised inside the YAML deserializer's call, so it keeps the value's line,
//! column and field path.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};

use super::MethodCfg;

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
