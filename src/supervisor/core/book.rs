//! The lease book: every lease record, the indexes that refuse a duplicate token, and the
//! tallies `Stats` shows — all in slots. Every change to a record goes through
//! [`Book::edit`], which keeps the tallies in step and marks the lease's table row for update,
//! so no handler can forget to.

use rustc_hash::FxHashMap;

use super::protocol::LeaseKey;
use super::record::{Holder, LeaseRecord, Phase};
use super::shrink::shrink_map;
use crate::broker::SlotToken;

/// Slot counts over every record, kept in step by [`Book`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Tally {
    /// Slots held from the broker: every record's tokens whose release has not answered.
    pub(crate) held: usize,
    /// Of `held`, those whose release is in flight.
    pub(crate) releasing: usize,
    /// Of `held`, those of quarantined leases.
    pub(crate) quarantined: usize,
    /// Of `held`, those of jobs whose body has ended and whose physical end or temp dir is
    /// still being proven.
    pub(crate) draining: usize,
    /// Leases held by callers (surplus tokens on their way back are not leases).
    pub(crate) leases: usize,
}

impl Tally {
    /// The phase's own count, if it has one.
    #[inline]
    fn of_phase(&mut self, phase: Phase) -> Option<&mut usize> {
        match phase {
            Phase::Releasing => Some(&mut self.releasing),
            Phase::Quarantined => Some(&mut self.quarantined),
            Phase::Draining => Some(&mut self.draining),
            Phase::Running => None,
        }
    }

    #[inline]
    fn add(&mut self, part: Part) {
        self.held += part.held;
        if let Some(n) = self.of_phase(part.phase) {
            *n += part.held;
        }
        self.leases += usize::from(part.lease);
    }

    #[inline]
    fn sub(&mut self, part: Part) {
        // Only what `add` put in is taken out: the counts never go below zero.
        self.held -= part.held;
        if let Some(n) = self.of_phase(part.phase) {
            *n -= part.held;
        }
        self.leases -= usize::from(part.lease);
    }
}

/// One record's share of the tally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Part {
    held: usize,
    phase: Phase,
    lease: bool,
}

impl Part {
    #[inline]
    fn of(record: &LeaseRecord) -> Self {
        Self {
            held: record.held(),
            phase: record.phase(),
            lease: record.holder != Holder::Surplus,
        }
    }
}

#[cfg_attr(test, derive(Clone))]
#[derive(Debug)]
pub(crate) struct Book {
    records: FxHashMap<LeaseKey, LeaseRecord>,
    /// Check every token against the live leases (invariant 2). Off only for the supervisor's
    /// own in-process broker, which cannot hand out a live slot or lease id.
    check_tokens: bool,
    /// Slot id → the newest lease on it; lease id → its lease (to refuse duplicates).
    by_slot: FxHashMap<u32, LeaseKey>,
    by_lease_id: FxHashMap<u64, LeaseKey>,
    tally: Tally,
    /// Leases whose table row may have changed since the shell last looked.
    touched: Vec<LeaseKey>,
    next_key: LeaseKey,
}

impl Book {
    pub(crate) fn new(check_tokens: bool) -> Self {
        Self {
            records: FxHashMap::default(),
            check_tokens,
            by_slot: FxHashMap::default(),
            by_lease_id: FxHashMap::default(),
            tally: Tally::default(),
            touched: Vec::new(),
            next_key: LeaseKey(1),
        }
    }

    #[inline]
    pub(crate) fn insert(&mut self, record: LeaseRecord) -> LeaseKey {
        let key = self.next_key.take();
        if self.check_tokens {
            // Multi-slot leases come only from the pool, whose tokens are trusted.
            self.by_slot.insert(record.token.slot_id(), key);
            self.by_lease_id.insert(record.token.lease_id(), key);
        }
        self.tally.add(Part::of(&record));
        self.records.insert(key, record);
        self.touch(key);
        key
    }

    /// Changes one record; the tallies follow and its row is marked for update. `None` when
    /// there is no such lease.
    #[inline]
    pub(crate) fn edit<R>(
        &mut self,
        key: LeaseKey,
        f: impl FnOnce(&mut LeaseRecord) -> R,
    ) -> Option<R> {
        let record = self.records.get_mut(&key)?;
        let before = Part::of(record);
        let out = f(record);
        let after = Part::of(record);
        if before != after {
            self.tally.sub(before);
            self.tally.add(after);
        }
        self.touch(key);
        Some(out)
    }

