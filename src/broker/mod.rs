//! Where slot tokens come from: the [`SlotBroker`] contract, its in-process implementation
//! [`LocalBroker`], and how to write and check a broker of your own.
//!
//! # The embedded default and distributed slots
//!
//! `.slots(n)` (or `.gpu(..)` alone) uses the in-process [`LocalBroker`]: slots live in this
//! process, lease ids increase strictly (fencing tokens), and nothing outside the process is
//! involved — no service to run, nothing to configure. Its limit is the process: if the process is
//! killed, its slots die with it, which is fine because no one else shared them.
//!
//! When several processes or hosts must share one pool (a licence pool, a render farm), the slots
//! must come from a distributed engine instead: any [`SlotBroker`] can be passed with `.broker(b)`,
//! and the supervisor then runs the same pipeline against it, with request ids for retrying an
//! ambiguous acquire and the lease id as a fencing token. leasehold ships one, on etcd: the crate
//! [`leasehold-etcd`](https://docs.rs/leasehold-etcd) (in this repository's `etcd/`) holds
//! `EtcdBroker`, built on the contract below and nothing else, and passing the same conformance
//! suite; [the etcd guide](crate::guide::etcd) says what it offers and how to run it.
//!
//! # Custom brokers
//!
//! `.slots(n)` uses the in-process [`LocalBroker`]. Any [`SlotBroker`] can replace it with
//! `.broker(b)`; the broker then decides capacity. The supervisor calls a broker; a broker knows
//! nothing about workers. Both methods may be written as `async fn`. The supervisor polls a broker
//! future once inline and, if it is not ready, moves it to a task of its own: a broker that awaits
//! the network never holds up the supervisor's mailbox (it must not block the thread inside a
//! poll, though).
//!
//! A broker is code leasehold did not write, so every call into it is caught and bounded. A panic
//! in any call, at any await point (or while its future is dropped), is caught and becomes a
//! [`BrokerError`] of kind [`Panicked`](BrokerErrorKind::Panicked) (code `BROKER_PANICKED`): an
//! acquire that panics fails (`LEASE_ACQUIRE_FAILED`), a release that panics counts as failed
//! (`LEASE_CLEANUP_FAILED`, once: the token is never released twice), and a renewal that panics is
//! a lost lease. A release or a close that hangs is dropped at the cleanup timeout. A close that
//! fails, hangs or panics lets `shutdown()` return, and
//! [`ShutdownReport::broker_close_failed`](crate::ShutdownReport::broker_close_failed) says why. In
//! every case the other slots keep serving.
//!
//! A broker whose leases lapse unless renewed (a TTL) says so with `renews() -> true` and
//! implements `keep_alive(token)`: a future the supervisor polls while the lease is held, which
//! resolves only when the lease is lost or may lapse; the supervisor then cancels the job and
//! reports `LEASE_LOST`. `attach(events)` hands the broker a [`BrokerEvents`] to report orphaned
//! leases it saw expire. All three have defaults (no renewal, nothing reported), so a broker that
//! needs none of this implements only `acquire` and `release`. A broker shared by several
//! supervisors (pass `Arc<B>`) keys idempotency on `(request.origin(), request.request_id())`.
//!
//! ```rust
//! # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
//! use std::collections::HashMap;
//! use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
//! use std::sync::{Arc, Mutex};
//!
//! use leasehold::{AcquireRequest, BrokerError, JobSpec, SlotBroker, SlotToken, Supervisor};
//!
//! /// Slots from a free list; lease ids increase strictly, so they can serve as fencing tokens.
//! /// Each held slot knows its lease: a token that is not (or no longer) the holder's is refused.
//! struct ToyBroker {
//!     slots: Mutex<(Vec<u32>, HashMap<u32, u64>)>,
//!     next_lease: AtomicU64,
//!     refuse_releases: Arc<AtomicBool>,
//! }
//!
//! impl SlotBroker for ToyBroker {
//!     async fn acquire(&self, _request: AcquireRequest) -> Result<SlotToken, BrokerError> {
//!         let (free, held) = &mut *self.slots.lock().unwrap();
//!         let slot = free.pop().ok_or_else(|| BrokerError::unavailable("no free slot"))?;
//!         let lease = self.next_lease.fetch_add(1, Ordering::Relaxed);
//!         held.insert(slot, lease);
//!         Ok(SlotToken::new(slot, lease))
//!     }
//!
//!     async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
//!         if self.refuse_releases.load(Ordering::Relaxed) {
//!             return Err(BrokerError::new("coordinator refused the release"));
//!         }
//!         let (free, held) = &mut *self.slots.lock().unwrap();
//!         if held.get(&token.slot_id()) != Some(&token.lease_id()) {
//!             return Err(BrokerError::invalid_response(format!("{token} is not held")));
//!         }
//!         held.remove(&token.slot_id());
//!         free.push(token.slot_id());
//!         Ok(())
//!     }
//!
//!     fn capacity(&self) -> Option<u32> {
//!         Some(2) // optional; with a known capacity the supervisor never asks for more at once
//!     }
//! }
//!
//! let refuse = Arc::new(AtomicBool::new(false));
//! let broker = ToyBroker {
//!     slots: Mutex::new((vec![1, 0], HashMap::new())),
//!     next_lease: AtomicU64::new(1),
//!     refuse_releases: Arc::clone(&refuse),
//! };
//! let sup = Supervisor::builder().broker(broker).start().await?;
//!
//! let slot = sup
//!     .run(JobSpec::new("render-0001")?, |ctx| async move { Ok::<_, std::io::Error>(ctx.slot_id()) })
//!     .await?;
//! assert_eq!(slot, 0);
//!
//! // When both the body and the release fail, neither error is lost.
//! refuse.store(true, Ordering::Relaxed);
//! let err = sup
//!     .run(JobSpec::new("render-0002")?, |_ctx| async {
//!         Err::<(), _>(std::io::Error::other("render failed"))
//!     })
//!     .await
//!     .unwrap_err();
//! assert_eq!(err.code(), "LEASE_BODY_AND_CLEANUP_FAILED");
//! assert_eq!(err.body_error().unwrap().error().unwrap().to_string(), "render failed");
//! assert_eq!(err.cleanup_error().unwrap().code(), "LEASE_CLEANUP_FAILED");
//!
//! let report = sup.shutdown().await?;
//! assert_eq!(report.stats.release_failed_total, 1);
//! # // The example broker keeps the contract: the conformance suite passes it.
//! # leasehold::conformance::Conformance::new(|| async {
//! #     ToyBroker {
//! #         slots: Mutex::new((vec![1, 0], HashMap::new())),
//! #         next_lease: AtomicU64::new(1),
//! #         refuse_releases: Arc::new(AtomicBool::new(false)),
//! #     }
//! # })
//! # .run()
//! # .await
//! # .assert_passed();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! ## Checking a broker: the conformance suite
//!
//! With the `conformance` feature, `leasehold::conformance` checks that your broker keeps each
//! promise of the `SlotBroker` contract (listed in [the trait's docs](SlotBroker)), one check per
//! promise: capacity (with acquires beyond it in flight at once, from several supervisors and
//! directly), no double grant, fencing (a slot's lease id increases from one holder to the next),
//! release, FIFO (for a broker that makes acquires wait), cancel safety (acquires dropped at each
//! await point, while they wait, and as a slot is handed to them), bad tokens (foreign, released
//! twice, stale after a new holder), close (a second close answers `Ok` at once), lost leases (for
//! a broker that renews, given a way to make it lose one) and supervised (jobs through two
//! supervisors sharing the broker all end). It drives a fresh broker from your async factory for
//! each part, both directly and through real supervisors, and watches every call. A check that does
//! not apply is reported as skipped, with the reason. Its own tests hold a gallery of brokers that
//! each break one promise, and each fails exactly that check; the etcd broker and the in-process
//! one pass it in CI.
//!
//! ```rust
//! # tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap().block_on(async {
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::sync::Mutex;
//!
//! use leasehold::conformance::Conformance;
//! use leasehold::{AcquireRequest, BrokerError, SlotBroker, SlotToken};
//!
//! /// Two slots; each slot knows the lease that holds it, so a token that is not (or no longer)
//! /// the holder's is refused.
//! struct TwoSlots {
//!     holders: Mutex<[Option<u64>; 2]>,
//!     next_lease: AtomicU64,
//! }
//!
//! impl SlotBroker for TwoSlots {
//!     async fn acquire(&self, _request: AcquireRequest) -> Result<SlotToken, BrokerError> {
//!         let mut holders = self.holders.lock().unwrap();
//!         let slot = holders.iter().position(Option::is_none);
//!         let slot = slot.ok_or_else(|| BrokerError::unavailable("no free slot"))?;
//!         let lease = self.next_lease.fetch_add(1, Ordering::Relaxed);
//!         holders[slot] = Some(lease);
//!         Ok(SlotToken::new(slot as u32, lease))
//!     }
//!
//!     async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
//!         let mut holders = self.holders.lock().unwrap();
//!         match holders.get_mut(token.slot_id() as usize) {
//!             Some(holder) if *holder == Some(token.lease_id()) => {
//!                 *holder = None;
//!                 Ok(())
//!             }
//!             _ => Err(BrokerError::invalid_response(format!("{token} is not held"))),
//!         }
//!     }
//!
//!     fn capacity(&self) -> Option<u32> {
//!         Some(2)
//!     }
//! }
//!
//! let report = Conformance::new(|| async {
//!     TwoSlots { holders: Mutex::new([None, None]), next_lease: AtomicU64::new(1) }
//! })
//! .run()
//! .await;
//! report.assert_passed(); // prints the skipped checks: `lost leases` (it renews nothing)
//! # });
//! ```

