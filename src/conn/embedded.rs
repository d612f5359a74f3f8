//! The embedded store's and the embedded lease backend's file: one process at a time.

use std::path::Path;

use redb::DatabaseError;

/// Why a redb file could not be opened, naming it. A file another process has open (redb
/// locks it) says who is likely holding it, rather than redb's "Cannot acquire lock".
pub(crate) fn open_error(path: &Path, e: &DatabaseError) -> String {
    match e {
        DatabaseError::DatabaseAlreadyOpen => format!(
            "cannot open {}: another process has it open, most likely a fencegate that is \
             still running (an embedded file belongs to one process at a time): stop that \
             process, or give this one a different path",
            path.display()
        ),
        e => format!("cannot open {}: {e}", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_open_in_another_process_says_who_likely_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fences.db");
        let _held = redb::Database::create(&path).unwrap();
        // redb refuses a second open of a file, in this process as in another.
        let e = redb::Database::create(&path).expect_err("the file is locked");
        assert_eq!(
            open_error(&path, &e),
            format!(
                "cannot open {}: another process has it open, most likely a fencegate that is \
                 still running (an embedded file belongs to one process at a time): stop that \
                 process, or give this one a different path",
                path.display()
            )
        );
    }
}
