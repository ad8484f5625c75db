//! Granting: who gets a slot, and when, on admission's state (`admission.rs`): `try_acquire`
//! callers served in their own turn, the waiters in their order, the broker asked for what the
//! queue still lacks.
//!
//! Every path that hands a slot to someone — a token from the broker, the slots of a request
//! that withdrew or was refused while gathering, a grant nobody took, a resize, a reclaim, a
//! `try_acquire` — puts the token in hand ([`Admission::spare`]) and calls [`Core::admit`], the
//! one function that grants. It checks, for each token, the capacity in force and whether the
//! slot is retired (above a lowered pool size), and gives it to whoever is next in line, or
//! back to the broker; then it asks the broker for what the queue still lacks, within the
//! capacity, and drops acquires nobody needs any more.

use super::Core;
use super::protocol::{
    Ask, ControlId, Effect, LeaseKey, Reply, RequestId, WaiterId, WaitingEntry, Want,
};
use super::record::{Holder, LeaseRecord, Renewal};
use crate::broker::{BrokerError, SlotToken};
use crate::error::{AcquireError, ResizeError};
use crate::job::Priority;

use super::admission::{Gather, Served, capacity};

/// Rounds of [`Core::admit`] before it reports a defect: two settle every step of a sound core
/// (the pool's slots taken, then placed); the rest is margin.
const ADMIT_ROUNDS: usize = 8;

impl Core {
    /// Slots held or on their way: every lease's tokens not yet released, the gathering
    /// waiters', those in hand.
    #[inline]
    pub(super) fn held_slots(&self) -> usize {
        self.book.tally().held + self.admission.gathered()
    }

    /// Slots committed to callers (or in hand): those whose release is in flight no longer
    /// count. A token may be given to a waiter only while this stays within the capacity.
    #[inline]
    fn committed(&self) -> usize {
        let t = self.book.tally();
        t.held - t.releasing + self.admission.gathered()
    }

    /// Tokens that may still be asked for without passing the capacity (a release in flight
    /// still holds its slot at the broker).
    #[inline]
    fn room(&self) -> usize {
        match self.admission.capacity {
            Some(cap) => cap.saturating_sub(self.held_slots() + self.admission.acquiring.len()),
            None => usize::MAX,
        }
    }

    pub(super) fn enqueue(&mut self, waiter: WaiterId, ask: Ask) {
        let a = &self.admission;
        let refuse = if !self.ending.is_serving() {
            Some(AcquireError::Stopped)
        } else if (ask.slots > 1 || ask.now_only) && !a.exact() {
            Some(AcquireError::Unsupported(if ask.now_only {
                "try_acquire"
            } else {
                "multi-slot leases"
            }))
        } else if ask.slots == 0 || a.capacity.is_some_and(|c| ask.slots as usize > c) {
            Some(AcquireError::SlotCount {
                wanted: ask.slots,
                capacity: a.capacity.map_or(u32::MAX, |c| c as u32),
            })
        } else if ask.now_only
            && (a.queue.len() > 0 || a.gather.is_some() || self.room() < ask.slots as usize)
        {
            // Nobody may be overtaken, and the slots must be free now.
            Some(AcquireError::NoSlotFree)
        } else {
            None
        };
        if let Some(error) = refuse {
            return self.fx.push(Effect::Refuse { waiter, error });
        }
        if !ask.now_only {
            if ask.slots == 1 && self.grant_at_once(waiter, ask) {
                return;
            }
            return self.admission.queue.push(waiter, ask);
        }
        // Served in this step: its slots taken from the pool, placed by `admit`.
        self.admission.tries.push(Gather {
            served: Served {
                waiter,
                want: ask.want,
                slots: ask.slots,
                priority: ask.priority,
            },
            tokens: Vec::with_capacity(ask.slots as usize),
        });
        // Only the pool serves `try_acquire`: its slots are taken here, placed by `admit`.
        for _ in 0..ask.slots {
            self.take_from_pool(Some(waiter));
        }
    }

    /// Takes a slot from the supervisor's own pool into hand (for the `try_acquire` caller
    /// `tried`, or for the queue), in the step that asked: no effect, no input. The pool refuses
    /// only if the core's count and the pool's disagree; that failure goes where a broker's
    /// would.
    fn take_from_pool(&mut self, tried: Option<WaiterId>) {
        let Some(pool) = self.admission.pool.as_mut() else {
            return self.fx.illegal(format_args!(
                "a slot taken from a pool this core does not own"
            ));
        };
        match pool.take() {
            Ok(token) => self.admission.spare.push((token, tried)),
            Err(err) => self.acquire_failed(tried, true, err),
        }
    }

