//! Admission's state: the waiter queue (FIFO per priority class, aging across classes), the
//! multi-slot request gathering at its head, the broker acquires in flight, the tokens in hand,
//! and the capacity rule. What the core does with it (who gets a slot, and when) is in
//! `grant.rs`, above the core's face.

use std::collections::VecDeque;

use rustc_hash::{FxHashMap, FxHashSet};

use super::protocol::{Ask, RequestId, WaiterId, Want};
use super::shrink::{shrink_deque, shrink_map, shrink_set};
use crate::broker::{Pool, SlotToken};
use crate::job::{PRIORITY_AGING_GRANTS, Priority};

/// The capacity rule, the one place it is written: the supervisor grants up to the broker's
/// capacity (the pool's size), capped by the GPU sub-slots when it owns GPU devices; `None` when
/// neither says. At start and after every resize.
pub(crate) fn capacity(broker: Option<u32>, gpu_slots: Option<u32>) -> Option<u32> {
    match (broker, gpu_slots) {
        (Some(b), Some(g)) => Some(b.min(g)),
        (b, g) => b.or(g),
    }
}

/// A queued waiter in 8 bytes: its id shifted left once, what it wants in the low bit (waiter
/// ids come from a counter and never reach 2^63). The flood keeps 100 000 of these in a
/// `VecDeque`: half the size of a `(WaiterId, Want)` pair, about 10 bytes per waiting job.
#[derive(Debug, Clone, Copy)]
pub(super) struct Queued(u64);

impl Queued {
    pub(super) fn new(waiter: WaiterId, want: Want) -> Self {
        debug_assert!(waiter.0 < 1 << 63, "waiter id {waiter} out of range");
        Self(waiter.0 << 1 | u64::from(want == Want::Job))
    }

    pub(super) fn waiter(self) -> WaiterId {
        WaiterId(self.0 >> 1)
    }

    pub(super) fn want(self) -> Want {
        if self.0 & 1 == 1 {
            Want::Job
        } else {
            Want::Lease
        }
    }
}

/// A queued waiter and its deadline under the aging rule (see [`Priority`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Entry {
    queued: Queued,
    deadline: u64,
}

/// The waiters: FIFO within each priority class, the earliest deadline first across classes,
/// with O(1) withdrawal (lazy deletion).
#[cfg_attr(test, derive(Clone))]
#[derive(Debug, Default)]
pub(super) struct WaitQueue {
    classes: [VecDeque<Entry>; Priority::COUNT],
    live: FxHashSet<WaiterId>,
    /// The slots of the waiters that want more than one (absent: one).
    multi: FxHashMap<WaiterId, u32>,
    /// Slots wanted by the live waiters, all together.
    wanted: usize,
    /// Waiters served from the queue so far: the clock of the aging rule.
    pub(super) served: u64,
}

impl WaitQueue {
    #[inline]
    pub(super) fn push(&mut self, waiter: WaiterId, ask: Ask) {
        if !self.live.insert(waiter) {
            return;
        }
        if ask.slots > 1 {
            self.multi.insert(waiter, ask.slots);
        }
        self.wanted += ask.slots as usize;
        let rank = ask.priority.rank();
        let deadline = self.served + rank as u64 * PRIORITY_AGING_GRANTS;
        self.classes[rank].push_back(Entry {
            queued: Queued::new(waiter, ask.want),
            deadline,
        });
    }

    /// Takes a waiter out of the queue; its slots, if it was in it.
    pub(super) fn remove(&mut self, waiter: WaiterId) -> Option<u32> {
        if !self.live.remove(&waiter) {
            return None;
        }
        let slots = self.slots_of(waiter);
        self.wanted -= slots as usize;
        // Withdrawn ids stay queued until popped; compacted when the entries pass twice the
        // live waiters and sixteen, so that a long-lived head with many withdrawn waiters
        // behind it cannot grow the queue without bound (amortised O(1) per withdrawal).
        if self.queued() > 2 * self.live.len() + 16 {
            let live = &self.live;
            for class in &mut self.classes {
                class.retain(|e| live.contains(&e.queued.waiter()));
            }
        }
        Some(slots)
    }

    /// Entries in the classes, withdrawn ones included.
    fn queued(&self) -> usize {
        self.classes.iter().map(VecDeque::len).sum()
    }

    /// The class whose live front is served next: the earliest deadline, then the earliest
    /// caller. Drops withdrawn entries from the fronts.
    fn next_class(&mut self) -> Option<usize> {
        let live = &self.live;
        let mut best: Option<(u64, WaiterId, usize)> = None;
        for (rank, class) in self.classes.iter_mut().enumerate() {
            while let Some(e) = class.front() {
                if live.contains(&e.queued.waiter()) {
                    break;
                }
                class.pop_front();
            }
            if let Some(e) = class.front() {
                let key = (e.deadline, e.queued.waiter(), rank);
                if best.is_none_or(|b| key < b) {
                    best = Some(key);
                }
            }
        }
        best.map(|(_, _, rank)| rank)
    }

