//! The broker's state, shared by its rooms and its background tasks: what `EtcdBroker` wraps,
//! and the two things only it does (recording the capacity at connect, and the close).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, Txn, TxnOp};
use parking_lot::Mutex;
use tokio::time::{Instant, timeout_at};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use leasehold::{BrokerEvents, SlotToken};

use crate::endpoints::Endpoints;
use crate::error::{EtcdError, EtcdErrorKind, Fail};
use crate::layout::{self, Layout};
use crate::records::{Cleanup, Held, Session, SlotView, SlotsCtl};
use crate::{txn, watches};

/// The broker's state, shared with its background tasks.
pub(crate) struct Inner {
    pub(crate) layout: Layout,
    pub(crate) endpoints: Arc<Endpoints>,
    pub(crate) ttl: Duration,
    pub(crate) rpc_timeout: Duration,
    pub(crate) retry_for: Duration,
    pub(crate) connect_timeout: Duration,
    /// Random per broker: request ids are only unique per supervisor.
    pub(crate) owner: u64,
    /// The live session, if any.
    pub(crate) session: Mutex<Option<Arc<Session>>>,
    /// One session grant at a time.
    pub(crate) granting: tokio::sync::Mutex<()>,
    /// Tokens this broker granted and has not released.
    pub(crate) held: Mutex<HashMap<SlotToken, Held>>,
    /// Woken when a token is released: its slot index may be handed out again.
    pub(crate) released: tokio::sync::Notify,
    /// How many tokens were released (see `queue::wait`).
    pub(crate) releases: AtomicU64,
    /// Tokens given back unclaimed after a TTL: a late release of one answers `Ok`.
    pub(crate) forgotten: Mutex<VecDeque<SlotToken>>,
    /// A slot index likely to be free (the idle pool's first guess).
    pub(crate) hint: AtomicU32,
    /// The oldest waiters this broker knows of (a release chains over them): named by the
    /// grants it receives, read by a release that found nobody in its chain, and read in the
    /// background when a grant leaves fewer than a chain's worth (see `release`).
    pub(crate) heads: Mutex<Vec<layout::Waiter>>,
    /// A read of `heads` is on its way.
    pub(crate) refreshing: AtomicBool,
    /// Woken when a background read of `heads` (or any `spawn_alone` work) ends.
    pub(crate) refreshed: tokio::sync::Notify,
    /// Free slots are being granted (see `fill_free_slots`).
    pub(crate) filling: AtomicBool,
    /// Test support: acquires wait before setting up their marker's watch while `true`.
    #[cfg(feature = "fault-injection")]
    pub(crate) hold_watches: tokio::sync::watch::Sender<bool>,
    /// Test support: no background read of the oldest waiters while `true`.
    #[cfg(feature = "fault-injection")]
    pub(crate) hold_refreshes: AtomicBool,
    /// The broker's shared watch stream (see `watches`).
    pub(crate) hub: Arc<watches::Hub>,
    /// Bumped on every slot deletion while the broker has waiters (see `slots`).
    pub(crate) frees: tokio::sync::watch::Sender<u64>,
    /// The slot watch's users and task, what it has seen, and a bump on each of its batches
    /// (see `slots`).
    pub(crate) slots_ctl: Mutex<SlotsCtl>,
    pub(crate) slot_view: Mutex<SlotView>,
    pub(crate) slot_seen: tokio::sync::watch::Sender<u64>,
    /// Whether the queue had waiters when last seen: an acquire then joins it straight away
    /// instead of first trying to claim (a comparison over the whole queue).
    pub(crate) contended: AtomicBool,
    /// Queue places in use, by request key, and the free ones (see `layout`).
    pub(crate) places: Mutex<Places>,
    /// Cleanups of acquires given up, by request key.
    pub(crate) abandoned: Mutex<HashMap<u64, Arc<Cleanup>>>,
    pub(crate) orphans_expired: AtomicU64,
    /// Give-backs in progress in the background.
    pub(crate) settling: AtomicUsize,
    /// Request keys whose release is still being settled in the background: an acquire with
    /// the same request is refused until it is (see `acquire`).
    pub(crate) settling_requests: Mutex<HashMap<u64, usize>>,
    /// The runtime the broker was connected on: the cleanup of an acquire or release dropped
    /// where no runtime is current runs there (the session's keeper runs there too).
    pub(crate) rt: tokio::runtime::Handle,
    pub(crate) events: Mutex<Vec<BrokerEvents>>,
    /// Supervisors attached and not yet closed (see [`SlotBroker::close`]).
    pub(crate) attached: Mutex<usize>,
    /// Acquire attempts in flight, by request key: a copy of a request sent while another
    /// runs waits for it (see `acquire`).
    pub(crate) flights: Mutex<HashMap<u64, tokio::sync::watch::Receiver<()>>>,
    /// Acquires in flight and the background work that settles what they and releases leave
    /// (withdrawn queue places, grants passed on, releases finished): what `close` waits for,
    /// instead of tasks that die with the runtime.
    pub(crate) tasks: TaskTracker,
    /// Cancelled when `close` begins: acquires end, no new session is granted.
    pub(crate) closed: CancellationToken,
    /// One close at a time; `true` once done.
    pub(crate) close_done: tokio::sync::Mutex<bool>,
    /// Set once `close` has revoked the session: the keeper need not revoke it again.
    pub(crate) revoked: Arc<AtomicBool>,
    /// Cancelled when the broker goes: its session keeper stops (and revokes the session,
    /// unless `close` already did).
    pub(crate) closing: CancellationToken,
}

