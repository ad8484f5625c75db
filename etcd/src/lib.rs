#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![deny(unused_must_use)]

// The broker by concern:
// - `config` — [`EtcdConfig`] and its validation;
// - `error` — [`EtcdError`], [`EtcdErrorKind`] and the classification of failed calls;
// - `inner` — the broker's state, shared by the rooms below and the background tasks;
// - `layout` — every key and value in etcd, and the validation of what is read back;
// - `endpoints` — one client per member, calls sent to a member that answers;
// - `session` — renewal and loss: the session lease, `keep_alive`, tokens nobody keeps alive;
// - `acquire` — the idempotent first transaction, and the cleanup of an acquire given up;
// - `queue` — FIFO, work-conserving, herd-free waiting;
// - `watches` — one watch stream per broker, shared by its waiters;
// - `slots` — the broker's watch of the slot keys (deletions) while it has waiters;
// - `release` — the hand-off to the next waiter, and releases settled in the background;
// - `trust_tests` — a property test of the decoding and decision functions over arbitrary
//   pools.

mod acquire;
mod config;
mod endpoints;
mod error;
mod inner;
mod layout;
mod queue;
mod records;
mod release;
mod session;
mod slots;
#[cfg(test)]
mod trust_tests;
mod txn;
mod watches;

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use etcd_client::ConnectOptions;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use leasehold::{AcquireRequest, BrokerError, BrokerEvents, SlotBroker, SlotToken};

pub use config::EtcdConfig;
pub use error::{EtcdError, EtcdErrorKind};
/// The etcd client this broker is built on, for the types its configuration takes (say
/// [`etcd_client::TlsOptions`] for [`EtcdConfig::tls`], feature `tls`).
pub use etcd_client;

use endpoints::Endpoints;
use inner::{Inner, Places};
use layout::Layout;