mod erased;
mod local;

use std::fmt;
use std::future::Future;
use std::sync::Arc;

pub use local::LocalBroker;
pub(crate) use local::Pool;

pub(crate) use erased::DynBroker;

/// One slot held under one lease. A plain `Copy` value; the lease id doubles as a fencing token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotToken {
    slot_id: u32,
    lease_id: u64,
}

impl SlotToken {
    /// A token for `slot_id` held under `lease_id`.
    pub const fn new(slot_id: u32, lease_id: u64) -> Self {
        Self { slot_id, lease_id }
    }

    /// Which slot.
    pub const fn slot_id(&self) -> u32 {
        self.slot_id
    }

    /// Which lease: unique among live leases, and a fencing token.
    ///
    /// Increasing lease ids are **required** of every broker, not optional: each grant of a
    /// slot carries a lease id greater than every lease id that slot was granted under before
    /// (the brokers leasehold ships increase them across all slots). That is what lets the
    /// protected resource refuse a stale holder's writes
    /// ([`FencingGuard`](crate::FencingGuard)), and the conformance suite's `fencing` check
    /// fails a broker that breaks it.
    pub const fn lease_id(&self) -> u64 {
        self.lease_id
    }
}

impl fmt::Display for SlotToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "slot {} lease {}", self.slot_id, self.lease_id)
    }
}

