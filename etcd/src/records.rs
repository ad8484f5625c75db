//! What the broker's state ([`Inner`](crate::inner::Inner)) keeps, below the rooms that act on
//! it: its etcd session and whether it is alive, the tokens it granted and how each is kept
//! alive, the slot watch's view and users, the cleanups of acquires given up. Plain records:
//! what is done with them lives in the rooms (`session.rs`, `slots.rs`, `acquire.rs`).

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{Notify, watch};
use tokio::time::{Instant, timeout};
use tokio_util::sync::CancellationToken;

use super::error::{EtcdError, EtcdErrorKind};

/// Whether a session is known alive, and since when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Liveness {
    /// etcd answered a renewal sent at `renewed` (it counts the TTL from when it received it,
    /// at or after that instant).
    Alive { renewed: Instant },
    /// etcd said the lease is gone: every key under it is deleted.
    Expired,
}

/// One etcd lease carrying every key a broker writes, renewed by a keeper task.
#[derive(Debug)]
pub(super) struct Session {
    pub(super) id: i64,
    pub(super) live: watch::Receiver<Liveness>,
    /// Asks the keeper for a renewal now.
    pub(super) renew_now: Arc<Notify>,
}

impl Session {
    pub(super) fn liveness(&self) -> Liveness {
        *self.live.borrow()
    }

    pub(super) fn is_expired(&self) -> bool {
        self.liveness() == Liveness::Expired
    }

    /// Resolves once etcd has said the session is gone (or its keeper has stopped, which
    /// happens only when the broker closes).
    pub(super) async fn expired(&self) {
        let mut live = self.live.clone();
        let _ = live.wait_for(|l| *l == Liveness::Expired).await;
    }

    /// Makes sure the session was renewed within half of `ttl` before a grant is handed out
    /// (after an outage the keeper may not have renewed yet, and the holder's keep-alive would
    /// report the lease lost at once): asks the keeper for a renewal and waits up to `bound`
    /// for it. `false` when etcd says the session is gone.
    pub(super) async fn refresh(&self, ttl: Duration, bound: Duration) -> bool {
        let fresh = |l: &Liveness| match l {
            Liveness::Alive { renewed } => Instant::now() < *renewed + ttl / 2,
            Liveness::Expired => true,
        };
        if fresh(&self.liveness()) {
            return !self.is_expired();
        }
        self.renew_now.notify_one();
        let mut live = self.live.clone();
        let _ = timeout(bound, live.wait_for(fresh)).await;
        !self.is_expired()
    }

    pub(super) fn expired_error(&self, what: &str) -> EtcdError {
        EtcdError::new(
            EtcdErrorKind::SessionExpired,
            format!(
                "{what}: the broker's etcd session {:016x} expired (etcd no longer knows it)",
                self.id
            ),
        )
    }
}

/// How a held token is kept alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Claim {
    /// Nobody keeps it alive since `since`; `ever` says whether someone did before.
    Unclaimed { since: Instant, ever: bool },
    /// `n` keep-alive futures hold it.
    KeptAlive(usize),
    /// Given back by the broker after a TTL without a claim; kept only so that this broker does
    /// not hand out its slot index while the supervisor may still hold the token.
    Expired,
}

/// What the broker knows about a token it granted and that is not released yet.
#[derive(Debug, Clone)]
pub(super) struct Held {
    /// The request key the grant was made for.
    pub(super) rk: u64,
    /// The supervisor that asked (its orphan expiries are reported to it).
    pub(super) origin: u64,
    pub(super) session: Arc<Session>,
    pub(super) claim: Claim,
    /// `keep_alive` has reported the lease lost: its release is not retried against an etcd
    /// that may not answer (see `release`).
    pub(super) lost: bool,
}

/// Whether the slot watch is in place.
#[derive(Debug, Default)]
pub(super) struct SlotView {
    /// The task whose watch is in place (`None`: none is).
    pub(super) task: Option<u64>,
}

/// The slot watch's users and task.
#[derive(Debug, Default)]
pub(super) struct SlotsCtl {
    pub(super) users: usize,
    /// Bumped each time the last user leaves (see `SlotsUser`'s drop).
    pub(super) idle: u64,
    pub(super) next_task: u64,
    pub(super) stop: Option<CancellationToken>,
}

/// Where the cleanup of an acquire that ended without a grant is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CleanupPhase {
    /// Not started: a retry of the same request may take the work back instead.
    Pending,
    /// Its transaction may land: a retry waits for it.
    Running,
    /// Taken back by a retry; the task stops without touching etcd.
    Cancelled,
    Done,
}

#[derive(Debug)]
pub(super) struct Cleanup {
    pub(super) phase: Mutex<CleanupPhase>,
    pub(super) done: tokio::sync::watch::Sender<bool>,
}
