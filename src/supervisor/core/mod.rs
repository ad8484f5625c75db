//! The pure core of the supervisor: every decision of the release pipeline, as data.
//!
//! No tokio, no ractor, no I/O, no clock. The actor shell turns each message it receives into
//! an [`Input`], applies it here, and performs the [`Effect`]s this returns, in order; it
//! decides nothing itself. The model-based tests drive this type directly, and the simulation
//! test drives the real actor around it.
//!
//! The core is split by concern, one room each, and the state by field, so that a handler
//! borrows the part it changes and the effect list at once:
//!
//! - [`protocol`]: the ids, [`Input`], [`Effect`] and the answers they carry;
//! - [`admission`]: the queue, the gathering head, `try_acquire`, the broker acquires in
//!   flight, the tokens in hand, and [`Core::admit`], the one function that grants;
//! - [`record`]: one lease ([`LeaseRecord`]): what it owes ([`Owed`]), its reasons, its phase;
//! - [`book`]: every record, the duplicate-token indexes, and the tallies in slots;
//! - [`pipeline`]: a lease's proofs, its temp dir, its release token by token, its answer;
//! - [`quarantine`]: listing, re-checks and reclaim;
//! - [`shutdown`]: invariant 8, step by step.
//!
//! # A lease's life
//!
//! Each lease carries what is still owed before its slots may be reused (the crate's
//! DESIGN.md, section 2): the worker's physical end (its task joined, every tracked task and
//! blocking closure joined, every process group proven empty, every GPU submission completed);
//! then its temp dir removed, started by the core alone only once every proof above is in (the
//! job's driver only says whether the job asked for one); then the broker release, started
//! only once nothing else is owed.
//!
//! A proof that is not in within its bound does not hold the caller: the lease is
//! *quarantined* with a [`Reason`] attached to that proof, the caller hears
//! `LEASE_CLEANUP_UNCONFIRMED` (or `LEASE_GPU_DEVICE_LOST`) at once, and the slots stay held,
//! counted and reported. A reason goes away only with the proof it waits for.
//!
//! Nothing here panics on an input that does not fit the state (a proof for a lease that is
//! gone, a second release): such an input changes nothing and is reported as
//! [`Effect::Illegal`] or ignored, in every build.

mod admission;
mod book;
mod ending;
mod grant;
mod ids;
mod pipeline;
pub(crate) mod protocol;
mod quarantine;
pub(crate) mod record;
pub(crate) mod shrink;
mod shutdown;

use std::collections::VecDeque;
use std::fmt;

use crate::broker::Pool;

pub(crate) use self::protocol::{
    Answer, Ask, ControlId, Effect, Input, LeaseKey, ProcessKey, QuarantineEntry, RecheckFor,
    Rechecked, Reply, RequestId, StopTally, WaiterId, Want, Withdrawal,
};
pub(crate) use self::record::{Holder, LeaseRecord, Phase, Proof, Proofs};

use self::admission::Admission;
pub(crate) use self::admission::capacity;
use self::book::Book;
use self::ending::Ending;
use self::shrink::shrink_deque;
pub(crate) use self::shrink::shrink_map;

/// Monotonic counters, in slots: every slot granted (a k-slot lease counts k) and every broker
/// release, one per slot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub(crate) acquired_total: u64,
    pub(crate) released_total: u64,
    pub(crate) release_failed_total: u64,
    pub(crate) orphan_expired_total: u64,
}

/// The figures `Stats` shows, all in slots but `waiting` and `leases`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Figures {
    /// Slots held and not quarantined (running, draining, releasing).
    pub(crate) active: usize,
    pub(crate) waiting: usize,
    pub(crate) quarantined: usize,
    pub(crate) draining: usize,
    pub(crate) held_slots: usize,
    pub(crate) leases: usize,
    pub(crate) capacity: Option<usize>,
    pub(crate) counters: Counters,
}

/// What each part of the core holds on to, in elements of capacity (the memory tests).
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Retained {
    pub(crate) waiters: usize,
    pub(crate) acquiring: usize,
    pub(crate) leases: usize,
    pub(crate) effects: usize,
}

/// The effects of the inputs applied so far, in order.
#[cfg_attr(test, derive(Clone))]
#[derive(Debug, Default)]
pub(crate) struct Effects(VecDeque<Effect>);

impl Effects {
    pub(crate) fn push(&mut self, effect: Effect) {
        self.0.push_back(effect);
    }

    fn illegal(&mut self, what: fmt::Arguments<'_>) {
        self.push(Effect::Illegal(what.to_string()));
    }
}