/// What the supervisor asks a broker for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcquireRequest {
    request_id: u64,
    origin: u64,
    job_id: Option<Arc<str>>,
}

impl AcquireRequest {
    /// Builds a request; the supervisor makes one per broker acquire.
    pub fn new(request_id: u64, job_id: Option<&str>) -> Self {
        Self {
            request_id,
            origin: 0,
            job_id: job_id.map(Arc::from),
        }
    }

    /// The supervisor's request: the job id is shared, not copied.
    pub(crate) fn for_job(request_id: u64, job_id: Option<Arc<str>>) -> Self {
        Self {
            request_id,
            origin: 0,
            job_id,
        }
    }

    /// Sets the requester's identity (see [`origin`](Self::origin)).
    pub fn with_origin(mut self, origin: u64) -> Self {
        self.origin = origin;
        self
    }

    /// Which supervisor asked: random per supervisor (0 when built by hand). Request ids are
    /// only unique per supervisor, so a broker shared by several supervisors keys idempotency
    /// on `(origin, request_id)`.
    pub fn origin(&self) -> u64 {
        self.origin
    }

    /// Unique per supervisor and per acquire: the idempotency key a broker uses to recognise the
    /// retry of an ambiguous acquire.
    pub fn request_id(&self) -> u64 {
        self.request_id
    }

