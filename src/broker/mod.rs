//! Where slot tokens come from: the [`SlotBroker`] trait and its in-process implementation.
//!
//! The supervisor calls a broker; a broker knows nothing about workers. The supervisor never
//! awaits a broker inside its mailbox: a broker future that does not finish on its first poll
//! is moved to a task of its own and its result comes back as a message.

mod erased;
mod local;

use std::fmt;
use std::future::Future;
use std::sync::Arc;

pub use local::LocalBroker;

pub(crate) use erased::{DynBroker, poll_once};

/// One slot held under one lease. A plain `Copy` value; the lease id doubles as a fencing token
/// (the brokers leasehold ships hand out strictly increasing lease ids).
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

    /// Which lease: unique among live leases, and a fencing token for brokers that increase it.
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
    job_id: Option<Arc<str>>,
}

impl AcquireRequest {
    /// Builds a request; the supervisor makes one per broker acquire.
    pub fn new(request_id: u64, job_id: Option<&str>) -> Self {
        Self {
            request_id,
            job_id: job_id.map(Arc::from),
        }
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
/// Implementations may write `async fn` for both methods. A broker must not hand out a token
/// that is still held; the supervisor checks anyway and refuses a token whose slot or lease id is
/// already live (nothing is granted, and the refused token is *not* released, since releasing
/// it could free the live holder's slot).
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
}

/// A failure reported by a [`SlotBroker`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerError {
    kind: BrokerErrorKind,
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

    fn with_kind(kind: BrokerErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
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
        };
        write!(f, "{what}: {}", self.message)
    }
}

impl std::error::Error for BrokerError {}
