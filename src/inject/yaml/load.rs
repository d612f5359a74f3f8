//! Reading: serde_yaml's events, with the YAML 1.1 reading of plain scalars put back.

use std::fmt;

use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// Reads one YAML document into JSON values with Kubernetes' reading of plain scalars.
/// An empty document is `null`.
pub fn load(text: &str) -> Result<Value, serde_yaml::Error> {
    Node { input: text }.deserialize(serde_yaml::Deserializer::from_str(text))
}

/// A value, read with the original text at hand to tell plain scalars from quoted ones.
#[derive(Clone, Copy)]
struct Node<'de> {
    input: &'de str,
}

impl<'de> Node<'de> {
    /// A scalar borrowed from the input is plain unless a quote sits on both sides of it.
    fn is_plain(&self, s: &str) -> bool {
        let bytes = self.input.as_bytes();
        let Some(start) = (s.as_ptr() as usize).checked_sub(bytes.as_ptr() as usize) else {
            return false;
        };
        let end = start.saturating_add(s.len());
        if end > bytes.len() {
            // Not a slice of the input after all: keep it a string.
            return false;
        }
        match (start.checked_sub(1).map(|i| bytes[i]), bytes.get(end)) {
            (Some(before), Some(&after)) => !(matches!(after, b'\'' | b'"') && before == after),
            _ => true,
        }
    }
}

impl<'de> DeserializeSeed<'de> for Node<'de> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node<'de> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a YAML value that JSON can hold")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Value, E> {
        Err(E::custom(format!("the integer {v} is too large")))
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Value, E> {
        Err(E::custom(format!("the integer {v} is too large")))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        float(v).ok_or_else(|| E::custom(format!("{v} cannot be written in JSON")))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        // Escaped, folded or block scalars: never plain numbers or booleans.
        Ok(Value::String(v.to_owned()))
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Value, E> {
        if self.is_plain(v) {
            if let Some(value) = yaml11(v) {
                return Ok(value);
            }
        }
        Ok(Value::String(v.to_owned()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        self.deserialize(d)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Value, A::Error> {
        let mut map = Map::new();
        let mut merged = Vec::new();
        while let Some((key, plain)) = access.next_key_seed(Key(self))? {
            let value = access.next_value_seed(self)?;
            if plain && key == "<<" {
                // YAML 1.1 merge key: its mappings fill in what the mapping does not set.
                match value {
                    Value::Object(m) => merged.push(m),
                    Value::Array(list) => {
                        for item in list {
                            match item {
                                Value::Object(m) => merged.push(m),
                                _ => return Err(de::Error::custom("`<<` merges mappings only")),
                            }
                        }
                    }
                    _ => return Err(de::Error::custom("`<<` merges mappings only")),
                }
            } else if map.insert(key.clone(), value).is_some() {
                return Err(de::Error::custom(format!("duplicate key `{key}`")));
            }
        }
        for source in merged {
            for (k, v) in source {
                map.entry(k).or_insert(v);
            }
        }
        Ok(Value::Object(map))
    }
}

/// A mapping key as a string (kubectl turns scalar keys into strings too), and whether plain.
struct Key<'de>(Node<'de>);

impl<'de> DeserializeSeed<'de> for Key<'de> {
    type Value = (String, bool);

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(String, bool), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Key<'de> {
    type Value = (String, bool);

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a scalar mapping key")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
        Ok((v.to_string(), true))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        Ok((v.to_string(), true))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        Ok((v.to_string(), true))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        Ok((v.to_string(), true))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok((v.to_owned(), false))
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok((v.to_owned(), self.0.is_plain(v)))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(("null".to_owned(), true))
    }
}

/// JSON has one number type; Go's YAML-to-JSON writes integral floats as integers.
fn float(v: f64) -> Option<Value> {
    if v.fract() == 0.0 && v.abs() < 9.0e15 {
        return Some(Value::from(v as i64));
    }
    Number::from_f64(v).map(Value::Number)
}

/// The YAML 1.1 (go-yaml v2) reading of a plain scalar that YAML 1.2 reads as a string.
fn yaml11(s: &str) -> Option<Value> {
    match s {
        "y" | "Y" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" => return Some(Value::Bool(true)),
        "n" | "N" | "no" | "No" | "NO" | "off" | "Off" | "OFF" => return Some(Value::Bool(false)),
        _ => {}
    }
    if !s
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_digit() || b"+-.".contains(&b))
    {
        return None;
    }
    // go-yaml v2 drops every `_`, then tries Go's base-prefixed integer syntax, then a float.
    let plain = s.replace('_', "");
    let (negative, body) = match plain.as_bytes().first() {
        Some(b'-') => (true, &plain[1..]),
        Some(b'+') => (false, &plain[1..]),
        _ => (false, plain.as_str()),
    };
    let lower = body.to_ascii_lowercase();
    let (radix, digits) = if let Some(d) = lower.strip_prefix("0x") {
        (16, d)
    } else if let Some(d) = lower.strip_prefix("0o") {
        (8, d)
    } else if let Some(d) = lower.strip_prefix("0b") {
        (2, d)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, &lower[1..])
    } else {
        (10, lower.as_str())
    };
    if !digits.is_empty() && digits.chars().all(|c| c.is_digit(radix)) {
        if let Ok(n) = i128::from_str_radix(digits, radix) {
            let n = if negative { -n } else { n };
            if let Ok(n) = i64::try_from(n) {
                return Some(Value::from(n));
            }
            if let Ok(n) = u64::try_from(n) {
                return Some(Value::from(n));
            }
        }
    }
    if is_yaml11_float(&plain) {
        return plain.parse::<f64>().ok().and_then(float);
    }
    None
}

/// `^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$`, go-yaml v2's float syntax.
fn is_yaml11_float(s: &str) -> bool {
    let s = s.strip_prefix(['-', '+']).unwrap_or(s);
    let (mantissa, exponent) = match s.find(['e', 'E']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    let mantissa_ok = match mantissa.split_once('.') {
        Some(("", frac)) => digits(frac),
        Some((int, frac)) => digits(int) && (frac.is_empty() || digits(frac)),
        None => digits(mantissa),
    };
    let exponent_ok = exponent.is_none_or(|e| digits(e.strip_prefix(['-', '+']).unwrap_or(e)));
    mantissa_ok && exponent_ok
}