/// A [`SlotBroker`] whose slots live in etcd and are shared by every broker (in any process,
/// on any host) configured with the same endpoints, key prefix and pool.
///
/// Create it with [`EtcdBroker::connect`] and hand it to
/// [`SupervisorBuilder::broker`](leasehold::SupervisorBuilder::broker) (an `Arc<EtcdBroker>` works
/// too, to keep observing it).
///
/// # Layout
///
/// Everything lives under `{key_prefix}/{pool}/`, and nothing else may:
///
/// | key | value | lease |
/// |---|---|---|
/// | `capacity` | `leasehold/v1 capacity=N` | none: written once, compared by every broker |
/// | `request/{rk:016x}` | `leasehold/v1 request granted slot=N[ next=…]` or `… abandoned` (none while the request waits) | the broker's session |
/// | `queue/{qk:016x}` | `leasehold/v1 waiter owner=… request={rk:016x}` | the waiter's session |
/// | `slot/{index:06}` | `leasehold/v1 holder request={rk:016x}` | the holder's session |
///
/// `rk` is derived from the broker's random owner id, the supervisor's
/// [`AcquireRequest::origin`] and its [`AcquireRequest::request_id`]; `qk` names a queue place
/// of this broker, reused once free.
///
/// # Protocol
///
/// Each broker keeps one etcd lease, its session, alive on one keep-alive stream; everything it
/// writes lives under it, so a process that dies loses its slots and queue places one TTL later.
/// An acquire on an idle pool is one transaction (claim a slot if nobody waits), a release one
/// more (delete the slot key if nobody waits): two consensus writes per lease. Both are named by
/// the request key, so a retry of an ambiguous call (or of the whole acquire with the same
/// request id) finds what the first attempt did and never takes a second slot.
///
/// Otherwise the acquire joins the queue (its queue key alone), ordered by the queue key's
/// create revision (FIFO). A release hands its slot straight to the oldest waiter in its own
/// transaction, writing the grant into the waiter's marker: no slot sits idle while someone
/// waits. The grant names the waiters after the grantee that the releaser knew, which the
/// grantee's own release chains over. The waiter watches only its own marker (on one watch
/// stream per broker) and takes the grant from that one event; no other process hears of it.
/// So a hand-off is one transaction, one raft proposal and one event, one round trip; steady
/// state costs two consensus writes per lease (the join and the release) and one watch event
/// (see `release`). A slot freed without a release (a holder's session expired) is deleted, and each
/// broker with waiters watches the slot keys for deletions: its waiters look for their place,
/// and the head claims it. A waiter keeps its place through outages and leader elections and
/// fails (`ETCD_SESSION_EXPIRED`) only when etcd says its session expired.
///
/// The token's lease id is the revision of the grant (the slot key's mod revision), strictly
/// increasing across the whole etcd cluster: a fencing token.
///
/// While a token is held the supervisor drives [`SlotBroker::keep_alive`], which resolves as
/// soon as the session may lapse before it can be renewed. A token that nobody keeps alive for
/// one TTL (and that is not released) is given back by the broker itself. A release whose
/// answer is lost is finished in the background; if it is found to have gone with its expired
/// session, it is reported through [`BrokerEvents::orphan_expired`]. Calls go to a member that
/// answers; a member that does not is skipped until a probe finds it healthy.
///
/// Nothing the broker reads grants a slot unless it was written for that request under the
/// waiter's own session: a waiter decides only from its own marker under its own session, taken
/// from its marker watch's event of the grant (the key it watches, a revision after its join),
/// or, when the marker was read instead, once its slot key says the same (request, session,
/// revision). A record of leasehold's layout that says
/// anything else is refused with a typed [`EtcdError`] (`ETCD_CORRUPT_RECORD`) and the refused
/// waiter leaves the queue; a key that is not part of the layout fails `connect`
/// (`ETCD_FOREIGN_KEY`) and is ignored afterwards (it counts as no slot and no waiter). A client
/// with write access to the pool can still forge a grant under a waiter's own session lease
/// (etcd lets any writer attach keys to any live lease): then only the fencing token orders the
/// two holders (see the crate's README). [`SlotBroker::close`] withdraws what is in flight and revokes the
/// session, awaited: a process that closes its broker before it exits leaves nothing in etcd.
///
/// # Examples
///
/// ```no_run
/// use leasehold::Supervisor;
/// use leasehold_etcd::{EtcdBroker, EtcdConfig};
///
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let config = EtcdConfig::new(["http://127.0.0.1:2379"], "render", 3);
/// let broker = EtcdBroker::connect(config).await?;
/// let sup = Supervisor::builder().broker(broker).start().await?;
/// let mut lease = sup.acquire().await?;
/// println!("fencing token {}", lease.lease_id()?);
/// lease.release().await?;
/// # Ok(()) }
/// ```
pub struct EtcdBroker {
    inner: Arc<Inner>,
}

impl fmt::Debug for EtcdBroker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdBroker")
            .field("prefix", &self.inner.layout.prefix())
            .field("capacity", &self.inner.layout.capacity())
            .field("ttl", &self.inner.ttl)
            .field("owner", &format_args!("{:016x}", self.inner.owner))
            .field("endpoints", &self.inner.endpoints)
            .finish_non_exhaustive()
    }
}

