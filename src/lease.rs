//! The explicit lease, for code that cannot put its work in a closure.

use std::fmt;

use ractor::ActorRef;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::broker::SlotToken;
use crate::error::{CleanupError, LeaseReleased};
use crate::supervisor::Supervisor;
use crate::supervisor::messages::SupMsg;
use crate::supervisor::state::LeaseKey;

/// One slot, held until [`release`](Self::release) or drop.
///
/// Prefer [`Supervisor::run`], which also tracks the work done under the slot. A `Lease` only
/// guarantees the bookkeeping: exactly one broker release, awaited by `release`, refused use
/// after release has begun, and a release even when the lease is dropped.
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
    key: LeaseKey,
    token: SlotToken,
    actor: ActorRef<SupMsg>,
    state: State,
    /// Keeps the supervisor from shutting down (last handle dropped) while this lease lives.
    keepalive: Option<Supervisor>,
    /// Cancelled when the broker reports the lease lost (only for brokers that renew).
    lost: Option<CancellationToken>,
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

impl Lease {
    pub(crate) fn new(
        key: LeaseKey,
        token: SlotToken,
        actor: ActorRef<SupMsg>,
        lost: Option<CancellationToken>,
    ) -> Self {
        Self {
            key,
            token,
            actor,
            state: State::Held,
            keepalive: None,
            lost,
        }
    }

    /// Whether the broker has reported this lease lost: it could not be kept alive (a
    /// distributed broker's TTL may lapse, or has), so the slot may already belong to someone
    /// else and writes under [`lease_id`](Self::lease_id) may be fenced off. Always `false` for
    /// brokers whose leases do not lapse (the `LocalBroker`). The lease must still be released.
    pub fn is_lost(&self) -> bool {
        self.lost
            .as_ref()
            .is_some_and(CancellationToken::is_cancelled)
    }

    /// Resolves when the broker reports this lease lost (see [`is_lost`](Self::is_lost));
    /// never, for brokers whose leases do not lapse. Select on it next to the work done under
    /// the lease.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only waits.
    pub async fn lost(&self) {
        match &self.lost {
            Some(signal) => signal.cancelled().await,
            None => std::future::pending().await,
        }
    }

    pub(crate) fn keep_alive(&mut self, sup: Supervisor) {
        self.keepalive = Some(sup);
    }

    /// A completed shutdown released every lease still held (on the holder's behalf).
    fn released_by_shutdown(&self) -> bool {
        self.keepalive
            .as_ref()
            .is_some_and(Supervisor::has_shut_down)
    }

    pub(crate) fn defuse(mut self) {
        self.state = State::Defused;
    }

    /// The slot held.
    ///
    /// # Errors
    ///
    /// [`LeaseReleased`] once release has begun: the slot may already belong to someone else.
    pub fn slot_id(&self) -> Result<u32, LeaseReleased> {
        self.token().map(|t| t.slot_id())
    }

    /// The lease id (a fencing token for the brokers leasehold ships).
    ///
    /// # Errors
    ///
    /// [`LeaseReleased`] once release has begun.
    pub fn lease_id(&self) -> Result<u64, LeaseReleased> {
        self.token().map(|t| t.lease_id())
    }

    /// The whole token.
    ///
    /// # Errors
    ///
    /// [`LeaseReleased`] once release has begun.
    pub fn token(&self) -> Result<SlotToken, LeaseReleased> {
        match self.state {
            State::Held => Ok(self.token),
            _ => Err(LeaseReleased::new()),
        }
    }

    /// Whether release has begun.
    pub fn is_released(&self) -> bool {
        self.state != State::Held
    }

    /// Gives the slot back and waits for the broker's answer, bounded by the supervisor's
    /// cleanup timeout. A second call is a no-op returning `Ok(())`: the broker is called once.
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
        let msg = SupMsg::Release {
            key: self.key,
            reply: Some(tx),
        };
        let result = if self.actor.send_message(msg).is_err() {
            if self.released_by_shutdown() {
                Ok(())
            } else {
                Err(CleanupError::stopped(Some(self.token)))
            }
        } else {
            rx.await
                .unwrap_or_else(|_| Err(CleanupError::stopped(Some(self.token))))
        };
        self.state = State::Released;
        result
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.state != State::Held {
            return;
        }
        let msg = SupMsg::Release {
            key: self.key,
            reply: None,
        };
        if self.actor.send_message(msg).is_err() && !self.released_by_shutdown() {
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
            .finish()
    }
}
