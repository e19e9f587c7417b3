//! Maps SPIRE's per-item batch results onto ours. The rules, from SPIRE's server code:
//! - create: OK; ALREADY_EXISTS *with* an entry = a similar entry exists (success, that entry);
//!   ALREADY_EXISTS *without* one = our custom ID is taken by a different entry (collision);
//! - update: NOT_FOUND = the entry is gone;
//! - delete: NOT_FOUND = already deleted (success);
//! - INVALID_ARGUMENT anywhere: permanent, carrying SPIRE's message.

use super::convert::entry_from_proto;
use super::proto::types as pb;
use super::types::{DeleteResult, EntryResult, ItemError};
use tonic::Code;

fn code_of(status: Option<&pb::Status>) -> (Code, String) {
    match status {
        Some(status) => (Code::from_i32(status.code), status.message.clone()),
        None => (Code::Unknown, "no status in result".to_string()),
    }
}

/// A stable label for `spire_api_entries_total{result}`.
pub fn result_label<T>(result: &Result<T, ItemError>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(ItemError::Invalid { .. }) => "invalid",
        Err(ItemError::IdCollision { .. }) => "collision",
        Err(ItemError::NotFound { .. }) => "not_found",
        Err(ItemError::NotOurs { .. }) => "not_ours",
        Err(ItemError::Other { .. }) => "error",
    }
}

pub fn create_result(
    id: &str,
    status: Option<&pb::Status>,
    entry: Option<pb::Entry>,
) -> EntryResult {
    let (code, message) = code_of(status);
    match (code, entry) {
        (Code::Ok, Some(entry)) | (Code::AlreadyExists, Some(entry)) => Ok(entry_from_proto(entry)),
        (Code::AlreadyExists, None) => Err(ItemError::IdCollision {
            id: id.to_string(),
            message,
        }),
        (code, entry) => Err(item_error(id, code, message, entry.is_some())),
    }
}

pub fn update_result(
    id: &str,
    status: Option<&pb::Status>,
    entry: Option<pb::Entry>,
) -> EntryResult {
    let (code, message) = code_of(status);
    match (code, entry) {
        (Code::Ok, Some(entry)) => Ok(entry_from_proto(entry)),
        (Code::NotFound, _) => Err(ItemError::NotFound { id: id.to_string() }),
        (code, entry) => Err(item_error(id, code, message, entry.is_some())),
    }
}

/// The failures create and update share: InvalidArgument is permanent; OK without the entry
/// we asked for back is a protocol oddity; anything else may pass on a later attempt.
fn item_error(id: &str, code: Code, message: String, has_entry: bool) -> ItemError {
    let id = id.to_string();
    match code {
        Code::InvalidArgument => ItemError::Invalid { id, message },
        Code::Ok if !has_entry => ItemError::Other {
            id,
            code,
            message: "OK without an entry".into(),
        },
        code => ItemError::Other { id, code, message },
    }
}

pub fn delete_result(id: &str, status: Option<&pb::Status>) -> DeleteResult {
    let (code, message) = code_of(status);
    match code {
        Code::Ok | Code::NotFound => Ok(id.to_string()),
        Code::InvalidArgument => Err(ItemError::Invalid {
            id: id.to_string(),
            message,
        }),
        code => Err(ItemError::Other {
            id: id.to_string(),
            code,
            message,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: Code, message: &str) -> pb::Status {
        pb::Status {
            code: code as i32,
            message: message.into(),
        }
    }

    fn entry(id: &str) -> pb::Entry {
        pb::Entry {
            id: id.into(),
            ..Default::default()
        }
    }

    #[test]
    fn create_results() {
        assert_eq!(
            create_result("a", Some(&status(Code::Ok, "OK")), Some(entry("a"))).map(|e| e.id),
            Ok("a".into())
        );
        let existing = create_result(
            "a",
            Some(&status(Code::AlreadyExists, "similar entry already exists")),
            Some(entry("other")),
        );
        assert_eq!(
            existing.map(|e| e.id),
            Ok("other".into()),
            "the stored entry comes back, with its own ID"
        );
        assert!(matches!(
            create_result(
                "a",
                Some(&status(Code::AlreadyExists, "datastore-sql: UNIQUE")),
                None
            ),
            Err(ItemError::IdCollision { .. })
        ));
        assert_eq!(
            create_result(
                "a",
                Some(&status(
                    Code::InvalidArgument,
                    "failed to convert entry: bad"
                )),
                None
            ),
            Err(ItemError::Invalid {
                id: "a".into(),
                message: "failed to convert entry: bad".into()
            })
        );
        assert!(matches!(
            create_result("a", None, None),
            Err(ItemError::Other {
                code: Code::Unknown,
                ..
            })
        ));
        assert!(matches!(
            create_result("a", Some(&status(Code::Ok, "OK")), None),
            Err(ItemError::Other { .. })
        ));
    }

    #[test]
    fn update_results() {
        assert!(update_result("a", Some(&status(Code::Ok, "")), Some(entry("a"))).is_ok());
        assert_eq!(
            update_result("a", Some(&status(Code::NotFound, "")), None),
            Err(ItemError::NotFound { id: "a".into() })
        );
        assert!(matches!(
            update_result("a", Some(&status(Code::Internal, "db")), None),
            Err(ItemError::Other {
                code: Code::Internal,
                ..
            })
        ));
    }

    #[test]
    fn delete_results() {
        assert_eq!(
            delete_result("a", Some(&status(Code::Ok, ""))),
            Ok("a".into())
        );
        assert_eq!(
            delete_result("a", Some(&status(Code::NotFound, "entry not found"))),
            Ok("a".into()),
            "already gone = deleted"
        );
        assert!(matches!(
            delete_result(
                "a",
                Some(&status(Code::InvalidArgument, "missing entry ID"))
            ),
            Err(ItemError::Invalid { .. })
        ));
    }
}