    #[inline]
    pub(crate) fn remove(&mut self, key: LeaseKey) -> Option<LeaseRecord> {
        let record = self.records.remove(&key)?;
        self.tally.sub(Part::of(&record));
        self.touch(key);
        // A newer lease may already hold the slot (see `check_token`).
        if self.check_tokens {
            if self.by_slot.get(&record.token.slot_id()) == Some(&key) {
                self.by_slot.remove(&record.token.slot_id());
            }
            if self.by_lease_id.get(&record.token.lease_id()) == Some(&key) {
                self.by_lease_id.remove(&record.token.lease_id());
            }
        }
        Some(record)
    }

    #[inline]
    fn touch(&mut self, key: LeaseKey) {
        // Consecutive touches of one lease (the common case: a release and its answer) are one.
        if self.touched.last() != Some(&key) {
            self.touched.push(key);
        }
    }

    /// Moves the keys of the leases touched since the last call into `into` (sorted, once
    /// each).
    pub(crate) fn take_touched(&mut self, into: &mut Vec<LeaseKey>) {
        if into.is_empty() {
            // The usual case (the shell hands back an emptied vector): the two vectors trade
            // places, and no key is copied.
            std::mem::swap(into, &mut self.touched);
        } else {
            into.append(&mut self.touched);
        }
        if into.len() > 1 {
            into.sort_unstable();
            into.dedup();
        }
    }

    #[inline]
    pub(crate) fn get(&self, key: LeaseKey) -> Option<&LeaseRecord> {
        self.records.get(&key)
    }

    /// Every lease, by key order (so that effects come out in the same order in every run).
    pub(crate) fn keys_where(&self, f: impl Fn(&LeaseRecord) -> bool) -> Vec<LeaseKey> {
        let mut keys: Vec<LeaseKey> = self
            .records
            .iter()
            .filter(|(_, r)| f(r))
            .map(|(k, _)| *k)
            .collect();
        keys.sort_unstable();
        keys
    }

    pub(crate) fn any(&self, f: impl Fn(&LeaseRecord) -> bool) -> bool {
        self.records.values().any(f)
    }

    #[inline]
    pub(crate) fn tally(&self) -> Tally {
        self.tally
    }

    /// Checks a broker's token against every live lease. A lease whose broker release is in
    /// flight does not conflict: the broker may apply the release and grant the slot again
    /// before the release's answer arrives here (a remote broker, or one shared by several
    /// supervisors); refusing such a token would leak it, since a refused token is never
    /// released.
    #[inline]
    pub(crate) fn check_token(&self, token: SlotToken) -> Result<(), String> {
        if !self.check_tokens {
            return Ok(());
        }
        let live = |key: Option<&LeaseKey>| {
            key.and_then(|k| self.records.get(k))
                .filter(|r| !r.is_releasing())
                .map(|r| r.token)
        };
        if let Some(holder) = live(self.by_slot.get(&token.slot_id())) {
            return Err(format!(
                "broker granted {token} but that slot is held by live {holder}"
            ));
        }
        if let Some(holder) = live(self.by_lease_id.get(&token.lease_id())) {
            return Err(format!(
                "broker granted {token} but that lease id is live as {holder}"
            ));
        }
        Ok(())
    }

    /// The capacity its maps hold on to (the memory tests).
    #[cfg(test)]
    pub(crate) fn retained(&self) -> usize {
        self.records.capacity() + self.by_slot.capacity() + self.by_lease_id.capacity()
    }

    /// Gives back the memory a flood left behind (amortised O(1)).
    pub(crate) fn shrink(&mut self) {
        shrink_map(&mut self.records);
        shrink_map(&mut self.by_slot);
        shrink_map(&mut self.by_lease_id);
        // It trades places with the shell's vector (see `take_touched`): either may have held a
        // flood's keys. (As many as the shell keeps of its own turn vectors.)
        self.touched.shrink_to(64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::Priority;
    use crate::supervisor::core::record::{Proof, Reason, Release, Why};

    fn record(slots: u32) -> LeaseRecord {
        let more: Box<[SlotToken]> = (1..slots)
            .map(|s| SlotToken::new(s, 10 + s as u64))
            .collect();
        LeaseRecord::new(SlotToken::new(0, 10), more, Holder::Job, Priority::Normal)
    }

    #[test]
    fn the_tallies_count_slots_and_follow_every_edit() {
        let mut book = Book::new(true);
        let key = book.insert(record(3));
        assert_eq!((book.tally().held, book.tally().leases), (3, 1));
        book.edit(key, |r| {
            r.reasons.push(Reason {
                proof: Proof::TasksJoined,
                why: Why::Late,
                detail: "slow".into(),
            })
        });
        assert_eq!(book.tally().quarantined, 3);
        book.edit(key, |r| {
            r.reasons.clear();
            r.release = Release::Releasing {
                left: 2,
                error: None,
            };
        });
        let t = book.tally();
        assert_eq!((t.held, t.releasing, t.quarantined), (2, 2, 0));
        book.remove(key);
        assert_eq!(book.tally(), Tally::default());
    }
}
