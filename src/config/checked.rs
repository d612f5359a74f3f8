//! Deserialisation that validates *inside* the YAML deserializer's call, so a refused value
//! keeps the line, column and field path that the deserializer attaches to errors raised
//! there (a `#[serde(try_from)]` conversion runs after the call and loses them).

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// Parses a string, then converts it with `TryFrom<String>`.
pub fn from_str<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<String, Error = String>,
{
    struct V<T>(PhantomData<T>);
    impl<T: TryFrom<String, Error = String>> Visitor<'_> for V<T> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
            T::try_from(v.to_owned()).map_err(E::custom)
        }
    }
    d.deserialize_str(V(PhantomData))
}

/// Parses a mapping as `R`, then converts it with `TryFrom<R>`.
pub fn from_map<'de, D, R, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    R: Deserialize<'de>,
    T: TryFrom<R, Error = String>,
{
    struct V<R, T>(PhantomData<(R, T)>);
    impl<'de, R: Deserialize<'de>, T: TryFrom<R, Error = String>> Visitor<'de> for V<R, T> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a mapping")
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
            let raw = R::deserialize(de::value::MapAccessDeserializer::new(map))?;
            T::try_from(raw).map_err(de::Error::custom)
        }
    }
    d.deserialize_map(V(PhantomData))
}

/// Parses a sequence of `E`, then checks the whole list with `check`.
pub fn from_seq<'de, D, E>(d: D, check: fn(&[E]) -> Result<(), String>) -> Result<Vec<E>, D::Error>
where
    D: Deserializer<'de>,
    E: Deserialize<'de>,
{
    struct V<E>(fn(&[E]) -> Result<(), String>);
    impl<'de, E: Deserialize<'de>> Visitor<'de> for V<E> {
        type Value = Vec<E>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a list")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<E>, A::Error> {
            let mut items = Vec::new();
            while let Some(item) = seq.next_element()? {
                items.push(item);
            }
            (self.0)(&items).map_err(de::Error::custom)?;
            Ok(items)
        }
    }
    d.deserialize_seq(V(check))
}

/// `impl Deserialize` through [`from_str`] for types with `TryFrom<String, Error = String>`.
macro_rules! checked_from_str {
    ($($t:ty),* $(,)?) => {$(
        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                $crate::config::checked::from_str(d)
            }
        }
    )*};
}
pub(crate) use checked_from_str;