    /// The id of the job at the head of the queue when the request was made (`None` for an
    /// explicit [`Lease`](crate::Lease)). Tokens are fungible: the token may go to another waiter
    /// if this one has left.
    pub fn job_id(&self) -> Option<&str> {
        self.job_id.as_deref()
    }
}

/// A source of slot tokens.
///
/// Implementations may write `async fn` for both methods.
///
/// # The contract
///
/// A broker keeps these promises; the supervisor's guarantees rest on them, and the
/// conformance suite (`leasehold::conformance`, feature `conformance`) has one check for each,
/// named in brackets:
///
/// - **Capacity** (`capacity`). A broker whose `capacity()` is `Some(n)` never has more than
///   `n` tokens granted and not yet released, however many acquires are in flight at once,
///   from one supervisor or several.
/// - **No double grant** (`no double grant`). A broker never grants a slot that is still held,
///   and never hands out a lease id that a live token carries. The supervisor checks anyway and
///   refuses such a token (nothing is granted, and the refused token is *not* released, since
///   releasing it could free the live holder's slot).
/// - **Fencing** (`fencing`). Each grant of a slot carries a lease id greater than every lease
///   id that slot was granted under before (see [`SlotToken::lease_id`]).
/// - **Release** (`release`). A release of a token the broker granted answers `Ok`, and the
///   slot can be granted again.
/// - **FIFO** (`fifo`). A broker that makes acquires wait while every slot is held serves them
///   in the order they arrived. (A broker may instead refuse when every slot is held, as
///   [`LocalBroker`] does.)
/// - **Cancel safety** (`cancel safety`). An acquire dropped at any await point — before it
///   answers, while it waits, or as a slot is being handed to it — takes nothing: a slot it had
///   taken goes back, or to the next waiter. The supervisor drops an acquire nobody needs any
///   more.
/// - **Bad tokens** (`bad tokens`). A release of a token the broker did not grant, of one
///   already released, or of a stale one (its slot now has a newer holder) is refused with an
///   error, and takes nothing from the current holder.
/// - **Close** (`close`). Closing again answers `Ok` at once (see [`close`](Self::close)).
/// - **Lost leases** (`lost leases`). For a broker that [`renews`](Self::renews): the
///   [`keep_alive`](Self::keep_alive) future resolves when the lease is lost, and not while a
///   freshly granted lease is held and nothing was lost.
/// - **Ordinary futures** (`supervised`). Its futures are ordinary futures: each poll registers
///   the waker it is given (the supervisor polls an acquire once with a no-op waker before it
///   hands the future to a task), and nothing blocks the thread inside a poll.
///
/// # Examples
///
/// ```
/// use leasehold::{AcquireRequest, BrokerError, SlotBroker, SlotToken};
///
/// struct OneSlot;
///
/// impl SlotBroker for OneSlot {
///     async fn acquire(&self, _request: AcquireRequest) -> Result<SlotToken, BrokerError> {
///         Ok(SlotToken::new(0, 1))
///     }
///     async fn release(&self, _token: SlotToken) -> Result<(), BrokerError> {
///         Ok(())
///     }
/// }
/// ```
pub trait SlotBroker: Send + Sync + 'static {
    /// Takes a slot. May wait (a remote broker queues); the supervisor never awaits it inside its
    /// mailbox.
    fn acquire(
        &self,
        request: AcquireRequest,
    ) -> impl Future<Output = Result<SlotToken, BrokerError>> + Send;

    /// Gives a slot back. Called exactly once per granted token, bounded by the supervisor's
    /// cleanup timeout (the future is dropped when it runs out).
    fn release(&self, token: SlotToken) -> impl Future<Output = Result<(), BrokerError>> + Send;

    /// How many slots this broker has, when it knows. With `Some(n)` the supervisor never asks
    /// for more than `n` tokens at once and refuses `n == 0` at start; with `None` (the default)
    /// it asks once per waiting job and the broker alone decides.
    fn capacity(&self) -> Option<u32> {
        None
    }

    /// Whether this broker's leases lapse unless they are kept alive (a distributed broker's
    /// TTL). `false` by default: the supervisor then never calls
    /// [`keep_alive`](Self::keep_alive) and pays nothing for it.
    fn renews(&self) -> bool {
        false
    }

    /// Keeps the lease behind `token` alive, and reports its loss.
    ///
    /// Called once per granted token when [`renews`](Self::renews) is `true`, right after the
    /// grant. The supervisor polls the future (on a task of its own) while the lease is held —
    /// through the worker's run and its physical cleanup — and drops it when the lease's
    /// release begins: renewal stops there, and the release (or, failing that, the TTL) ends
    /// the lease.
    ///
    /// The future resolves **only** when the lease is lost, or may lapse before it can be
    /// renewed again; its output says why. The supervisor then cancels the lease's job at once,
    /// and the job's result carries `LEASE_LOST` (the protected resource should also refuse the
    /// lost lease's fencing token, see [`FencingGuard`](crate::FencingGuard)); a loss after the
    /// worker has ended is only logged. The default never resolves.
    fn keep_alive(&self, token: SlotToken) -> impl Future<Output = BrokerError> + Send {
        let _ = token;
        std::future::pending()
    }

    /// Hands the broker a channel to report what happens to its leases outside any call (an
    /// orphaned lease that expired). Called once by each supervisor started on this broker,
    /// before its first acquire. The default ignores it.
    fn attach(&self, events: BrokerEvents) {
        let _ = events;
    }

    /// Closes the broker, awaited: what it still has in flight for its callers is withdrawn,
    /// and what it keeps on its own behalf (a distributed broker's session, and every key
    /// under it) is given up, so that a process that returns from `main` right after leaves
    /// nothing behind for others to wait out. The default does nothing.
    ///
    /// It belongs at the end of a supervisor's life, once its `shutdown` has released every
    /// lease: a supervisor's [`shutdown`](crate::Supervisor::shutdown) awaits it, under the
    /// cleanup timeout, before it answers (call it yourself on a broker used without a
    /// supervisor). A broker shared by several supervisors closes
    /// at the last of them: `leasehold_etcd::EtcdBroker` counts the supervisors
    /// [attached](Self::attach) to it, and each close ends one of them. A closed broker may
    /// refuse acquires; closing again answers `Ok` at once. The caller bounds it (the
    /// supervisor by its cleanup timeout): a close cut short leaves the rest to the broker's
    /// own expiry (a TTL).
    ///
    /// # Errors
    ///
    /// The broker could not confirm that everything is given up (say, etcd did not answer):
    /// what is left goes with the broker's expiry.
    ///
    /// # Cancel safety
    ///
    /// The default is. A broker's own close should be too: dropping the future leaves the
    /// broker closed, and what it had not yet given up to its expiry.
    fn close(&self) -> impl Future<Output = Result<(), BrokerError>> + Send {
        std::future::ready(Ok(()))
    }
}