    /// The short path: a caller asking for one slot of the pool while nobody waits, nothing is
    /// in hand and there is room is served in this step, without passing through the queue.
    /// What it keeps: FIFO (nobody is ahead), the capacity and retirement checks (the same
    /// [`Core::placeable`] as `admit`'s), the record and its tally (the same `deliver`). The
    /// aging clock counts waiters served from the queue: with nobody queued, no deadline is
    /// measured against it, so this grant leaves it as it is. Whether it served the caller; if
    /// not, the caller is queued as any other, and a slot already taken is in hand for `admit`.
    fn grant_at_once(&mut self, waiter: WaiterId, ask: Ask) -> bool {
        let a = &self.admission;
        let alone = a.queue.len() == 0 && a.gather.is_none() && a.tries.is_empty();
        if !(alone && a.spare.is_empty() && self.room() >= 1) {
            return false;
        }
        let Some(Ok(token)) = self.admission.pool.as_mut().map(|p| p.take()) else {
            // Not the pool, or it refused: the queue's path asks again and handles the failure.
            return false;
        };
        if !self.placeable(token) {
            self.admission.spare.push((token, None));
            return false;
        }
        let served = Served {
            waiter,
            want: ask.want,
            slots: 1,
            priority: ask.priority,
        };
        self.deliver(served, token, Box::default());
        true
    }

    /// Whether `token`, out of hand, may go to a caller: the supervisor serves, the slots
    /// committed to callers stay within the capacity in force, and the slot is not retired
    /// (above a lowered pool size).
    #[inline]
    fn placeable(&self, token: SlotToken) -> bool {
        let over = self
            .admission
            .capacity
            .is_some_and(|cap| self.committed() + 1 > cap);
        self.ending.is_serving() && !over && !self.admission.retired(token)
    }

    /// A waiter leaves without a slot (cancelled, timed out, refused): from the queue, from the
    /// `try_acquire` callers, or from the head while gathering (its tokens go back in hand).
    /// Ignored once it has been served. Whether it was there.
    pub(super) fn withdraw(&mut self, waiter: WaiterId, error: AcquireError) -> bool {
        let a = &mut self.admission;
        if a.queue.remove(waiter).is_some() {
            self.fx.push(Effect::Refuse { waiter, error });
            return true;
        }
        if let Some(i) = a.tries.iter().position(|t| t.served.waiter == waiter) {
            let tried = a.tries.swap_remove(i);
            a.spare.extend(tried.tokens.into_iter().map(|t| (t, None)));
            self.fx.push(Effect::Refuse { waiter, error });
            return true;
        }
        if a.gather.as_ref().is_some_and(|g| g.served.waiter == waiter) {
            let gather = a.gather.take().expect("checked");
            a.spare.extend(gather.tokens.into_iter().map(|t| (t, None)));
            self.fx.push(Effect::Refuse { waiter, error });
            return true;
        }
        false
    }

    /// The waiter that hears a broker's failure: the longest waiter (the gathering head first,
    /// whose tokens then go back in hand). Tokens and failures alike are fungible.
    fn refuse_longest(&mut self, error: AcquireError) {
        if let Some(g) = &self.admission.gather {
            let waiter = g.served.waiter;
            self.withdraw(waiter, error);
        } else if let Some(served) = self.admission.queue.pop() {
            self.fx.push(Effect::Refuse {
                waiter: served.waiter,
                error,
            });
        }
    }

    pub(super) fn acquired(&mut self, request: RequestId, result: Result<SlotToken, BrokerError>) {
        // Only another broker's acquires come back as inputs: none is for a `try_acquire`
        // caller, which only the pool serves.
        let queued = self.admission.acquiring.remove(&request);
        let failure = match result {
            Ok(token) => match self.book.check_token(token) {
                Ok(()) => {
                    self.admission.spare.push((token, None));
                    return;
                }
                Err(refused) => {
                    // Not released: releasing a duplicate could free the live holder's slot.
                    self.fx.push(Effect::TokenRefused(refused.clone()));
                    BrokerError::invalid_response(refused)
                }
            },
            Err(err) => err,
        };
        self.acquire_failed(None, queued, failure);
    }

    /// A failed acquire: its `try_acquire` caller hears it, or else the longest waiter when the
    /// acquire served the queue.
    fn acquire_failed(&mut self, tried: Option<WaiterId>, queued: bool, failure: BrokerError) {
        let error = AcquireError::Failed(failure);
        match tried {
            Some(waiter) => {
                self.withdraw(waiter, error);
            }
            None if queued => self.refuse_longest(error),
            // An aborted acquire's failure: nobody waits for it.
            None => {}
        }
    }

