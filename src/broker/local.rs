//! The embedded default: an in-process pool of slots.

use std::collections::VecDeque;
use std::fmt;

use parking_lot::Mutex;

use super::{AcquireRequest, BrokerError, SlotBroker, SlotToken};

/// An in-process broker with a fixed number of slots, numbered `0..n`.
///
/// Lease ids start at 1 and increase strictly, so they serve as fencing tokens. Freed slots are
/// reused in the order they were freed. `acquire` never waits: an exhausted pool answers
/// [`BrokerErrorKind::Unavailable`](crate::BrokerErrorKind::Unavailable). `release` refuses a token
/// that is not held under exactly that lease id.
///
/// A `LocalBroker` given to a supervisor
/// ([`SupervisorBuilder::broker`](crate::SupervisorBuilder::broker)) becomes its own pool, as
/// with [`slots`](crate::SupervisorBuilder::slots): the supervisor takes it over as it is, and grants and frees its slots in the same step as its own bookkeeping, with
/// no broker call in between. A slot taken from it before then stays held for good (nobody can
/// give it back once the supervisor owns the pool) and counts against the capacity: give the
/// supervisor a pool with every slot free.
///
/// The pool can be resized while it is in use ([`Supervisor::resize`](crate::Supervisor::resize)):
/// new slots are numbered on from the highest ever had; when the pool shrinks, no held slot is
/// taken away, and the slots above the new size are retired as they come back.
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
    state: Mutex<Pool>,
}

/// The pool's state and rules, without a lock: what [`LocalBroker`] guards with its mutex, and
/// what a supervisor's core owns outright once the pool is given to it (the core grants and
/// frees its slots in the same step as its own bookkeeping, with no message in between).
#[cfg_attr(test, derive(Clone))]
#[derive(Debug)]
pub(crate) struct Pool {
    capacity: u32,
    free: VecDeque<u32>,
    /// Per slot, the lease id holding it (0: free; lease ids start at 1).
    holder: Vec<u64>,
    held: usize,
    next_lease_id: u64,
}

impl Pool {
    /// A pool of `slots` free slots, numbered `0..slots`.
    pub(crate) fn new(slots: u32) -> Self {
        Self {
            capacity: slots,
            free: (0..slots).collect(),
            holder: vec![0; slots as usize],
            held: 0,
            next_lease_id: 1,
        }
    }

    /// How many slots are held.
    pub(crate) fn held(&self) -> usize {
        self.held
    }

    /// The pool's size.
    pub(crate) fn slots(&self) -> u32 {
        self.capacity
    }

    /// See [`LocalBroker::resize`].
    pub(crate) fn resize(&mut self, slots: u32) {
        self.capacity = slots;
        // Slots are never forgotten: a lowered pool still knows who holds its retired slots.
        let table = self.holder.len().max(slots as usize);
        self.holder.resize(table, 0);
        // Free now: the free slots below the new size, in the order they were freed, then those
        // not free before (retired, or new) that nobody holds.
        let Self { free, holder, .. } = self;
        free.retain(|s| *s < slots);
        let known: std::collections::HashSet<u32> = free.iter().copied().collect();
        for slot in 0..slots {
            if holder[slot as usize] == 0 && !known.contains(&slot) {
                free.push_back(slot);
            }
        }
    }

    /// Takes a free slot under a new lease id, or says that none may be taken.
    #[inline]
    pub(crate) fn take(&mut self) -> Result<SlotToken, BrokerError> {
        let slot = match self.free.pop_front() {
            Some(slot) if self.held < self.capacity as usize => slot,
            other => {
                if let Some(slot) = other {
                    self.free.push_front(slot);
                }
                return Err(BrokerError::unavailable(format!(
                    "all {} slots are held",
                    self.capacity
                )));
            }
        };
        let lease_id = self.next_lease_id;
        self.next_lease_id += 1;
        self.holder[slot as usize] = lease_id;
        self.held += 1;
        Ok(SlotToken::new(slot, lease_id))
    }

    /// Gives a slot back; refuses a token not held under exactly that lease id.
    #[inline]
    pub(crate) fn give(&mut self, token: SlotToken) -> Result<(), BrokerError> {
        let slot = token.slot_id() as usize;
        match self.holder.get(slot) {
            Some(&lease) if lease == token.lease_id() && lease != 0 => {
                self.holder[slot] = 0;
                self.held -= 1;
                // A slot above a lowered size is retired.
                if token.slot_id() < self.capacity {
                    self.free.push_back(token.slot_id());
                }
                Ok(())
            }
            _ => Err(BrokerError::invalid_response(format!(
                "{token} is not held by this broker"
            ))),
        }
    }

    /// Per slot, the lease id holding it (0: free).
    #[cfg(test)]
    pub(crate) fn holders(&self) -> Vec<u64> {
        self.holder.clone()
    }
}