impl EtcdBroker {
    /// Connects, records the pool's capacity if the pool is new (or checks it against the one
    /// recorded), and checks that everything under the pool prefix is leasehold's.
    ///
    /// A pool is new only when nothing at all lies under its prefix: a capacity record that is
    /// missing while other keys are there (slots may be held) is refused, never re-created.
    /// The pool is created only if it does not lie inside another pool's prefix, in the same
    /// transaction (so no two pools' keys can nest, whichever connects first).
    ///
    /// # Errors
    ///
    /// [`EtcdError`]: `ETCD_INVALID_CONFIG`, `ETCD_UNAVAILABLE` (no answer within the connect
    /// bound and the retries), `ETCD_AUTH_FAILED`, `ETCD_TLS_FAILED`, `ETCD_CAPACITY_MISMATCH`
    /// (the pool exists with another capacity), `ETCD_CORRUPT_RECORD` (a record leasehold did
    /// not write, or the capacity record missing from a pool that has keys),
    /// `ETCD_FOREIGN_KEY` or `ETCD_POOL_NESTED` (the pool lies inside another).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it writes at most the capacity record, which a later connect reads back.
    pub async fn connect(config: EtcdConfig) -> Result<Self, EtcdError> {
        config.validate()?;
        let mut options = ConnectOptions::new()
            .with_timeout(config.rpc_timeout)
            .with_connect_timeout(config.connect_timeout)
            .with_keep_alive(Duration::from_secs(5), config.rpc_timeout)
            .with_require_leader(true);
        if let Some((name, password)) = &config.user {
            options = options
                .with_user(name.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        #[cfg(feature = "tls")]
        if let Some(tls) = config.tls.clone() {
            options = options.with_tls(tls);
        }
        let owner = {
            let mut h = std::hash::RandomState::new().build_hasher();
            h.write_u32(std::process::id());
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            h.finish()
        };
        let layout = Layout::new(&config.key_prefix, &config.pool, config.capacity);
        // Processes start on different members, spreading the load.
        let endpoints = Endpoints::new(
            &config.endpoints,
            options,
            config.connect_timeout,
            config.rpc_timeout,
            layout.capacity_key(),
            owner as usize,
        );
        let hub = watches::Hub::new(
            Arc::clone(&endpoints),
            layout.capacity_key(),
            config.retry_for,
        );
        let inner = Arc::new(Inner {
            #[cfg(feature = "fault-injection")]
            hold_watches: tokio::sync::watch::Sender::new(false),
            #[cfg(feature = "fault-injection")]
            hold_refreshes: AtomicBool::new(false),
            hub,
            layout,
            endpoints,
            ttl: config.ttl,
            rpc_timeout: config.rpc_timeout,
            retry_for: config.retry_for,
            connect_timeout: config.connect_timeout,
            owner,
            session: Mutex::new(None),
            granting: tokio::sync::Mutex::new(()),
            held: Mutex::new(HashMap::new()),
            released: tokio::sync::Notify::new(),
            releases: AtomicU64::new(0),
            forgotten: Mutex::new(VecDeque::new()),
            hint: AtomicU32::new((owner % u64::from(config.capacity)) as u32),
            heads: Mutex::new(Vec::new()),
            refreshing: AtomicBool::new(false),
            refreshed: tokio::sync::Notify::new(),
            filling: AtomicBool::new(false),
            frees: tokio::sync::watch::Sender::new(0),
            slots_ctl: Mutex::new(records::SlotsCtl::default()),
            slot_view: Mutex::new(records::SlotView::default()),
            slot_seen: tokio::sync::watch::Sender::new(0),
            contended: AtomicBool::new(false),
            places: Mutex::new(Places::default()),
            abandoned: Mutex::new(HashMap::new()),
            orphans_expired: AtomicU64::new(0),
            settling: AtomicUsize::new(0),
            settling_requests: Mutex::new(HashMap::new()),
            rt: tokio::runtime::Handle::current(),
            events: Mutex::new(Vec::new()),
            attached: Mutex::new(0),
            flights: Mutex::new(HashMap::new()),
            tasks: TaskTracker::new(),
            closed: CancellationToken::new(),
            close_done: tokio::sync::Mutex::new(false),
            revoked: Arc::new(AtomicBool::new(false)),
            closing: CancellationToken::new(),
        });
        #[cfg(feature = "tls")]
        let tls = config.tls.is_some();
        #[cfg(not(feature = "tls"))]
        let tls = false;
        inner.ensure_capacity().await.map_err(|mut e| {
            if tls && e.kind() == EtcdErrorKind::Unavailable {
                // A TLS server that refuses the client's certificate (or its absence) just
                // closes the connection: say what it may have been.
                e.message.push_str(
                    " (over TLS: the server may require a client certificate, or have refused this one)",
                );
            }
            e
        })?;
        Ok(Self { inner })
    }

    /// Releases whose answer was lost and that were later found to have gone with this broker's
    /// expired session (their TTL, not a release, ended them).
    pub fn orphans_expired(&self) -> u64 {
        self.inner.orphans_expired.load(Ordering::Relaxed)
    }

    /// Slots this broker is giving back in the background: releases whose answer was lost (or
    /// whose future was dropped), and tokens nobody kept alive for a TTL (for tools and tests).
    pub fn settling(&self) -> usize {
        self.inner.settling.load(Ordering::Acquire)
    }

    /// The pool's key prefix (`{key_prefix}/{pool}/`).
    pub fn pool_prefix(&self) -> &str {
        self.inner.layout.prefix()
    }

    /// The etcd lease (this broker's session) behind a token it holds (for tools and tests).
    pub fn etcd_lease_of(&self, token: SlotToken) -> Option<i64> {
        self.inner.held.lock().get(&token).map(|h| h.session.id)
    }

    /// The etcd lease of this broker's live session, if it has one (for tools and tests).
    pub fn session_lease(&self) -> Option<i64> {
        self.inner
            .session
            .lock()
            .as_ref()
            .filter(|s| !s.is_expired())
            .map(|s| s.id)
    }

    /// Unstable test support (feature `fault-injection`, not covered by semantic versioning):
    /// the queue key an acquire with this request waits under, `None` while the acquire is not
    /// in flight. Its place is chosen at its first transaction and
    /// given up once it is granted or withdrawn; the key exists in etcd while it waits.
    #[cfg(feature = "fault-injection")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
    pub fn queue_key_for(&self, request: &AcquireRequest) -> Option<String> {
        let rk = self.inner.request_key(request);
        self.inner
            .place_if_any(rk)
            .map(|place| self.inner.layout.queue_key(place))
    }

    /// Unstable test support (feature `fault-injection`, not covered by semantic versioning):
    /// asks etcd to cancel every watch of the broker's watch stream, as etcd does on its own to
    /// a watch that a compaction passed, and returns how many once etcd has answered. The
    /// broker sets each up again.
    #[cfg(feature = "fault-injection")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
    pub async fn cancel_watches_on_server(&self) -> usize {
        self.inner.hub.cancel_on_server().await
    }

    /// Unstable test support (feature `fault-injection`, not covered by semantic versioning):
    /// how many watches of the broker etcd has said are in place (each waiter's marker, the
    /// slot keys', a waiter's predecessor's).
    #[cfg(feature = "fault-injection")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
    pub fn watch_count(&self) -> usize {
        self.inner.hub.watch_count()
    }

    /// Unstable test support (feature `fault-injection`, not covered by semantic versioning):
    /// how many watch events etcd has delivered to this broker's watches.
    #[cfg(feature = "fault-injection")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
    pub fn watch_events_received(&self) -> u64 {
        self.inner
            .hub
            .events_routed
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Unstable test support (feature `fault-injection`, not covered by semantic versioning):
    /// while `true`, an acquire that joined the queue waits before it sets up its marker's
    /// watch (so that a grant can land before the watch is in place).
    #[cfg(feature = "fault-injection")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
    pub fn hold_marker_watches(&self, hold: bool) {
        self.inner.hold_watches.send_replace(hold);
    }

    /// Unstable test support (feature `fault-injection`, not covered by semantic versioning):
    /// while `true`, the broker makes no background read of the queue's oldest waiters (its
    /// releases chain over what grants named, and what their own transactions read).
    #[cfg(feature = "fault-injection")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
    pub fn hold_queue_reads(&self, hold: bool) {
        self.inner.hold_refreshes.store(hold, Ordering::Relaxed);
    }

    /// Unstable test support (feature `fault-injection`, not covered by semantic versioning):
    /// how many watches etcd cancelled that the broker set up again.
    #[cfg(feature = "fault-injection")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
    pub fn watches_recreated(&self) -> u64 {
        self.inner
            .hub
            .recreated
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Unstable test support (feature `fault-injection`, not covered by semantic versioning):
    /// how many cancellations etcd sent for watches of this broker that their owners still
    /// held (a compaction passed them, a server-side cancel).
    #[cfg(feature = "fault-injection")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
    pub fn watch_cancels_received(&self) -> u64 {
        self.inner
            .hub
            .cancels_seen
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Unstable test support (feature `fault-injection`, not covered by semantic versioning):
    /// how many creates of a watch etcd refused (each is tried again under a new id).
    #[cfg(feature = "fault-injection")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
    pub fn watch_refusals(&self) -> u64 {
        self.inner
            .hub
            .refusals
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Unstable test support (feature `fault-injection`, not covered by semantic versioning):
    /// while `true`, a watch etcd ended is set up again under its old watch id, without
    /// cancelling it first (which etcd refuses when it kept the id, as after a compaction).
    #[cfg(feature = "fault-injection")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
    pub fn reuse_watch_ids(&self, reuse: bool) {
        self.inner
            .hub
            .reuse_ids
            .store(reuse, std::sync::atomic::Ordering::Relaxed);
    }

    /// Unstable test support (feature `fault-injection`, not covered by semantic versioning):
    /// the request marker an acquire with this request writes first. It exists from the
    /// acquire's first transaction until the release.
    #[cfg(feature = "fault-injection")]
    #[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
    pub fn request_key_for(&self, request: &AcquireRequest) -> String {
        self.inner
            .layout
            .request_key(self.inner.request_key(request))
    }
}

impl SlotBroker for EtcdBroker {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        self.inner
            .acquire(&request)
            .await
            .map_err(EtcdError::into_broker)
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.inner.release(token).await
    }

    fn capacity(&self) -> Option<u32> {
        Some(self.inner.layout.capacity())
    }

    fn renews(&self) -> bool {
        true
    }

    async fn keep_alive(&self, token: SlotToken) -> BrokerError {
        self.inner.keep_alive(token).await.into_broker()
    }

    fn attach(&self, events: BrokerEvents) {
        *self.inner.attached.lock() += 1;
        self.inner.events.lock().push(events);
    }

    /// Withdraws every acquire still in flight (their queue places go, a slot granted
    /// meanwhile is passed on to the next waiter), lets the releases still settling in the
    /// background finish (bounded by twice the call timeout), then revokes the session —
    /// every key still under it goes with it, at once, not one TTL later — and waits for
    /// etcd's answer (retried for `retry_for`). Afterwards acquires fail with
    /// `ETCD_BROKER_CLOSED` and no session is granted again.
    ///
    /// Counted per supervisor attached to the broker: with several, each close ends one of
    /// them and only the last closes the broker; with none (a broker used directly), the first
    /// close does. Closing a closed broker answers `Ok` at once.
    ///
    /// # Errors
    ///
    /// `ETCD_UNAVAILABLE` when etcd did not confirm the revoke: the session, and whatever is
    /// under it, then goes with its TTL.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the broker is closed from the first poll on; dropped before the revoke was
    /// answered, the session is left to its TTL (or to the revoke the broker's drop sends).
    async fn close(&self) -> Result<(), BrokerError> {
        {
            let mut attached = self.inner.attached.lock();
            if *attached > 1 {
                *attached -= 1;
                return Ok(());
            }
            *attached = 0;
        }
        self.inner.close().await.map_err(EtcdError::into_broker)
    }
}
