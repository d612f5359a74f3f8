//! Deserialisation that validates *inside* the YAML deserializer's call, so a refused value
//! keeps the line, column and field path that the deserializer attaches to errors raised
//! there (a `#[serde(try_from)]` conversion runs after the call and loses them).

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserialize, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

/// Parses a string, then converts it with `TryFrom<String>`.
pub fn from_str<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<String, Error: fmt::Display>,
{
    struct V<T>(PhantomData<T>);
    impl<T: TryFrom<String, Error: fmt::Display>> Visitor<'_> for V<T> {
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
    T: TryFrom<R, Error: fmt::Display>,
{
    from_map_expecting(d, "a mapping")
}

/// [`from_map`], saying what the mapping holds when the value is not one.
pub fn from_map_expecting<'de, D, R, T>(d: D, expecting: &'static str) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    R: Deserialize<'de>,
    T: TryFrom<R, Error: fmt::Display>,
{
    struct V<R, T>(&'static str, PhantomData<(R, T)>);
    impl<'de, R: Deserialize<'de>, T: TryFrom<R, Error: fmt::Display>> Visitor<'de> for V<R, T> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
            let raw = R::deserialize(de::value::MapAccessDeserializer::new(map))?;
            T::try_from(raw).map_err(de::Error::custom)
        }
    }
    d.deserialize_map(V(expecting, PhantomData))
}

/// Parses a list of mappings `E`, checking each against those before it while it is read, so
/// that a refusal carries that element's own line, column and path (`routes[2]: … at line 9
/// column 5`) rather than the list's. `expecting` describes one element.
pub fn from_seq_each<'de, D, E, X, C>(
    d: D,
    expecting: &'static str,
    check: C,
) -> Result<Vec<E>, D::Error>
where
    D: Deserializer<'de>,
    E: Deserialize<'de>,
    X: fmt::Display,
    C: FnMut(&[E], &E) -> Result<(), X>,
{
    struct Seq<E, C> {
        expecting: &'static str,
        check: C,
        items: PhantomData<E>,
    }
    impl<'de, E, X, C> Visitor<'de> for Seq<E, C>
    where
        E: Deserialize<'de>,
        X: fmt::Display,
        C: FnMut(&[E], &E) -> Result<(), X>,
    {
        type Value = Vec<E>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a list")
        }
        fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<Vec<E>, A::Error> {
            let mut items = Vec::new();
            loop {
                let element = Element {
                    earlier: &items,
                    expecting: self.expecting,
                    check: &mut self.check,
                };
                match seq.next_element_seed(element)? {
                    Some(item) => items.push(item),
                    None => return Ok(items),
                }
            }
        }
    }

    struct Element<'a, E, C> {
        earlier: &'a [E],
        expecting: &'static str,
        check: &'a mut C,
    }
    impl<'de, E, X, C> DeserializeSeed<'de> for Element<'_, E, C>
    where
        E: Deserialize<'de>,
        X: fmt::Display,
        C: FnMut(&[E], &E) -> Result<(), X>,
    {
        type Value = E;
        fn deserialize<D2: Deserializer<'de>>(self, d: D2) -> Result<E, D2::Error> {
            // Checked inside the element's own call, which gives the error its location.
            d.deserialize_map(self)
        }
    }
    impl<'de, E, X, C> Visitor<'de> for Element<'_, E, C>
    where
        E: Deserialize<'de>,
        X: fmt::Display,
        C: FnMut(&[E], &E) -> Result<(), X>,
    {
        type Value = E;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.expecting)
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<E, A::Error> {
            let item = E::deserialize(de::value::MapAccessDeserializer::new(map))?;
            (self.check)(self.earlier, &item).map_err(de::Error::custom)?;
            Ok(item)
        }
    }

    d.deserialize_seq(Seq {
        expecting,
        check,
        items: PhantomData,
    })
}

/// `impl Deserialize` through [`from_str`] for types with `TryFrom<String>`.
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
