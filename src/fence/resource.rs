//! The resource id: what a fenced write writes to, as the stores key it.

use std::fmt;
use std::ops::Deref;

/// The name of what a fenced write writes to (`account:42`), as the route's `resource`
/// template builds it from the request, and as every store keys its maximum and its
/// idempotency records by.
///
/// Never empty and free of control characters: the stores build the key of an idempotency
/// record as the resource id, `\x1f` and the key, so a resource id holding `\x1f` could
/// address another resource's records. It reads as a `str` (`Deref`).
///
/// ```
/// use fencegate::fence::ResourceId;
///
/// let id = ResourceId::new("account:42").unwrap();
/// assert_eq!(id.as_str(), "account:42");
/// assert!(id.starts_with("account:"));
/// assert!(ResourceId::new("").is_err());
/// assert!(ResourceId::new("a\u{1f}b").is_err());
/// ```
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub struct ResourceId(String);

/// Why a string is not a resource id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ResourceIdError {
    /// The string is empty.
    #[error("a resource id is not empty")]
    Empty,
    /// The string holds a control character (`\t`, `\n`, `\x1f`, ...).
    #[error("a resource id holds no control character")]
    Control,
}

impl ResourceId {
    /// `id` as a resource id, if it is not empty and holds no control character.
    pub fn new(id: impl Into<String>) -> Result<ResourceId, ResourceIdError> {
        let id = id.into();
        if id.is_empty() {
            Err(ResourceIdError::Empty)
        } else if id.chars().any(char::is_control) {
            Err(ResourceIdError::Control)
        } else {
            Ok(ResourceId(id))
        }
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Deref for ResourceId {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for ResourceId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ResourceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl PartialEq<str> for ResourceId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for ResourceId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl From<ResourceId> for String {
    fn from(id: ResourceId) -> String {
        id.0
    }
}

impl TryFrom<String> for ResourceId {
    type Error = ResourceIdError;
    fn try_from(id: String) -> Result<ResourceId, ResourceIdError> {
        ResourceId::new(id)
    }
}

impl TryFrom<&str> for ResourceId {
    type Error = ResourceIdError;
    fn try_from(id: &str) -> Result<ResourceId, ResourceIdError> {
        ResourceId::new(id)
    }
}

impl std::str::FromStr for ResourceId {
    type Err = ResourceIdError;
    fn from_str(id: &str) -> Result<ResourceId, ResourceIdError> {
        ResourceId::new(id)
    }
}

/// `id` as a resource id, in tests (whose ids are valid).
#[cfg(test)]
pub(crate) fn rid(id: &str) -> ResourceId {
    ResourceId::new(id).expect("a test resource id is valid")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resource_id_is_text_without_control_characters() {
        assert_eq!(ResourceId::new("account:42").unwrap(), "account:42");
        assert_eq!(ResourceId::new("é ü/ x").unwrap().len(), "é ü/ x".len());
        assert_eq!(ResourceId::new(""), Err(ResourceIdError::Empty));
        for bad in [
            "a\u{1f}b",
            "tab\there",
            "line\n",
            "\u{7f}",
            "nul\0",
            "c1\u{85}",
        ] {
            assert_eq!(
                ResourceId::new(bad),
                Err(ResourceIdError::Control),
                "{bad:?}"
            );
        }
    }
}