/// How a core is set up.
#[derive(Debug)]
pub(crate) struct CoreConfig {
    /// The broker's capacity (the pool's size), `None` when the broker does not say. The core
    /// grants up to [`capacity`] of it and the GPU sub-slots.
    pub(crate) broker_capacity: Option<u32>,
    /// The supervisor's own in-process pool, which the core then owns: its tokens are trusted,
    /// and it serves multi-slot leases, `try_acquire` and resizing. `None` for any other broker.
    pub(crate) pool: Option<Pool>,
    /// The GPU sub-slots, when the supervisor owns GPU devices (close them at shutdown; they
    /// cap the capacity after a resize).
    pub(crate) gpu_slots: Option<u32>,
    /// The broker renews leases (start a renewal per grant).
    pub(crate) renews: bool,
}

/// The core: admission, the lease book, shutdown, the counters and the effects.
#[cfg_attr(test, derive(Clone))]
#[derive(Debug)]
pub(crate) struct Core {
    renews: bool,
    admission: Admission,
    book: Book,
    ending: Ending,
    /// Re-checks asked for and not yet reported.
    rechecks: usize,
    /// Reclaims waiting for the temp dir removals they retried.
    reclaims: Vec<quarantine::PendingReclaim>,
    counters: Counters,
    fx: Effects,
}

impl Core {
    /// A core as a supervisor starts it.
    pub(crate) fn new(config: CoreConfig) -> Self {
        let on_pool = config.pool.is_some();
        Self {
            renews: config.renews,
            admission: Admission::new(
                capacity(config.broker_capacity, config.gpu_slots),
                config.pool,
                config.gpu_slots,
            ),
            book: Book::new(!on_pool),
            ending: Ending::new(config.gpu_slots.is_some()),
            rechecks: 0,
            reclaims: Vec::new(),
            counters: Counters::default(),
            fx: Effects::default(),
        }
    }

    /// A core on a broker other than the supervisor's pool (tests).
    #[cfg(test)]
    pub(crate) fn on_broker(capacity: Option<u32>, renews: bool, gpu: bool) -> Self {
        Self::new(CoreConfig {
            broker_capacity: capacity,
            pool: None,
            gpu_slots: gpu.then_some(u32::MAX),
            renews,
        })
    }

    /// A core on the supervisor's own pool of `slots` (tests).
    #[cfg(test)]
    pub(crate) fn pool(slots: u32) -> Self {
        Self::new(CoreConfig {
            broker_capacity: Some(slots),
            pool: Some(Pool::new(slots)),
            gpu_slots: None,
            renews: false,
        })
    }

    /// The next effect to perform. Performing it may apply more inputs, whose effects queue
    /// behind the ones already here.
    pub(crate) fn pop_effect(&mut self) -> Option<Effect> {
        self.fx.0.pop_front()
    }

    /// Applies one input, then admits: whatever the input freed or brought is placed, and what
    /// the queue lacks is asked for.
    pub(crate) fn apply(&mut self, input: Input) {
        match input {
            Input::Enqueue { waiter, ask } => self.enqueue(waiter, ask),
            Input::Withdraw { waiter, why } => {
                self.withdraw(waiter, why.into_error());
            }
            Input::Resize { control, slots } => self.resize(control, slots),
            Input::CancelById {
                control,
                waiters,
                leases,
            } => self.cancel_by_id(control, waiters, leases),
            Input::ListQuarantine { control } => self.list_quarantine(control),
            Input::ListWaiters { control } => self.list_waiters(control),
            Input::Reclaim { control } => self.recheck(RecheckFor::Reclaim(control)),
            Input::Rechecked {
                results,
                leases,
                purpose,
            } => self.rechecked(results, leases, purpose),
            Input::Acquired { request, result } => self.acquired(request, result),
            Input::Undelivered { key } => self.undelivered(key),
            Input::NotStarted { key, why } => self.not_started(key, why),
            Input::Unprepared { key, why } => self.unprepared(key, why),
            Input::Started { key, device } => self.started(key, device),
            Input::Proven { key, proofs } => self.proven(key, proofs, None),
            Input::Ended { key, proofs, dir } => self.ended(key, proofs, dir),
            Input::ProvenOne { key, proof } => match proof {
                Proof::Process(p) => self.proven(key, Proofs::default(), Some(p)),
                other => self.proven(key, Proofs::of(other), None),
            },
            Input::ProcessStarted { key, process } => {
                let fits = self.book.edit(key, |r| {
                    let fits = r.holder == Holder::Job && r.owed.owes(Proof::TasksJoined);
                    if fits {
                        r.owed.add(Proof::Process(process));
                    }
                    fits
                });
                if fits != Some(true) {
                    self.fx
                        .illegal(format_args!("process {process} started for lease {key}"));
                }
            }
            Input::Late { key, proof, detail } => {
                self.missing(key, proof, record::Why::Late, detail, None)
            }
            Input::Unproven { key, proof, detail } => {
                self.missing(key, proof, record::Why::Unproven, detail, None)
            }
            Input::TempDirFailed { key, detail, error } => self.temp_dir_failed(key, detail, error),
            Input::DeviceLost {
                key,
                device,
                generation,
                reason,
            } => self.device_lost(key, device, generation, reason, record::Replacer::Leasehold),
            Input::EngineDeviceLost {
                key,
                device,
                generation,
                reason,
            } => self.device_lost(key, device, generation, reason, record::Replacer::Engine),
            Input::DeviceReplaced { device, generation } => {
                self.device_replaced(device, generation)
            }
            Input::ReleaseRequested { key } => self.release_requested(key),
            Input::Released { key, result } => self.released(key, result),
            Input::LeaseLost { key, reason } => self.lease_lost(key, reason),
            Input::OrphanExpired => {
                self.counters.orphan_expired_total += 1;
                self.fx.push(Effect::OrphanCounted);
            }
            Input::Shutdown => self.shutdown(),
            Input::ShutdownGraceOver => self.shutdown_grace_over(),
            Input::ShutdownDeadline => self.shutdown_deadline(),
            Input::GpuClosed => self.gpu_closed(),
            Input::BrokerClosed => self.broker_closed(),
        }
        if !self.reclaims.is_empty() {
            self.answer_reclaims();
        }
        self.admit();
    }