    /// Serves the next waiter: who, what it wants, its slots, its class.
    pub(super) fn pop(&mut self) -> Option<Served> {
        loop {
            // One class in use (the common case): its front, withdrawn entries skipped here.
            let rank = match self.classes.iter().filter(|c| !c.is_empty()).count() {
                0 => return None,
                1 => self.classes.iter().position(|c| !c.is_empty())?,
                _ => self.next_class()?,
            };
            let entry = self.classes[rank].pop_front()?;
            let waiter = entry.queued.waiter();
            if !self.live.remove(&waiter) {
                continue;
            }
            let slots = self.slots_of(waiter);
            self.wanted -= slots as usize;
            self.served += 1;
            return Some(Served {
                waiter,
                want: entry.queued.want(),
                slots,
                priority: PRIORITIES[rank],
            });
        }
    }

    /// Takes a leaving waiter's slot count out of `multi` (one when it is not there).
    fn slots_of(&mut self, waiter: WaiterId) -> u32 {
        if self.multi.is_empty() {
            return 1;
        }
        self.multi.remove(&waiter).unwrap_or(1)
    }

    /// The waiter served next, without removing it.
    pub(super) fn head(&mut self) -> Option<WaiterId> {
        let rank = self.next_class()?;
        self.classes[rank].front().map(|e| e.queued.waiter())
    }

    /// Waiters asking for more slots than `capacity`, in id order.
    pub(super) fn over(&self, capacity: u32) -> Vec<(WaiterId, u32)> {
        let mut over: Vec<(WaiterId, u32)> = self
            .multi
            .iter()
            .filter(|(_, slots)| **slots > capacity)
            .map(|(w, s)| (*w, *s))
            .collect();
        over.sort_unstable();
        over
    }

    pub(super) fn len(&self) -> usize {
        self.live.len()
    }

    /// The live waiters with their class, in the order `pop` would serve them now (earliest
    /// deadline, then earliest caller).
    pub(super) fn listed(&self) -> Vec<(u64, Served)> {
        let mut out: Vec<(u64, Served)> = self
            .classes
            .iter()
            .enumerate()
            .flat_map(|(rank, class)| class.iter().map(move |e| (rank, e)))
            .filter(|(_, e)| self.live.contains(&e.queued.waiter()))
            .map(|(rank, e)| {
                let waiter = e.queued.waiter();
                let served = Served {
                    waiter,
                    want: e.queued.want(),
                    slots: self.multi.get(&waiter).copied().unwrap_or(1),
                    priority: PRIORITIES[rank],
                };
                (e.deadline, served)
            })
            .collect();
        out.sort_by_key(|(deadline, s)| (*deadline, s.waiter));
        out
    }

    /// What it holds (the memory tests): entries queued (withdrawn ones included), live
    /// waiters, and waiters in the multi-slot map.
    #[cfg(test)]
    pub(super) fn entries(&self) -> (usize, usize, usize) {
        (self.queued(), self.live.len(), self.multi.len())
    }

    /// The capacity its queues and maps hold on to (the memory tests).
    #[cfg(test)]
    fn retained(&self) -> usize {
        self.classes.iter().map(VecDeque::capacity).sum::<usize>()
            + self.live.capacity()
            + self.multi.capacity()
    }

    fn shrink(&mut self) {
        for class in &mut self.classes {
            shrink_deque(class);
        }
        shrink_set(&mut self.live);
        shrink_map(&mut self.multi);
    }
}

/// The classes by rank.
const PRIORITIES: [Priority; Priority::COUNT] = [Priority::High, Priority::Normal, Priority::Low];

/// A waiter taken from the queue (or a `try_acquire` caller) to be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Served {
    pub(super) waiter: WaiterId,
    pub(super) want: Want,
    pub(super) slots: u32,
    pub(super) priority: Priority,
}

/// A waiter being served that gathers its tokens (a multi-slot request at the head of the
/// queue, or a `try_acquire` caller whose tokens, taken from the pool in its step, are being
/// placed).
#[cfg_attr(test, derive(Clone))]
#[derive(Debug)]
pub(super) struct Gather {
    pub(super) served: Served,
    pub(super) tokens: Vec<SlotToken>,
}

impl Gather {
    pub(super) fn missing(&self) -> usize {
        self.served.slots as usize - self.tokens.len()
    }
}