/// A shared broker: keep an `Arc` to observe the broker while a supervisor uses it (say
/// `EtcdBroker::orphans_expired`), or share one broker between supervisors.
impl<B: SlotBroker> SlotBroker for Arc<B> {
    fn acquire(
        &self,
        request: AcquireRequest,
    ) -> impl Future<Output = Result<SlotToken, BrokerError>> + Send {
        (**self).acquire(request)
    }

    fn release(&self, token: SlotToken) -> impl Future<Output = Result<(), BrokerError>> + Send {
        (**self).release(token)
    }

    fn capacity(&self) -> Option<u32> {
        (**self).capacity()
    }

    fn renews(&self) -> bool {
        (**self).renews()
    }

    fn keep_alive(&self, token: SlotToken) -> impl Future<Output = BrokerError> + Send {
        (**self).keep_alive(token)
    }

    fn attach(&self, events: BrokerEvents) {
        (**self).attach(events)
    }

    fn close(&self) -> impl Future<Output = Result<(), BrokerError>> + Send {
        (**self).close()
    }
}

/// What a broker may report to the supervisor on its own (see [`SlotBroker::attach`]).
///
/// Cloneable and cheap; reports after the supervisor has stopped are ignored.
#[derive(Clone)]
pub struct BrokerEvents {
    origin: u64,
    sink: Arc<dyn Fn(BrokerEvent) + Send + Sync>,
}