/// A broker's queue places: a small index per place, reused once free.
#[derive(Debug, Default)]
pub(crate) struct Places {
    pub(crate) by_request: HashMap<u64, u32>,
    pub(crate) free: Vec<u32>,
    pub(crate) next: u32,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.closing.cancel();
    }
}

impl Inner {
    /// Records the capacity if the pool is new (nothing under its prefix) and lies inside no
    /// other pool, then validates the whole pool.
    pub(crate) async fn ensure_capacity(self: &Arc<Self>) -> Result<(), EtcdError> {
        let l = &self.layout;
        // Bounded by the connect timeout: the client connects lazily, on this first call.
        let deadline = Instant::now() + self.connect_timeout;
        let enclosing = l.enclosing_capacity_keys();
        // One transaction: a pool that another pool's keys would nest in (or that would nest
        // in another) is never created, whichever connects first.
        let mut when = vec![
            // An empty range compares as one absent key: nothing under the prefix.
            Compare::create_revision(l.prefix(), CompareOp::Equal, 0).with_prefix(),
        ];
        when.extend(
            enclosing
                .iter()
                .map(|key| Compare::create_revision(key.as_str(), CompareOp::Equal, 0)),
        );
        let txn = Txn::new()
            .when(when)
            .and_then([TxnOp::put(l.capacity_key(), l.capacity_value(), None)])
            .or_else(
                enclosing
                    .iter()
                    .map(|key| TxnOp::get(key.as_str(), Some(GetOptions::new().with_keys_only())))
                    .collect::<Vec<_>>(),
            );
        let created = self
            .endpoints
            .call("record the capacity", deadline, |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await
            .map_err(|f| connect_error(f, "record the capacity"))?;
        if !created.succeeded() {
            let outer = txn::gets(&created.op_responses())
                .iter()
                .flat_map(|g| g.kvs().to_vec())
                .next();
            if let Some(outer) = outer {
                let outer = String::from_utf8_lossy(outer.key());
                return Err(EtcdError::new(
                    EtcdErrorKind::NestedPool,
                    format!(
                        "the pool prefix {:?} lies inside the pool whose capacity record is {outer:?}: choose a key prefix and pool outside it",
                        l.prefix()
                    ),
                ));
            }
        }
        let prefix = l.prefix().to_owned();
        let pool = self
            .endpoints
            .call("read the pool", deadline, |mut c| {
                let prefix = prefix.clone();
                async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await }
            })
            .await
            .map_err(|f| connect_error(f, "read the pool"))?;
        l.check_pool(layout::raws(pool.kvs()))
    }

    /// The broker's close (see [`SlotBroker::close`] on [`EtcdBroker`]).
    pub(crate) async fn close(self: &Arc<Self>) -> Result<(), EtcdError> {
        let mut done = self.close_done.lock().await;
        if *done {
            return Ok(());
        }
        // From here the broker is closed: acquires in flight end (each withdraws what it left
        // in etcd, in a task `tasks` tracks), and none starts a new session.
        self.closed.cancel();
        self.tasks.close();
        // Withdrawals, grants passed on and releases settling, in their own bound: the revoke
        // below removes what they could not, so it must not be starved by them.
        let _ = timeout_at(Instant::now() + self.rpc_timeout * 2, self.tasks.wait()).await;
        let session = self.session.lock().clone();
        let revoked = match session {
            None => Ok(()),
            Some(session) => {
                let id = session.id;
                match self
                    .endpoints
                    .call(
                        "revoke the session",
                        Instant::now() + self.retry_for,
                        |mut c| async move { c.lease_revoke(id).await },
                    )
                    .await
                {
                    // Revoked, or already gone: nothing is left under it.
                    Ok(_) | Err(Fail::NotFound) => {
                        tracing::debug!(
                            session = format_args!("{id:016x}"),
                            "etcd session revoked at close"
                        );
                        self.revoked.store(true, Ordering::Release);
                        self.forget_session(&session);
                        Ok(())
                    }
                    Err(f) => Err(f.into_etcd(
                        "revoke the session at close (what is under it goes with its ttl)",
                    )),
                }
            }
        };
        if revoked.is_ok() {
            // The keeper stops renewing (and does not revoke again). After a failed revoke it
            // keeps renewing, so that a second close can try again.
            self.closing.cancel();
            *done = true;
        }
        revoked
    }
}

fn connect_error(fail: Fail, what: &str) -> EtcdError {
    match fail {
        Fail::Fatal(e) => e,
        other => other.into_etcd(what),
    }
}