/// Admission's state. Its one granting function is [`Core::admit`].
#[cfg_attr(test, derive(Clone))]
#[derive(Debug)]
pub(super) struct Admission {
    /// The capacity in force: the broker's (or the pool's size), capped by the GPU sub-slots.
    pub(super) capacity: Option<usize>,
    /// The supervisor's own in-process pool, owned here: its slots are taken and given back
    /// in the step that grants or ends a lease, with no effect in between. Its slots are
    /// numbered `0..size`, and those at or above a lowered size are retired. `None` for any
    /// other broker. Only the pool's capacity is exact and nobody else takes from it, so only
    /// it serves multi-slot leases, `try_acquire` and resizing.
    pub(super) pool: Option<Pool>,
    /// GPU sub-slots, which cap the capacity.
    pub(super) gpu_cap: Option<u32>,
    pub(super) queue: WaitQueue,
    /// The multi-slot waiter at the head, gathering its tokens.
    pub(super) gather: Option<Gather>,
    /// `try_acquire` callers admitted in this step, their tokens being placed (empty between
    /// steps: only the pool serves them, and it answers at once).
    pub(super) tries: Vec<Gather>,
    /// Broker acquires in flight for the queue (never the pool's: it answers at once).
    pub(super) acquiring: FxHashSet<RequestId>,
    next_request: RequestId,
    /// Tokens in hand, not yet placed (with the `try_acquire` caller they were asked for).
    pub(super) spare: Vec<(SlotToken, Option<WaiterId>)>,
}

impl Admission {
    pub(super) fn new(capacity: Option<u32>, pool: Option<Pool>, gpu_cap: Option<u32>) -> Self {
        Self {
            capacity: capacity.map(|c| c as usize),
            pool,
            gpu_cap,
            queue: WaitQueue::default(),
            gather: None,
            tries: Vec::new(),
            acquiring: FxHashSet::default(),
            next_request: RequestId(1),
            spare: Vec::new(),
        }
    }

    #[inline]
    pub(super) fn exact(&self) -> bool {
        self.pool.is_some()
    }

    /// Above a lowered pool size: never handed on.
    #[inline]
    pub(super) fn retired(&self, token: SlotToken) -> bool {
        self.pool
            .as_ref()
            .is_some_and(|pool| token.slot_id() >= pool.slots())
    }

    /// Tokens held by waiters being served, and in hand.
    #[inline]
    pub(super) fn gathered(&self) -> usize {
        self.gather.as_ref().map_or(0, |g| g.tokens.len())
            + self.tries.iter().map(|t| t.tokens.len()).sum::<usize>()
            + self.spare.len()
    }

    /// Slots the queue still lacks: its waiters', and what the gathering head misses.
    #[inline]
    pub(super) fn queue_demand(&self) -> usize {
        self.queue.wanted + self.gather.as_ref().map_or(0, Gather::missing)
    }

    /// Waiters that are not served yet.
    pub(super) fn waiting(&self) -> usize {
        self.queue.len() + self.tries.len() + usize::from(self.gather.is_some())
    }

    pub(super) fn next_request(&mut self) -> RequestId {
        self.next_request.take()
    }

    /// Slots gathered by a waiter being served that a lowered pool size has retired go back in
    /// hand (a `try_acquire` caller's with its id), to be returned to the broker by `admit`.
    pub(super) fn strip_retired(&mut self) {
        let Some(size) = self.pool.as_ref().map(Pool::slots) else {
            return;
        };
        let gathering = self.gather.iter_mut().map(|g| (g, None));
        let trying = self.tries.iter_mut().map(|t| {
            let waiter = t.served.waiter;
            (t, Some(waiter))
        });
        for (g, tried) in gathering.chain(trying) {
            g.tokens.retain(|t| {
                let retired = t.slot_id() >= size;
                if retired {
                    self.spare.push((*t, tried));
                }
                !retired
            });
        }
    }

    /// The next token in hand to place: a retired one first, so that a lowered capacity sheds
    /// the slots above the pool's new size before any other.
    #[inline]
    pub(super) fn next_spare(&mut self) -> Option<(SlotToken, Option<WaiterId>)> {
        if self.spare.is_empty() {
            return None;
        }
        let i = self
            .spare
            .iter()
            .position(|(t, _)| self.retired(*t))
            .unwrap_or(0);
        Some(self.spare.remove(i))
    }

    /// The capacity held on to by the waiter queue, and by the acquires in flight (the memory
    /// tests).
    #[cfg(test)]
    pub(super) fn retained(&self) -> (usize, usize) {
        (self.queue.retained(), self.acquiring.capacity())
    }

    pub(super) fn shrink(&mut self) {
        self.queue.shrink();
        shrink_set(&mut self.acquiring);
    }
}
