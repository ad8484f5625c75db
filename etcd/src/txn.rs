//! What the acquire, the queue and the release share: a grant not yet handed over, and the
//! reads and shape checks of their transactions.

use std::sync::Arc;

use etcd_client::{GetOptions, TxnOp};

use super::error::{EtcdError, EtcdErrorKind};
use super::layout::Layout;
use super::records::Session;

/// A slot granted to a request, not yet handed to the caller.
#[derive(Debug, Clone)]
pub(super) struct Grant {
    pub(super) slot: u32,
    /// The grant's revision: the token's lease id.
    pub(super) revision: i64,
    pub(super) session: Arc<Session>,
}

/// A read of every key under `slot/`, keys only: the slots held are those that are exactly
/// slot keys of the pool ([`Layout::held_among`]); anything else under `slot/` is ignored. (A
/// count from the index cannot tell `slot/000001.bak` from `slot/000001`.)
pub(super) fn slot_keys(l: &Layout) -> TxnOp {
    TxnOp::get(
        l.slot_prefix(),
        Some(GetOptions::new().with_prefix().with_keys_only()),
    )
}

/// How many slots a [`slot_keys`] read says are held.
pub(super) fn held_in(l: &Layout, read: &etcd_client::GetResponse) -> i64 {
    l.held_among(read.kvs().iter().map(|kv| kv.key()))
}

/// The revision an answer was given at: what a grant's fencing token is. An answer without a
/// header (or with revision 0) is malformed, never token 0: a token that went backwards would
/// fence nothing, and its release would never match its slot key.
pub(super) fn revision_of(revision: Option<i64>, what: &str) -> Result<i64, EtcdError> {
    revision.filter(|r| *r > 0).ok_or_else(|| {
        EtcdError::new(
            EtcdErrorKind::InvalidResponse,
            format!("{what}: etcd answered without the revision it was given at"),
        )
    })
}

/// The reads of a transaction's answer, in order.
pub(super) fn gets(ops: &[etcd_client::TxnOpResponse]) -> Vec<etcd_client::GetResponse> {
    ops.iter()
        .filter_map(|op| match op {
            etcd_client::TxnOpResponse::Get(g) => Some(g.clone()),
            _ => None,
        })
        .collect()
}

pub(super) fn txn_shape(what: &str) -> EtcdError {
    EtcdError::new(
        EtcdErrorKind::InvalidResponse,
        format!("{what}: etcd answered a transaction without the operations it was asked for"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_without_a_header_is_a_malformed_response_not_fencing_token_zero() {
        for missing in [None, Some(0), Some(-3)] {
            let err = revision_of(missing, "claim a slot").unwrap_err();
            assert_eq!(err.code(), "ETCD_INVALID_RESPONSE", "{err}");
            assert!(err.message().contains("claim a slot"), "{err}");
        }
        assert_eq!(revision_of(Some(42), "claim a slot").unwrap(), 42);
    }
}