/// One report carried by [`BrokerEvents`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BrokerEvent {
    /// A lease that nobody held any more (its acquire was given up, or its release's answer
    /// was lost) was seen to have expired: the broker's TTL, not a release, ended it. Counted in
    /// `orphan_expired_total` and `render_slot.orphan_expired.count`.
    OrphanExpired {
        /// The broker's own id for the expired lease.
        lease_id: u64,
    },
}

impl BrokerEvents {
    /// Events delivered to `sink` (the supervisor builds one for each broker it starts on;
    /// public so that a broker can be tested on its own).
    pub fn new(sink: impl Fn(BrokerEvent) + Send + Sync + 'static) -> Self {
        Self {
            origin: 0,
            sink: Arc::new(sink),
        }
    }

    /// Ties these events to one supervisor's [`AcquireRequest::origin`]: a broker shared by
    /// several supervisors reports a lease's events only to the one that asked for it.
    pub fn with_origin(mut self, origin: u64) -> Self {
        self.origin = origin;
        self
    }

    /// The supervisor these events go to (0: any).
    pub fn origin(&self) -> u64 {
        self.origin
    }

    /// Reports that an orphaned lease expired.
    pub fn orphan_expired(&self, lease_id: u64) {
        (self.sink)(BrokerEvent::OrphanExpired { lease_id });
    }
}

impl fmt::Debug for BrokerEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BrokerEvents").finish_non_exhaustive()
    }
}

/// Why a broker call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BrokerErrorKind {
    /// A generic failure.
    Other,
    /// The call did not finish in time.
    Timeout,
    /// The broker cannot serve now (no free slot, coordinator down).
    Unavailable,
    /// The effect may or may not have happened (the answer was lost).
    DeliveryUnknown,
    /// The broker answered something the supervisor refuses (a token already live).
    InvalidResponse,
    /// The broker's call panicked (while building its future, in a poll, or when dropped at
    /// its bound). The supervisor caught it: the acquire failed, or the release counts as
    /// failed, and every other slot keeps serving. Its code is [`BrokerError::PANICKED`].
    Panicked,
}

/// A failure reported by a [`SlotBroker`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerError {
    kind: BrokerErrorKind,
    code: Option<&'static str>,
    message: String,
}

impl BrokerError {
    /// A generic failure.
    pub fn new(message: impl Into<String>) -> Self {
        Self::with_kind(BrokerErrorKind::Other, message)
    }

