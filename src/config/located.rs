//! A refusal raised while the YAML is read, made as useful as the deserializer's position
//! allows: a misspelt field or value gets the nearest accepted one ("did you mean"), and an
//! error the deserializer pins to the start of its mapping (a duplicate field, anything in the
//! top-level mapping, whose start it does not print) gets the line and column of the key.

use std::fmt;

/// A value, field or section that is wrong where it is written: the message names its field
/// path, line and column.
#[derive(Debug)]
pub struct LocatedError {
    message: String,
}

impl fmt::Display for LocatedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for LocatedError {}

/// The most edits a name may be from the one written to be suggested: enough for a dropped,
/// doubled or swapped letter, not so many that `ttl` suggests `tls`... for `url`.
const MAX_EDITS: usize = 2;

impl LocatedError {
    /// `e`, raised while reading `text`.
    pub(super) fn new(e: serde_yaml::Error, text: &str) -> LocatedError {
        let shown = e.to_string();
        let location = e.location();
        // The deserializer prints no position at the very start of the text (line 1, column
        // 1), which is where the top-level mapping starts.
        let (mut message, at) = match &location {
            Some(l) => {
                let suffix = format!(" at line {} column {}", l.line(), l.column());
                match shown.strip_suffix(&suffix) {
                    Some(message) => (message.to_owned(), Some((l.line(), l.column()))),
                    None => (shown.clone(), Some((l.line(), l.column()))),
                }
            }
            None => (shown.clone(), None),
        };
        let at = match (duplicate(&message), at) {
            // Pinned to the mapping: find the second time the key is written in it.
            (Some(field), Some((line, column))) => {
                second_key(text, line, column, field).or(Some((line, column)))
            }
            (_, at) => at,
        };
        if let Some((line, column)) = at {
            message.push_str(&format!(" at line {line} column {column}"));
        }
        if let Some(near) = suggestion(&message) {
            message.push_str(&format!("; did you mean `{near}`?"));
        }
        LocatedError { message }
    }
}

/// The field of a "duplicate field `x`" message.
fn duplicate(message: &str) -> Option<&str> {
    let (_, rest) = message.split_once("duplicate field `")?;
    rest.split_once('`').map(|(field, _)| field)
}

/// Where `field` is written the second time among the keys of the block mapping whose first
/// key is at `line`, `column` (both from 1); `None` when it is not found (a flow mapping,
/// `{ a: 1, a: 2 }`, stays at the mapping's position).
fn second_key(text: &str, line: usize, column: usize, field: &str) -> Option<(usize, usize)> {
    let indent = column - 1;
    let mut seen = 0;
    for (i, content) in text.lines().enumerate().skip(line - 1) {
        let trimmed = content.trim_start();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        let this = content.len() - trimmed.len();
        if i + 1 > line && this < indent {
            break;
        }
        if this != indent && i + 1 > line {
            continue;
        }
        let key = trimmed
            .get(indent.saturating_sub(this)..)
            .unwrap_or(trimmed);
        let key = key.split_once(':').map(|(k, _)| k.trim());
        let key = key.map(|k| k.trim_matches(|c| c == '"' || c == '\''));
        if key == Some(field) {
            seen += 1;
            if seen == 2 {
                return Some((i + 1, indent + 1));
            }
        }
    }
    None
}

/// The accepted name nearest to the one an "unknown field" or "unknown variant" message
/// quotes, if one is near enough.
fn suggestion(message: &str) -> Option<&str> {
    let (_, rest) = message
        .split_once("unknown field `")
        .or_else(|| message.split_once("unknown variant `"))?;
    let (written, rest) = rest.split_once('`')?;
    let (_, expected) = rest.split_once("expected ")?;
    let names = expected.split('`').skip(1).step_by(2);
    names
        .map(|name| (edits(written, name), name))
        .filter(|&(edits, name)| edits <= MAX_EDITS && edits < name.len().max(written.len()))
        .min_by_key(|&(edits, _)| edits)
        .map(|(_, name)| name)
}

/// The Damerau-Levenshtein distance from `a` to `b`: the fewest insertions, deletions,
/// substitutions and swaps of adjacent characters that make one the other (unrestricted: text
/// between a swapped pair may be edited too), by characters.
fn edits(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    if a.is_empty() || b.is_empty() {
        return a.len().max(b.len());
    }
    // d[i + 1][j + 1]: the distance between the first i of `a` and the first j of `b`; row and
    // column 0 hold a bound above any distance.
    let width = b.len() + 2;
    let far = a.len() + b.len();
    let mut d = vec![0; (a.len() + 2) * width];
    d[0] = far;
    for i in 0..=a.len() {
        d[(i + 1) * width] = far;
        d[(i + 1) * width + 1] = i;
    }
    for j in 0..=b.len() {
        d[j + 1] = far;
        d[width + j + 1] = j;
    }
    // The last row of `a` each character was seen on.
    let mut last_row = std::collections::HashMap::new();
    for i in 1..=a.len() {
        // The last column of `b` holding `a[i - 1]`, in this row.
        let mut last_col = 0;
        for j in 1..=b.len() {
            let k = last_row.get(&b[j - 1]).copied().unwrap_or(0);
            let l = last_col;
            let same = a[i - 1] == b[j - 1];
            if same {
                last_col = j;
            }
            let substitution = d[i * width + j] + usize::from(!same);
            let insertion = d[(i + 1) * width + j] + 1;
            let deletion = d[i * width + j + 1] + 1;
            let swap = d[k * width + l] + (i - k - 1) + 1 + (j - l - 1);
            d[(i + 1) * width + j + 1] = substitution.min(insertion).min(deletion).min(swap);
        }
        last_row.insert(a[i - 1], i);
    }
    d[(a.len() + 1) * width + b.len() + 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_count_swaps_of_adjacent_characters() {
        assert_eq!(edits("lsiten", "listen"), 1);
        assert_eq!(edits("upstrem", "upstream"), 1);
        assert_eq!(edits("kitten", "sitting"), 3);
        // Unrestricted: `ca` -> `ac` -> `abc`, an insertion between the swapped pair.
        assert_eq!(edits("ca", "abc"), 2);
        assert_eq!(edits("", "tls"), 3);
        assert_eq!(edits("é", "e"), 1);
    }

    #[test]
    fn the_nearest_name_is_suggested() {
        let list = ", expected one of `listen`, `admin`, `upstream`, `upstream_ca`, `tls`";
        assert_eq!(
            suggestion(&format!("unknown field `upstrem`{list}")),
            Some("upstream")
        );
        assert_eq!(
            suggestion(&format!("unknown field `lsiten`{list}")),
            Some("listen")
        );
        assert_eq!(suggestion(&format!("unknown field `routes`{list}")), None);
        assert_eq!(
            suggestion("unknown variant `rejct`, expected `reject` or `allow`"),
            Some("reject")
        );
    }

    #[test]
    fn the_second_key_of_a_block_mapping_is_found() {
        let text = "upstream: x\nroutes: []\nfence:\n  authority: none\n  # routes:\n  authority: none\nroutes: []\n";
        assert_eq!(second_key(text, 1, 1, "routes"), Some((7, 1)));
        assert_eq!(second_key(text, 4, 3, "authority"), Some((6, 3)));
        assert_eq!(second_key("a: { b: 1, b: 2 }\n", 1, 4, "b"), None);
    }
}
