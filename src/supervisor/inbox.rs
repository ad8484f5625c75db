//! The supervisor's inbox: every message to the supervisor actor goes through one FIFO queue,
//! and a ractor message ([`Ring`]) is only the doorbell that wakes the actor.
//!
//! The actor drains everything queued at each wake and applies it as one batch (releases
//! included, before the batch's grants are made), so a burst of acquires and releases costs one
//! actor turn instead of one per message. Only the actor reads the queue and only the actor
//! mutates the slot table: every acquire and release is still a message to it.
//!
//! # The doorbell protocol
//!
//! `rung` is true while a `Ring` is in the actor's mailbox or the actor is draining. A sender
//! pushes its message and rings only if `rung` was false; the actor clears `rung` only under the
//! queue's lock and only when it finds the queue empty. So a message is never left in the queue
//! with no `Ring` coming for it (both sides decide under the same lock), and under load most
//! messages cost no ractor message at all.
//!
//! # A supervisor that is gone
//!
//! When the actor's state is dropped (it stopped, or its runtime is gone) the inbox is closed
//! and drained: every message still queued is dropped with its reply senders, so every caller
//! waiting on one hears the supervisor is gone (invariant 6), and later sends are refused.

use std::mem;
use std::sync::OnceLock;

use parking_lot::Mutex;
use ractor::ActorRef;

use super::core::LeaseKey;
use super::messages::SupMsg;
use crate::lease::{LeaseReturn, ReleaseReply};

/// The only ractor message the supervisor actor receives: "the inbox has mail".
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ring;

pub(crate) struct Inbox {
    state: Mutex<State>,
    actor: OnceLock<ActorRef<Ring>>,
}

struct State {
    queue: Vec<SupMsg>,
    rung: bool,
    closed: bool,
}

impl Inbox {
    pub(crate) fn new() -> Self {
        Self {
            state: Mutex::new(State {
                queue: Vec::new(),
                rung: false,
                closed: false,
            }),
            actor: OnceLock::new(),
        }
    }

    /// Set once, right after the actor is spawned (before any handle exists). Mail sent before
    /// (a broker event, say) is rung for now.
    pub(crate) fn bind(&self, actor: ActorRef<Ring>) {
        let _ = self.actor.set(actor);
        if self.state.lock().rung && !self.ring_again() {
            self.close();
        }
    }

    /// Queues a message; gives it back when the supervisor is gone.
    ///
    /// A message accepted here may still be dropped unanswered if the actor dies (its runtime
    /// is dropped) before handling it, exactly as with a ractor message: its reply senders are
    /// dropped with it, which every caller hears as `SUPERVISOR_STOPPED`.
    // The message is given back whole (its reply senders with it): it is the sender's.
    #[allow(clippy::result_large_err)]
    pub(crate) fn send(&self, msg: SupMsg) -> Result<(), SupMsg> {
        let ring = {
            let mut state = self.state.lock();
            if state.closed {
                return Err(msg);
            }
            state.queue.push(msg);
            crate::counters::message();
            !mem::replace(&mut state.rung, true)
        };
        if ring && !self.ring_again() {
            // The actor is gone without having closed the inbox (its runtime was dropped
            // mid-flight): close it now.
            self.close();
        }
        Ok(())
    }

    /// Takes everything queued (into `batch`, which must be empty). Returns `false` and clears
    /// the doorbell when there is nothing: the next sender rings again.
    pub(crate) fn drain_into(&self, batch: &mut Vec<SupMsg>) -> bool {
        debug_assert!(batch.is_empty());
        let mut state = self.state.lock();
        if state.queue.is_empty() {
            state.rung = false;
            return false;
        }
        mem::swap(&mut state.queue, batch);
        true
    }

    /// Rings the doorbell: for a sender that found it unrung, or for the actor when mail
    /// arrived while it drained (the doorbell is still marked rung, so no sender does it).
    pub(crate) fn ring_again(&self) -> bool {
        match self.actor.get() {
            // Not bound yet: `bind` rings.
            None => true,
            Some(actor) => {
                crate::counters::ring();
                actor.send_message(Ring).is_ok()
            }
        }
    }

    /// The actor the inbox rings (tests look at its supervision tree).
    #[cfg(test)]
    pub(crate) fn actor(&self) -> Option<&ActorRef<Ring>> {
        self.actor.get()
    }

    /// Closes the inbox and drops what is queued (their reply senders with them).
    pub(crate) fn close(&self) {
        drop(self.close_taking());
    }

    /// Closes the inbox and gives back what was queued, for the caller to drop (their reply
    /// senders with them: every caller waiting on one hears the supervisor is gone).
    pub(crate) fn close_taking(&self) -> Vec<SupMsg> {
        let mut state = self.state.lock();
        state.closed = true;
        mem::take(&mut state.queue)
    }

    /// Gives back the queue's memory after a flood: also when a message or two arrived since
    /// the drain (a late proof, a timer), which would otherwise keep a flood's worth of capacity
    /// until the next flood.
    pub(crate) fn shrink(&self) {
        let mut state = self.state.lock();
        let (len, cap) = (state.queue.len(), state.queue.capacity());
        if cap > 64 && len <= cap / 4 {
            state.queue.shrink_to((len * 2).max(64));
        }
    }
}

impl LeaseReturn for Inbox {
    fn give_back(&self, key: u64, reply: Option<ReleaseReply>) -> bool {
        self.send(SupMsg::Release {
            key: LeaseKey(key),
            reply,
        })
        .is_ok()
    }
}