    /// The call did not finish in time.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::with_kind(BrokerErrorKind::Timeout, message)
    }

    /// The broker cannot serve now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::with_kind(BrokerErrorKind::Unavailable, message)
    }

    /// The effect may or may not have happened.
    pub fn delivery_unknown(message: impl Into<String>) -> Self {
        Self::with_kind(BrokerErrorKind::DeliveryUnknown, message)
    }

    /// The broker's answer was refused by the supervisor.
    pub fn invalid_response(message: impl Into<String>) -> Self {
        Self::with_kind(BrokerErrorKind::InvalidResponse, message)
    }

    /// The stable code of a broker call that panicked ([`BrokerErrorKind::Panicked`]).
    pub const PANICKED: &'static str = "BROKER_PANICKED";

    /// The broker's call panicked with `message`; the supervisor builds this itself when it
    /// catches the panic.
    pub fn panicked(message: impl Into<String>) -> Self {
        Self::with_kind(BrokerErrorKind::Panicked, message).with_code(Self::PANICKED)
    }

    fn with_kind(kind: BrokerErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            code: None,
            message: message.into(),
        }
    }

    /// Attaches the broker's own stable code (say `ETCD_FOREIGN_KEY`), shown before the
    /// message.
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The broker's own stable code, when it gave one.
    pub fn code(&self) -> Option<&'static str> {
        self.code
    }

    /// What kind of failure.
    pub fn kind(&self) -> BrokerErrorKind {
        self.kind
    }

    /// The broker's message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for BrokerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            BrokerErrorKind::Other => "broker error",
            BrokerErrorKind::Timeout => "broker timed out",
            BrokerErrorKind::Unavailable => "broker unavailable",
            BrokerErrorKind::DeliveryUnknown => "broker delivery unknown",
            BrokerErrorKind::InvalidResponse => "invalid broker response",
            BrokerErrorKind::Panicked => "broker panicked",
        };
        match self.code {
            Some(code) => write!(f, "{what}: {code}: {}", self.message),
            None => write!(f, "{what}: {}", self.message),
        }
    }
}

