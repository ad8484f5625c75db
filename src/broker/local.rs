//! The embedded default: an in-process pool of slots.

use std::collections::VecDeque;
use std::fmt;

use parking_lot::Mutex;

use super::{AcquireRequest, BrokerError, SlotBroker, SlotToken};

/// An in-process broker with a fixed number of slots, numbered `0..n`.
///
/// Lease ids start at 1 and increase strictly, so they serve as fencing tokens. Freed slots are
/// reused in the order they were freed. `acquire` never waits: the supervisor asks only when it
/// knows a slot is free (the broker reports its capacity), so an exhausted pool answers
/// [`BrokerErrorKind::Unavailable`](crate::BrokerErrorKind::Unavailable). `release` refuses a token
/// that is not held under exactly that lease id.
///
/// # Examples
///
/// ```
/// use leasehold::{AcquireRequest, LocalBroker, SlotBroker};
///
/// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
/// let broker = LocalBroker::new(2);
/// let token = broker.acquire(AcquireRequest::new(1, None)).await?;
/// assert_eq!(broker.held(), 1);
/// broker.release(token).await?;
/// assert!(broker.release(token).await.is_err()); // not held any more
/// # Ok::<(), leasehold::BrokerError>(())
/// # }).unwrap();
/// ```
pub struct LocalBroker {
    capacity: u32,
    state: Mutex<LocalState>,
}

struct LocalState {
    free: VecDeque<u32>,
    /// Per slot, the lease id holding it (0: free; lease ids start at 1).
    holder: Vec<u64>,
    held: usize,
    next_lease_id: u64,
}

impl LocalBroker {
    /// A pool of `slots` slots. A pool of zero slots is refused when a supervisor starts on it.
    pub fn new(slots: u32) -> Self {
        Self {
            capacity: slots,
            state: Mutex::new(LocalState {
                free: (0..slots).collect(),
                holder: vec![0; slots as usize],
                held: 0,
                next_lease_id: 1,
            }),
        }
    }

    /// How many slots are held right now.
    pub fn held(&self) -> usize {
        self.state.lock().held
    }

    pub(crate) fn slots(&self) -> u32 {
        self.capacity
    }

    /// Takes a free slot, at once: what `acquire` does, without a future (the supervisor's
    /// fast path for its own in-process broker).
    pub(crate) fn take(&self) -> Result<SlotToken, BrokerError> {
        let mut state = self.state.lock();
        let Some(slot) = state.free.pop_front() else {
            return Err(BrokerError::unavailable(format!(
                "all {} slots are held",
                self.capacity
            )));
        };
        let lease_id = state.next_lease_id;
        state.next_lease_id += 1;
        state.holder[slot as usize] = lease_id;
        state.held += 1;
        Ok(SlotToken::new(slot, lease_id))
    }

    /// Gives a slot back, at once: what `release` does, without a future.
    pub(crate) fn give(&self, token: SlotToken) -> Result<(), BrokerError> {
        let mut state = self.state.lock();
        let slot = token.slot_id() as usize;
        match state.holder.get(slot) {
            Some(&lease) if lease == token.lease_id() && lease != 0 => {
                state.holder[slot] = 0;
                state.held -= 1;
                state.free.push_back(token.slot_id());
                Ok(())
            }
            _ => Err(BrokerError::invalid_response(format!(
                "{token} is not held by this broker"
            ))),
        }
    }
}

impl fmt::Debug for LocalBroker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalBroker")
            .field("capacity", &self.capacity)
            .field("held", &self.held())
            .finish()
    }
}

impl SlotBroker for LocalBroker {
    async fn acquire(&self, _request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        self.take()
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.give(token)
    }

    fn capacity(&self) -> Option<u32> {
        Some(self.capacity)
    }
}
