//! The explicit lease, for code that cannot put its work in a closure.

use std::any::Any;
use std::fmt;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use tokio::sync::{Notify, oneshot};

use crate::broker::SlotToken;
use crate::error::{CleanupError, LeaseReleased};

/// Where a `release` call hears the broker's answer.
pub(crate) type ReleaseReply = oneshot::Sender<Result<(), CleanupError>>;

/// Where a lease goes back: the supervisor's inbox implements it. A lease knows only this, not
/// the supervisor.
pub(crate) trait LeaseReturn: Send + Sync + 'static {
    /// Asks for the release of the lease of that key (`reply`: the caller waiting for the
    /// broker's answer; `None` for a dropped lease). `false` when the supervisor is gone.
    fn give_back(&self, key: u64, reply: Option<ReleaseReply>) -> bool;
}

/// One slot (or several, from [`Supervisor::acquire_many`](crate::Supervisor::acquire_many)), held until
/// [`release`](Self::release) or drop.
///
/// Prefer [`Supervisor::run`](crate::Supervisor::run), which also tracks the work done under the slot. A `Lease` only
/// guarantees the bookkeeping: exactly one broker release, awaited by `release`, refused use
/// after release has begun, and a release even when the lease is dropped.
///
/// The lease can also end under its holder: a shutdown releases it on the holder's behalf,
/// and a broker whose leases lapse may lose it. From then on [`slot_id`](Self::slot_id) and
/// the other accessors refuse (the slot may already be someone else's) and
/// [`lost`](Self::lost) resolves.
///
/// Dropping an unreleased lease never blocks: it sends a release message and the supervisor
/// releases the slot; a failure then goes to the error sink, the `render_slot.release.failed.count`
/// metric and a `tracing` error event.
///
/// # Examples
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use leasehold::Supervisor;
///
/// let sup = Supervisor::builder().slots(1).start().await?;
/// let mut lease = sup.acquire().await?;
/// let slot = lease.slot_id()?;
/// assert_eq!(slot, 0);
/// lease.release().await?;
/// lease.release().await?; // a no-op: the broker is not called again
/// assert!(lease.slot_id().is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[must_use = "a Lease holds a slot: dropping it releases the slot at once"]
pub struct Lease {
    key: u64,
    token: SlotToken,
    /// The other tokens of a multi-slot lease (empty for one slot: no allocation).
    more: Box<[SlotToken]>,
    home: Arc<dyn LeaseReturn>,
    state: State,
    /// Keeps the supervisor from shutting down (last handle dropped) while this lease lives.
    keepalive: Option<Arc<dyn Any + Send + Sync>>,
    /// What the supervisor says of the lease while it is held.
    cell: Arc<LeaseCell>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Held,
    /// A release was asked for; its answer may not have been heard (the call was cancelled).
    Releasing,
    Released,
    /// Owned by the supervisor again (it could not be delivered): drop does nothing.
    Defused,
}

/// Shared by a [`Lease`] and the supervisor: whether the lease still holds its slot.
#[derive(Debug)]
pub(crate) struct LeaseCell {
    ended: AtomicU8,
    notify: Notify,
}

/// No bit set: the lease holds its slot. The two bits are independent: a lease lost at the
/// broker is still released on its holder's behalf by a shutdown, and both are then set.
const HELD: u8 = 0;
/// Released on the holder's behalf (shutdown).
const REVOKED: u8 = 1;
/// The broker could not keep it alive.
const LOST: u8 = 2;

impl LeaseCell {
    pub(crate) fn new() -> Self {
        Self {
            ended: AtomicU8::new(HELD),
            notify: Notify::new(),
        }
    }

    /// The lease no longer holds its slot: released by shutdown, or lost at the broker.
    pub(crate) fn revoke(&self, lost: bool) {
        // Release: the holder that sees the new state also sees everything before it.
        self.ended
            .fetch_or(if lost { LOST } else { REVOKED }, Ordering::Release);
        self.notify.notify_waiters();
    }

    fn get(&self) -> u8 {
        self.ended.load(Ordering::Acquire)
    }

    /// A shutdown released the lease on its holder's behalf (lost at the broker before, or not).
    fn revoked(&self) -> bool {
        self.get() & REVOKED != 0
    }

    /// The lease has ended under its holder (revoked or lost).
    pub(crate) fn is_ended(&self) -> bool {
        self.get() != HELD
    }

    /// Resolves once the lease has ended under its holder. Cancel safe: it only waits.
    pub(crate) async fn ended(&self) {
        loop {
            let mut notified = pin!(self.notify.notified());
            // Registered before the check: a revoke between the two still wakes this.
            notified.as_mut().enable();
            if self.is_ended() {
                return;
            }
            notified.await;
        }
    }
}

impl Lease {
    pub(crate) fn new(
        key: u64,
        (token, more): (SlotToken, Box<[SlotToken]>),
        home: Arc<dyn LeaseReturn>,
        cell: Arc<LeaseCell>,
    ) -> Self {
        Self {
            key,
            token,
            more,
            home,
            state: State::Held,
            keepalive: None,
            cell,
        }
    }