impl LocalBroker {
    /// A pool of `slots` slots. A pool of zero slots is refused when a supervisor starts on it.
    pub fn new(slots: u32) -> Self {
        Self {
            state: Mutex::new(Pool::new(slots)),
        }
    }

    /// How many slots are held right now.
    pub fn held(&self) -> usize {
        self.state.lock().held()
    }

    pub(crate) fn slots(&self) -> u32 {
        self.state.lock().slots()
    }

    /// Sets the number of slots. Raising it frees the new slots at once; lowering it takes no
    /// held slot away: `acquire` refuses while `held() >= slots`, and the slots numbered at or
    /// above `slots` are retired as they are released (the free ones at once). A pool resized
    /// to 0 grants nothing until it is raised again.
    pub fn resize(&self, slots: u32) {
        self.state.lock().resize(slots);
    }

    /// Takes a free slot, at once: what `acquire` does, without a future.
    pub(crate) fn take(&self) -> Result<SlotToken, BrokerError> {
        self.state.lock().take()
    }

    /// Gives a slot back, at once: what `release` does, without a future.
    pub(crate) fn give(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.state.lock().give(token)
    }

    /// The pool itself, for a supervisor's core to own.
    pub(crate) fn into_pool(self) -> Pool {
        self.state.into_inner()
    }
}

impl fmt::Debug for LocalBroker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalBroker")
            .field("capacity", &self.slots())
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
        Some(self.slots())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(tokens: &[SlotToken]) -> Vec<u32> {
        tokens.iter().map(|t| t.slot_id()).collect()
    }

    #[test]
    fn held_counts_the_slots_taken_and_not_given_back() {
        let pool = LocalBroker::new(3);
        assert_eq!(pool.held(), 0);
        let t: Vec<SlotToken> = (0..2).map(|_| pool.take().unwrap()).collect();
        assert_eq!(pool.held(), 2);
        pool.give(t[1]).unwrap();
        assert_eq!(pool.held(), 1);
        assert!(pool.give(t[1]).is_err(), "given back twice");
        assert_eq!(pool.held(), 1);
    }

    #[test]
    fn a_lowered_pool_never_grants_a_free_slot_above_its_size() {
        let pool = LocalBroker::new(4);
        pool.resize(2);
        let granted = [pool.take().unwrap(), pool.take().unwrap()];
        assert_eq!(slots(&granted), [0, 1]);
        assert!(pool.take().is_err(), "a pool of 2 grants 2");
        for token in granted {
            pool.give(token).unwrap();
        }
        assert_eq!(pool.held(), 0);
    }

    #[test]
    fn a_lowered_pool_never_grants_a_slot_freed_above_its_size_before_the_lowering() {
        let pool = LocalBroker::new(3);
        let t: Vec<SlotToken> = (0..3).map(|_| pool.take().unwrap()).collect();
        pool.give(t[2]).unwrap();
        pool.give(t[0]).unwrap();
        pool.resize(2);
        let granted = pool.take().unwrap();
        assert_eq!(granted.slot_id(), 0, "slot 2 is retired");
        assert!(pool.take().is_err(), "slots 0 and 1 are held");
    }

    #[test]
    fn a_lowered_pool_refuses_while_its_size_in_slots_is_held_retired_ones_included() {
        let pool = LocalBroker::new(4);
        let t: Vec<SlotToken> = (0..4).map(|_| pool.take().unwrap()).collect();
        pool.give(t[0]).unwrap();
        pool.resize(2);
        assert!(pool.take().is_err(), "three held in a pool of two");
        pool.give(t[3]).unwrap();
        assert!(pool.take().is_err(), "two held in a pool of two");
        pool.give(t[2]).unwrap();
        assert_eq!(pool.take().unwrap().slot_id(), 0);
    }

    #[test]
    fn a_slot_released_after_its_pool_was_lowered_below_it_is_retired() {
        let pool = LocalBroker::new(3);
        let t: Vec<SlotToken> = (0..3).map(|_| pool.take().unwrap()).collect();
        pool.resize(2);
        pool.give(t[2]).unwrap();
        pool.give(t[0]).unwrap();
        assert_eq!(pool.take().unwrap().slot_id(), 0, "slot 2 is retired");
        assert!(pool.take().is_err());
    }

    #[test]
    fn a_raised_pool_grants_the_slots_freed_before_in_the_order_they_were_freed_then_the_new_ones()
    {
        let pool = LocalBroker::new(3);
        let t: Vec<SlotToken> = (0..3).map(|_| pool.take().unwrap()).collect();
        pool.give(t[2]).unwrap();
        pool.give(t[0]).unwrap();
        pool.resize(4);
        let granted: Vec<SlotToken> = (0..3).map(|_| pool.take().unwrap()).collect();
        assert_eq!(slots(&granted), [2, 0, 3]);
        assert!(pool.take().is_err(), "slot 1 is still held");
    }
}