    /// `resize`: validated and applied here. Lowering the capacity never revokes a lease: it
    /// takes effect as slots come back, and those above the new size are retired.
    pub(super) fn resize(&mut self, control: ControlId, slots: u32) {
        let a = &mut self.admission;
        let reply = if !self.ending.is_serving() {
            Err(ResizeError::Stopped)
        } else if slots == 0 {
            Err(ResizeError::Zero)
        } else if !a.exact() {
            Err(ResizeError::Unsupported)
        } else {
            if let Some(pool) = a.pool.as_mut() {
                pool.resize(slots);
            }
            let capacity = capacity(Some(slots), a.gpu_cap).unwrap_or(slots);
            a.capacity = Some(capacity as usize);
            a.strip_retired();
            // Waiters that can no longer ever be served hear it now.
            let error = |wanted| AcquireError::SlotCount { wanted, capacity };
            for (waiter, wanted) in self.admission.queue.over(capacity) {
                self.withdraw(waiter, error(wanted));
            }
            if let Some(g) = &self.admission.gather
                && g.served.slots > capacity
            {
                let Served { waiter, slots, .. } = g.served;
                self.withdraw(waiter, error(slots));
            }
            Ok(capacity)
        };
        self.fx.push(Effect::Reply {
            control,
            reply: Reply::Resized(reply),
        });
    }

    /// `waiters`: every caller waiting, in the order it is served — the `try_acquire` callers
    /// being served, the gathering head, then the queue.
    pub(super) fn list_waiters(&mut self, control: ControlId) {
        let a = &self.admission;
        let entry = |g: &Gather| WaitingEntry {
            waiter: g.served.waiter,
            priority: g.served.priority,
            slots: g.served.slots,
            gathered: g.tokens.len() as u32,
        };
        let list: Vec<WaitingEntry> = a
            .tries
            .iter()
            .map(entry)
            .chain(a.gather.iter().map(entry))
            .chain(a.queue.listed().into_iter().map(|(_, s)| WaitingEntry {
                waiter: s.waiter,
                priority: s.priority,
                slots: s.slots,
                gathered: 0,
            }))
            .collect();
        self.fx.push(Effect::Reply {
            control,
            reply: Reply::Waiters(list.into()),
        });
    }

    /// The one function that grants. Places every token in hand — a retired one, or one that
    /// would take the slots committed past the capacity in force, goes back to the broker;
    /// the others go to the `try_acquire` caller they were asked for, the gathering head, or
    /// the next waiter in line (or back, when nobody waits) — then asks the broker for what the
    /// queue still lacks, within the capacity, and drops acquires nobody needs any more.
    pub(super) fn admit(&mut self) {
        // The pool's slots come into hand at once: placed in the next round. A round takes what
        // the queue lacks within the room left, so one more round settles it; a core that
        // kept taking would be a defect, reported rather than spinning in the supervisor's turn.
        for _ in 0..ADMIT_ROUNDS {
            if !self.admit_round() {
                return;
            }
        }
        self.fx.illegal(format_args!(
            "admission did not settle in {ADMIT_ROUNDS} rounds"
        ));
    }

    /// One round of [`Core::admit`]: whether slots were taken from the pool, to be placed.
    fn admit_round(&mut self) -> bool {
        // The common case (a proof, a grant's own answer): nothing in hand, nothing to ask for.
        if self.admission.spare.is_empty()
            && self.admission.queue_demand() == self.admission.acquiring.len()
        {
            return false;
        }
        let serving = self.ending.is_serving();
        while let Some((token, tried)) = self.admission.next_spare() {
            // `committed` no longer counts this token: it is out of hand.
            if !self.placeable(token) {
                if let Some(waiter) = tried {
                    self.withdraw(waiter, AcquireError::NoSlotFree);
                }
                self.return_surplus(token);
                continue;
            }
            if let Some(waiter) = tried
                && let Some(i) = self
                    .admission
                    .tries
                    .iter()
                    .position(|t| t.served.waiter == waiter)
            {
                self.admission.tries[i].tokens.push(token);
                if self.admission.tries[i].missing() == 0 {
                    let done = self.admission.tries.swap_remove(i);
                    self.deliver_gathered(done);
                }
                continue;
            }
            if let Some(g) = &mut self.admission.gather {
                g.tokens.push(token);
                if g.missing() == 0 {
                    let done = self.admission.gather.take().expect("checked");
                    self.deliver_gathered(done);
                }
                continue;
            }
            match self.admission.queue.pop() {
                Some(served) if served.slots == 1 => self.deliver(served, token, Box::default()),
                Some(served) => {
                    let mut tokens = Vec::with_capacity(served.slots as usize);
                    tokens.push(token);
                    self.admission.gather = Some(Gather { served, tokens });
                }
                None => self.return_surplus(token),
            }
        }
        if !serving {
            return false;
        }
        let a = &self.admission;
        let (demand, asked) = (a.queue_demand(), a.acquiring.len());
        if demand > asked {
            let n = (demand - asked).min(self.room());
            if self.admission.exact() {
                // The pool answers in this step; nothing is ever in flight from it.
                for _ in 0..n {
                    self.take_from_pool(None);
                }
                return n > 0;
            }
            // The head's id travels with each request, as a hint (tokens are fungible). (Only
            // the pool serves multi-slot waiters, so no other broker has a gathering head.)
            let for_waiter = self.admission.queue.head();
            for _ in 0..n {
                let request = self.admission.next_request();
                self.admission.acquiring.insert(request);
                self.fx.push(Effect::Acquire {
                    request,
                    for_waiter,
                });
            }
        } else if asked > demand {
            // Nobody needs what these would bring: drop the newest (a broker must not keep a
            // queue place for a dropped acquire). An answer already on its way arrives anyway
            // and is placed like any token in hand. (The pool is never asked in flight: there
            // is never one of its acquires to drop.)
            let mut newest: Vec<RequestId> = self.admission.acquiring.iter().copied().collect();
            newest.sort_unstable_by(|a, b| b.cmp(a));
            for request in newest.into_iter().take(asked - demand) {
                self.admission.acquiring.remove(&request);
                self.fx.push(Effect::AbortAcquire { request });
            }
        }
        false
    }