    /// After a batch of inputs: finish a shutdown that has nothing left to wait for. (Every
    /// input was admitted as it was applied.)
    pub(crate) fn settle(&mut self) {
        self.maybe_stopped();
    }

    /// Moves the keys of the leases touched since the last call into `into` (sorted, once
    /// each).
    pub(crate) fn take_touched(&mut self, into: &mut Vec<LeaseKey>) {
        self.book.take_touched(into);
    }

    /// The capacity each part holds on to (the memory tests).
    #[cfg(test)]
    pub(crate) fn retained(&self) -> Retained {
        let (waiters, acquiring) = self.admission.retained();
        Retained {
            waiters,
            acquiring,
            leases: self.book.retained(),
            effects: self.fx.0.capacity(),
        }
    }

    /// Gives back the memory a flood left behind (amortised O(1)).
    pub(crate) fn shrink_idle(&mut self) {
        self.admission.shrink();
        self.book.shrink();
        // One batch of a flood can ask for tens of thousands of effects at once.
        shrink_deque(&mut self.fx.0);
    }

    // --- views (no decisions: what the lease table and `Stats` show) ---

    /// One lease, for its table row.
    pub(crate) fn view(&self, key: LeaseKey) -> Option<&LeaseRecord> {
        self.book.get(key)
    }

    pub(crate) fn figures(&self) -> Figures {
        let t = self.book.tally();
        Figures {
            active: t.held - t.quarantined,
            waiting: self.admission.waiting(),
            quarantined: t.quarantined,
            draining: t.draining,
            held_slots: self.held_slots(),
            leases: t.leases,
            capacity: self.admission.capacity,
            counters: self.counters,
        }
    }

    /// Waiters served from the queue so far: the aging rule's clock.
    #[cfg(test)]
    pub(crate) fn served(&self) -> u64 {
        self.admission.queue.served
    }

    #[cfg(test)]
    pub(crate) fn has_effects(&self) -> bool {
        !self.fx.0.is_empty()
    }

    #[cfg(test)]
    pub(crate) fn lease(&self, key: LeaseKey) -> Option<&LeaseRecord> {
        self.book.get(key)
    }

    #[cfg(test)]
    pub(crate) fn active(&self) -> usize {
        self.figures().active
    }

    #[cfg(test)]
    pub(crate) fn quarantined(&self) -> usize {
        self.figures().quarantined
    }

    #[cfg(test)]
    pub(crate) fn waiting(&self) -> usize {
        self.figures().waiting
    }

    #[cfg(test)]
    pub(crate) fn counters(&self) -> Counters {
        self.counters
    }

    /// Slots its pool holds (0 without one).
    #[cfg(test)]
    pub(crate) fn pool_held(&self) -> usize {
        self.admission.pool.as_ref().map_or(0, Pool::held)
    }

    /// Its pool's size, when it owns one.
    #[cfg(test)]
    pub(crate) fn pool_size(&self) -> Option<u32> {
        self.admission.pool.as_ref().map(Pool::slots)
    }

    /// Per slot of its pool, the lease id holding it (0: free).
    #[cfg(test)]
    pub(crate) fn pool_holders(&self) -> Vec<u64> {
        self.admission
            .pool
            .as_ref()
            .map_or_else(Vec::new, Pool::holders)
    }
}

#[cfg(test)]
mod tests;