    /// Whether the lease has ended under its holder: the broker reported it lost (it could not
    /// be kept alive: a distributed broker's TTL may lapse, or has), or a shutdown released it
    /// on the holder's behalf. The slot may then already belong to someone else, and writes
    /// under [`lease_id`](Self::lease_id) may be fenced off. A lost lease must still be
    /// released (a no-op after a shutdown released it).
    pub fn is_lost(&self) -> bool {
        self.cell.is_ended()
    }

    /// Resolves when the lease ends under its holder (see [`is_lost`](Self::is_lost)). Select
    /// on it next to the work done under the lease.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only waits.
    pub async fn lost(&self) {
        self.cell.ended().await;
    }

    /// Keeps `owner` (the supervisor's handle state) alive for as long as the lease is held.
    pub(crate) fn keep_alive(&mut self, owner: Arc<dyn Any + Send + Sync>) {
        self.keepalive = Some(owner);
    }

    pub(crate) fn defuse(mut self) {
        self.state = State::Defused;
    }

    /// What the supervisor says of the lease, shared (the lease desk hands it to the holder).
    pub(crate) fn cell(&self) -> Arc<LeaseCell> {
        Arc::clone(&self.cell)
    }

    /// The slot held (the first one, for a multi-slot lease).
    ///
    /// # Errors
    ///
    /// [`LeaseReleased`] once release has begun, or once the lease ended under its holder
    /// (lost, or released by shutdown): the slot may already belong to someone else.
    pub fn slot_id(&self) -> Result<u32, LeaseReleased> {
        self.token().map(|t| t.slot_id())
    }

    /// The lease id (a fencing token for the brokers leasehold ships).
    ///
    /// # Errors
    ///
    /// [`LeaseReleased`] once release has begun, or once the lease ended under its holder.
    pub fn lease_id(&self) -> Result<u64, LeaseReleased> {
        self.token().map(|t| t.lease_id())
    }

    /// The whole token.
    ///
    /// # Errors
    ///
    /// [`LeaseReleased`] once release has begun, or once the lease ended under its holder.
    pub fn token(&self) -> Result<SlotToken, LeaseReleased> {
        match self.state {
            State::Held if !self.is_lost() => Ok(self.token),
            _ => Err(LeaseReleased::new()),
        }
    }

    /// Every token held, the first one first (one for a single-slot lease).
    ///
    /// # Errors
    ///
    /// [`LeaseReleased`] once release has begun, or once the lease ended under its holder.
    pub fn tokens(&self) -> Result<Vec<SlotToken>, LeaseReleased> {
        let first = self.token()?;
        Ok(std::iter::once(first)
            .chain(self.more.iter().copied())
            .collect())
    }

    /// How many slots the lease holds (whether or not it still holds them).
    pub fn slot_count(&self) -> usize {
        1 + self.more.len()
    }

    /// Whether release has begun (by this holder, or by a shutdown on its behalf).
    pub fn is_released(&self) -> bool {
        self.state != State::Held || self.cell.revoked()
    }

    /// Gives the slot back and waits for the broker's answer, bounded by the supervisor's
    /// cleanup timeout. A second call is a no-op returning `Ok(())`: the broker is called once.
    /// So is a call after a shutdown released the lease on the holder's behalf.
    ///
    /// # Errors
    ///
    /// [`CleanupError`]: `LEASE_CLEANUP_FAILED` when the broker refused, `LEASE_CLEANUP_TIMEOUT`
    /// when it did not answer in time, `SUPERVISOR_STOPPED` when the supervisor was gone.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future does not cancel the release: the supervisor finishes it under its own
    /// cleanup timeout, and a failure nobody hears goes to the error sink. Calling `release`
    /// again after a cancelled call waits for that same release (or returns `Ok(())` if it has
    /// already finished).
    pub async fn release(&mut self) -> Result<(), CleanupError> {
        if matches!(self.state, State::Released | State::Defused) {
            return Ok(());
        }
        self.state = State::Releasing;
        let (tx, rx) = oneshot::channel();
        let result = if !self.home.give_back(self.key, Some(tx)) {
            if self.cell.revoked() {
                Ok(())
            } else {
                Err(CleanupError::stopped(Some(self.token)))
            }
        } else {
            match rx.await {
                Ok(result) => result,
                // The supervisor finished a shutdown that had released this lease.
                Err(_) if self.cell.revoked() => Ok(()),
                Err(_) => Err(CleanupError::stopped(Some(self.token))),
            }
        };
        self.state = State::Released;
        // Released: it no longer keeps the supervisor from shutting down.
        self.keepalive = None;
        result
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.state != State::Held || self.cell.revoked() {
            return;
        }
        if !self.home.give_back(self.key, None) {
            // The supervisor died (its runtime is gone); nothing is left to release to.
            tracing::error!(token = %self.token, "lease dropped after its supervisor died");
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("token", &self.token)
            .field("state", &self.state)
            .field("lost", &self.is_lost())
            .finish()
    }
}