    /// Shutdown: every waiter not served yet hears `SUPERVISOR_STOPPED`, every acquire in
    /// flight is dropped; their tokens go back. Returns how many waiters were refused.
    pub(super) fn refuse_everyone(&mut self) -> usize {
        let mut waiters: Vec<WaiterId> = Vec::new();
        if let Some(g) = &self.admission.gather {
            waiters.push(g.served.waiter);
        }
        waiters.extend(self.admission.tries.iter().map(|t| t.served.waiter));
        let mut refused = 0;
        for waiter in waiters {
            refused += usize::from(self.withdraw(waiter, AcquireError::Stopped));
        }
        while let Some(served) = self.admission.queue.pop() {
            refused += 1;
            self.fx.push(Effect::Refuse {
                waiter: served.waiter,
                error: AcquireError::Stopped,
            });
        }
        let mut requests: Vec<RequestId> = self.admission.acquiring.drain().collect();
        requests.sort_unstable();
        for request in requests {
            self.fx.push(Effect::AbortAcquire { request });
        }
        refused
    }

    fn deliver_gathered(&mut self, done: Gather) {
        let mut tokens = done.tokens.into_iter();
        let first = tokens.next().expect("a gathered waiter has tokens");
        self.deliver(done.served, first, tokens.collect());
    }

    fn deliver(&mut self, served: Served, token: SlotToken, more: Box<[SlotToken]>) {
        let holder = match served.want {
            Want::Lease => Holder::Explicit,
            Want::Job => Holder::Job,
        };
        let mut record = LeaseRecord::new(token, more.clone(), holder, served.priority);
        if self.renews {
            record.renewal = Renewal::Running;
        }
        self.counters.acquired_total += record.slots() as u64;
        let key = self.book.insert(record);
        if self.renews {
            self.fx.push(Effect::StartRenewal { key, token });
        }
        self.fx.push(Effect::Deliver {
            waiter: served.waiter,
            key,
            token,
            more,
        });
    }

    /// A token nobody may use: held as a surplus lease while it goes straight back.
    fn return_surplus(&mut self, token: SlotToken) {
        self.counters.acquired_total += 1;
        let key = self.book.insert(LeaseRecord::new(
            token,
            Box::default(),
            Holder::Surplus,
            Priority::Normal,
        ));
        self.start_release(key);
    }

    /// A grant nobody took (its caller left): not counted, and its tokens go back in hand.
    pub(super) fn undelivered(&mut self, key: LeaseKey) {
        // Only a grant being handed over (not a surplus token, not a lease already releasing).
        let fits = self
            .book
            .get(key)
            .is_some_and(|r| r.holder != Holder::Surplus && !r.is_releasing());
        let Some(record) = fits.then(|| self.book.remove(key)).flatten() else {
            return self.fx.illegal(format_args!(
                "undelivered lease {key} was not being delivered"
            ));
        };
        self.counters.acquired_total -= record.slots() as u64;
        if record.renewal == Renewal::Running {
            self.fx.push(Effect::StopRenewal { key });
        }
        self.fx.push(Effect::Forget { key });
        self.admission
            .spare
            .extend(record.tokens().map(|t| (t, None)));
    }
}
