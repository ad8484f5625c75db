//! Tests of the pure core: named edges, a model-based test of the whole pipeline against a
//! broker that is not the pool, and a model of the in-process pool with its controls. Both
//! models let several inputs share a batch, as the mailbox does, and check the invariants
//! after every grant.

mod edges;
mod explore;
mod memory;
mod model;
mod pool_model;

/// What every test of the core uses.
mod prelude {
    pub(super) use crate::broker::{BrokerError, LocalBroker, SlotToken};
    pub(super) use crate::error::{AcquireError, CleanupError, PrepareError};
    pub(super) use crate::job::{PRIORITY_AGING_GRANTS, Priority};
    pub(super) use crate::supervisor::core::Core;
    pub(super) use crate::supervisor::core::protocol::*;
    pub(super) use crate::supervisor::core::record::*;

    pub(super) fn drain(core: &mut Core) -> Vec<Effect> {
        let mut out = Vec::new();
        while let Some(e) = core.pop_effect() {
            out.push(e);
        }
        out
    }

    /// Settles, answers every broker acquire the core asked for (slot `i` under lease id
    /// `i + 1`, in the order asked) and returns who was delivered which lease.
    pub(super) fn grant_every_acquire(core: &mut Core) -> Vec<(WaiterId, LeaseKey)> {
        core.settle();
        let requests: Vec<RequestId> = drain(core)
            .into_iter()
            .filter_map(|e| match e {
                Effect::Acquire { request, .. } => Some(request),
                _ => None,
            })
            .collect();
        for (i, request) in requests.into_iter().enumerate() {
            core.apply(Input::Acquired {
                request,
                result: Ok(token(i as u32, i as u64 + 1)),
            });
        }
        drain(core)
            .into_iter()
            .filter_map(|e| match e {
                Effect::Deliver { waiter, key, .. } => Some((waiter, key)),
                _ => None,
            })
            .collect()
    }

    impl Core {
        /// Each of `waiters` asks for one slot, for `want`, in order.
        pub(in crate::supervisor::core) fn ask_one_slot_each(
            &mut self,
            waiters: impl IntoIterator<Item = u64>,
            want: Want,
        ) {
            for w in waiters {
                self.apply(Input::Enqueue {
                    waiter: WaiterId(w),
                    ask: Ask::one(want),
                });
            }
        }
    }

    pub(super) fn token(slot: u32, lease: u64) -> SlotToken {
        SlotToken::new(slot, lease)
    }

    /// The temp dir lease `key`'s job asked for, as its end report names it (one per lease,
    /// so that a removal names whose dir it removes).
    pub(super) fn dir_of(key: LeaseKey) -> Option<crate::paths::TempDir> {
        Some(crate::paths::TempDir {
            path: std::path::PathBuf::from(format!("/work-root/job-{key}")).into(),
            made: true,
        })
    }
}
