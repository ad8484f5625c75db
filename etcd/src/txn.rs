//! What the acquire, the queue and the release share: a grant not yet handed over, and the
//! reads and shape checks of their transactions.

use std::sync::Arc;

use etcd_client::{GetOptions, TxnOp};

use super::error::{EtcdError, EtcdErrorKind};
use super::layout::Layout;
use super::session::Session;

/// A slot granted to a request, not yet handed to the caller.
#[derive(Debug, Clone)]
pub(super) struct Grant {
    pub(super) slot: u32,
    /// The grant's revision: the token's lease id.
    pub(super) revision: i64,
    pub(super) session: Arc<Session>,
}

/// Two counts of the `slot/` keys, read from the index (no key is read): those in the pool's
/// slot range, and all of them.
pub(super) fn slot_counts(l: &Layout) -> [TxnOp; 2] {
    let (from, to) = l.slot_range();
    [
        TxnOp::get(
            from,
            Some(GetOptions::new().with_range(to).with_count_only()),
        ),
        TxnOp::get(
            l.slot_prefix(),
            Some(GetOptions::new().with_prefix().with_count_only()),
        ),
    ]
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