impl std::error::Error for BrokerError {}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::task::{Context, Poll, Waker};

    use super::*;

    /// A broker that says something of its own for every call the trait has.
    #[derive(Default)]
    struct Talkative {
        attached: AtomicU64,
    }

    impl SlotBroker for Talkative {
        async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
            Ok(SlotToken::new(7, request.request_id()))
        }

        async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
            Err(BrokerError::new(format!("kept {token}")))
        }

        fn capacity(&self) -> Option<u32> {
            Some(5)
        }

        fn renews(&self) -> bool {
            true
        }

        async fn keep_alive(&self, token: SlotToken) -> BrokerError {
            BrokerError::unavailable(format!("{token} lost"))
        }

        fn attach(&self, events: BrokerEvents) {
            self.attached.store(events.origin(), Ordering::Relaxed);
        }

        async fn close(&self) -> Result<(), BrokerError> {
            Err(BrokerError::timeout("close"))
        }
    }

    /// A broker that keeps every default.
    struct Plain;

    impl SlotBroker for Plain {
        async fn acquire(&self, _request: AcquireRequest) -> Result<SlotToken, BrokerError> {
            Ok(SlotToken::new(0, 1))
        }

        async fn release(&self, _token: SlotToken) -> Result<(), BrokerError> {
            Ok(())
        }
    }

    fn now<F: Future>(fut: F) -> Poll<F::Output> {
        std::pin::pin!(fut).poll(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn an_arc_of_a_broker_forwards_every_call_of_the_trait() {
        let broker = Arc::new(Talkative::default());
        let request = AcquireRequest::new(42, Some("job"));
        assert_eq!(
            now(broker.acquire(request)),
            Poll::Ready(Ok(SlotToken::new(7, 42)))
        );
        let token = SlotToken::new(1, 2);
        assert_eq!(
            now(broker.release(token)),
            Poll::Ready(Err(BrokerError::new("kept slot 1 lease 2")))
        );
        assert_eq!(SlotBroker::capacity(&broker), Some(5));
        assert!(SlotBroker::renews(&broker));
        assert_eq!(
            now(SlotBroker::keep_alive(&broker, token)),
            Poll::Ready(BrokerError::unavailable("slot 1 lease 2 lost"))
        );
        SlotBroker::attach(&broker, BrokerEvents::new(|_| {}).with_origin(9));
        assert_eq!(broker.attached.load(Ordering::Relaxed), 9);
        assert_eq!(
            now(SlotBroker::close(&broker)),
            Poll::Ready(Err(BrokerError::timeout("close")))
        );
    }

    #[test]
    fn a_broker_that_keeps_the_defaults_renews_nothing_reports_no_capacity_and_closes_at_once() {
        let broker = Plain;
        assert_eq!(SlotBroker::capacity(&broker), None);
        assert!(!SlotBroker::renews(&broker));
        assert!(now(broker.keep_alive(SlotToken::new(0, 1))).is_pending());
        assert_eq!(now(broker.close()), Poll::Ready(Ok(())));
        let seen = Arc::new(AtomicU64::new(0));
        let events = BrokerEvents::new({
            let seen = Arc::clone(&seen);
            move |BrokerEvent::OrphanExpired { lease_id }| {
                seen.store(lease_id, Ordering::Relaxed);
            }
        });
        // The default attach keeps nothing: the broker reports nothing of its own.
        SlotBroker::attach(&broker, events.clone());
        events.orphan_expired(11);
        assert_eq!(seen.load(Ordering::Relaxed), 11);
        // Shared through an `Arc`, it says the same.
        let shared = Arc::new(Plain);
        assert_eq!(SlotBroker::capacity(&shared), None);
        assert!(!SlotBroker::renews(&shared));
        assert_eq!(now(SlotBroker::close(&shared)), Poll::Ready(Ok(())));
    }

    #[test]
    fn a_token_and_a_request_say_what_they_carry() {
        let token = SlotToken::new(3, 8);
        assert_eq!((token.slot_id(), token.lease_id()), (3, 8));
        assert_eq!(token.to_string(), "slot 3 lease 8");
        let request = AcquireRequest::new(5, Some("render-1")).with_origin(77);
        assert_eq!(request.request_id(), 5);
        assert_eq!(request.job_id(), Some("render-1"));
        assert_eq!(request.origin(), 77);
        let shared = AcquireRequest::for_job(6, Some(Arc::from("render-2")));
        assert_eq!(
            (shared.request_id(), shared.job_id()),
            (6, Some("render-2"))
        );
        assert_eq!(shared.origin(), 0);
        assert_eq!(AcquireRequest::new(1, None).job_id(), None);
    }

    #[test]
    fn every_broker_error_says_its_kind_code_and_message() {
        let cases = [
            (
                BrokerError::new("m"),
                BrokerErrorKind::Other,
                "broker error: m",
            ),
            (
                BrokerError::timeout("m"),
                BrokerErrorKind::Timeout,
                "broker timed out: m",
            ),
            (
                BrokerError::unavailable("m"),
                BrokerErrorKind::Unavailable,
                "broker unavailable: m",
            ),
            (
                BrokerError::delivery_unknown("m"),
                BrokerErrorKind::DeliveryUnknown,
                "broker delivery unknown: m",
            ),
            (
                BrokerError::invalid_response("m"),
                BrokerErrorKind::InvalidResponse,
                "invalid broker response: m",
            ),
            (
                BrokerError::panicked("m"),
                BrokerErrorKind::Panicked,
                "broker panicked: BROKER_PANICKED: m",
            ),
        ];
        for (error, kind, shown) in cases {
            assert_eq!(error.kind(), kind);
            assert_eq!(error.message(), "m");
            assert_eq!(error.to_string(), shown);
        }
        assert_eq!(BrokerError::panicked("m").code(), Some("BROKER_PANICKED"));
        let coded = BrokerError::new("m").with_code("ETCD_FOREIGN_KEY");
        assert_eq!(coded.code(), Some("ETCD_FOREIGN_KEY"));
        assert_eq!(coded.to_string(), "broker error: ETCD_FOREIGN_KEY: m");
        assert_eq!(BrokerError::new("m").code(), None);
    }
}
