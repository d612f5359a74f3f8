//! `${NAME}` in a config file: environment variables expanded before the YAML is parsed.

/// A `${NAME}` that cannot be expanded, with its line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// A `${` with no `}` after it.
    #[error("line {line}: `${{` without a closing `}}`")]
    Unclosed {
        /// The line of the `${`, from 1.
        line: usize,
    },
    /// A name that is not `A-Z`, `0-9` and `_`, or is empty.
    #[error("line {line}: `${{{name}}}`: environment variable names are A-Z, 0-9 and _")]
    BadName {
        /// The line of the `${`, from 1.
        line: usize,
        /// The name as written.
        name: String,
    },
    /// A variable that is not set, written without a default.
    #[error(
        "line {line}: environment variable {name} is not set (write ${{{name}:-default}} for a \
         default)"
    )]
    Unset {
        /// The line of the `${`, from 1.
        line: usize,
        /// The variable's name.
        name: String,
    },
}

/// Replaces `${NAME}` and `${NAME:-default}` in a config file with environment values, so a
/// Kubernetes sidecar can take its upstream port from an annotation and its store password
/// from a Secret. An unset variable without a default is an error naming its line.
pub fn expand_env(text: &str, lookup: impl Fn(&str) -> Option<String>) -> Result<String, EnvError> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let line = text.len() - rest.len() + start;
        let line = text[..line].matches('\n').count() + 1;
        let after = &rest[start + 2..];
        let end = after.find('}').ok_or(EnvError::Unclosed { line })?;
        let (name, default) = match after[..end].split_once(":-") {
            Some((name, default)) => (name, Some(default)),
            None => (&after[..end], None),
        };
        let valid = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
        if !valid {
            return Err(EnvError::BadName {
                line,
                name: name.to_owned(),
            });
        }
        match (lookup(name), default) {
            (Some(value), _) => out.push_str(&value),
            (None, Some(default)) => out.push_str(default),
            (None, None) => {
                return Err(EnvError::Unset {
                    line,
                    name: name.to_owned(),
                })
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}
