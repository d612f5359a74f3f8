//! Writing: block style, and a string plain only when no YAML reader could take it for
//! anything else.

use serde_json::{Map, Value};

/// Writes a value as a block-style YAML document (no `---`), ending in a newline.
pub fn emit(value: &Value) -> String {
    let mut out = String::new();
    match value {
        Value::Object(map) if !map.is_empty() => emit_map(&mut out, map, 0, false),
        Value::Array(items) if !items.is_empty() => emit_seq(&mut out, items, 0, false),
        other => {
            out.push_str(&scalar(other));
            out.push('\n');
        }
    }
    out
}

fn pad(out: &mut String, indent: usize) {
    out.extend(std::iter::repeat_n(' ', indent));
}

fn emit_map(out: &mut String, map: &Map<String, Value>, indent: usize, inline_first: bool) {
    for (i, (key, value)) in map.iter().enumerate() {
        if i > 0 || !inline_first {
            pad(out, indent);
        }
        out.push_str(&string(key));
        out.push(':');
        match value {
            Value::Object(m) if !m.is_empty() => {
                out.push('\n');
                emit_map(out, m, indent + 2, false);
            }
            // Sequences under a key sit at the key's indentation, as kubectl writes them.
            Value::Array(items) if !items.is_empty() => {
                out.push('\n');
                emit_seq(out, items, indent, false);
            }
            other => {
                out.push(' ');
                emit_scalar(out, other, indent + 2);
            }
        }
    }
}

fn emit_seq(out: &mut String, items: &[Value], indent: usize, inline_first: bool) {
    for (i, item) in items.iter().enumerate() {
        if i > 0 || !inline_first {
            pad(out, indent);
        }
        out.push_str("- ");
        match item {
            Value::Object(m) if !m.is_empty() => emit_map(out, m, indent + 2, true),
            Value::Array(list) if !list.is_empty() => emit_seq(out, list, indent + 2, true),
            other => emit_scalar(out, other, indent + 2),
        }
    }
}

/// A scalar (or empty collection) and its newline; multi-line strings as literal blocks.
fn emit_scalar(out: &mut String, value: &Value, indent: usize) {
    if let Value::String(s) = value {
        if let Some(chomp) = literal_block(s) {
            out.push('|');
            out.push_str(chomp);
            out.push('\n');
            let body = s.strip_suffix('\n').unwrap_or(s);
            for line in body.split('\n') {
                if !line.is_empty() {
                    pad(out, indent);
                    out.push_str(line);
                }
                out.push('\n');
            }
            return;
        }
    }
    out.push_str(&scalar(value));
    out.push('\n');
}

/// The chomping indicator if `s` reads back unchanged as a literal block, else `None`.
fn literal_block(s: &str) -> Option<&'static str> {
    let printable = s.chars().all(|c| {
        c == '\n'
            || c == '\t'
            || !(c.is_control() || matches!(c, '\u{2028}' | '\u{2029}' | '\u{feff}'))
    });
    // The block's indentation is taken from its first non-empty line.
    let first = s.split('\n').find(|l| !l.is_empty())?;
    let awkward_line = s
        .split('\n')
        .any(|l| !l.is_empty() && l.trim_start_matches([' ', '\t']).is_empty());
    if !s.contains('\n')
        || !printable
        || s.starts_with('\n')
        || first.starts_with([' ', '\t'])
        || awkward_line
    {
        return None;
    }
    let trailing = s.len() - s.trim_end_matches('\n').len();
    Some(match trailing {
        0 => "-",
        1 => "",
        _ => "+",
    })
}

fn scalar(value: &Value) -> String {
    match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => string(s),
        Value::Array(_) => "[]".to_owned(),
        Value::Object(_) => "{}".to_owned(),
    }
}

/// Plain when no YAML 1.1 or 1.2 reader could take it for anything but this string.
fn string(s: &str) -> String {
    let safe_chars = s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b" -_./:@+=,()%".contains(&b));
    // A letter or `/` cannot start a number, a boolean or an indicator; nor can `-` or `--`
    // before a letter (command-line flags).
    let flag = s.trim_start_matches('-');
    let starts_well = match s.len() - flag.len() {
        0 => s
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'/'),
        1 | 2 => flag.bytes().next().is_some_and(|b| b.is_ascii_alphabetic()),
        _ => false,
    };
    let reserved = matches!(
        s.to_ascii_lowercase().as_str(),
        "y" | "n" | "yes" | "no" | "on" | "off" | "true" | "false" | "null"
    );
    if safe_chars
        && starts_well
        && !reserved
        && !s.ends_with([' ', ':'])
        && !s.contains(": ")
        && !s.contains(" #")
    {
        return s.to_owned();
    }
    let mut quoted = String::with_capacity(s.len() + 2);
    quoted.push('"');
    for c in s.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            '\n' => quoted.push_str("\\n"),
            '\t' => quoted.push_str("\\t"),
            '\r' => quoted.push_str("\\r"),
            c if c.is_control() || matches!(c, '\u{2028}' | '\u{2029}' | '\u{feff}') => {
                quoted.push_str(&format!("\\u{:04x}", c as u32));
            }
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}
