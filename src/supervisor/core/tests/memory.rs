//! The core gives back the memory a flood left behind: its maps and queues keep twice what they
//! hold (room to grow back without reallocating) once they are at most a quarter full, never
//! less than a floor of 64.

use std::collections::{HashMap, HashSet, VecDeque};

use super::prelude::*;
use crate::supervisor::core::admission::WaitQueue;
use crate::supervisor::core::shrink::{shrink_deque, shrink_map, shrink_set};

const FLOOD: u64 = 2_000;

#[test]
fn a_deque_at_most_a_quarter_full_keeps_twice_what_it_holds_and_never_less_than_the_floor() {
    let with = |capacity: usize, len: usize| {
        let mut d: VecDeque<u32> = VecDeque::with_capacity(capacity);
        d.extend(0..len as u32);
        let before = d.capacity();
        shrink_deque(&mut d);
        (before, d.capacity())
    };
    // A quarter full, to the element: shrunk to twice its length.
    let (before, after) = with(1_000, 250);
    assert!(before >= 1_000, "{before}");
    assert!((500..before).contains(&after), "{before} -> {after}");
    // One past a quarter: kept.
    let (before, after) = with(1_000, before / 4 + 1);
    assert_eq!(after, before);
    // Empty: the floor stays.
    let (before, after) = with(1_000, 0);
    assert!((64..before).contains(&after), "{before} -> {after}");
    assert!(after < 128, "{after}");
    // At or under the floor: never touched.
    let (before, after) = with(64, 0);
    assert_eq!(after, before);
}

#[test]
fn a_map_or_set_at_most_a_quarter_full_keeps_about_twice_what_it_holds() {
    let mut map: HashMap<u64, u64> = HashMap::with_capacity(1_000);
    let cap = map.capacity();
    map.extend((0..(cap / 4) as u64).map(|k| (k, k)));
    assert_eq!(map.capacity(), cap);
    shrink_map(&mut map);
    assert!(
        map.capacity() < cap && map.capacity() >= 2 * map.len(),
        "{cap} -> {} holding {}",
        map.capacity(),
        map.len()
    );
    // A tenth full: still room for twice what it holds, not a little more than it.
    let mut map: HashMap<u64, u64> = HashMap::with_capacity(1_000);
    map.extend((0..100).map(|k| (k, k)));
    shrink_map(&mut map);
    assert!((200..cap).contains(&map.capacity()), "{}", map.capacity());
    // Over a quarter: kept.
    let mut map: HashMap<u64, u64> = HashMap::with_capacity(1_000);
    map.extend((0..=(cap / 4) as u64).map(|k| (k, k)));
    shrink_map(&mut map);
    assert_eq!(map.capacity(), cap);
    // Empty: down to the floor's size.
    let mut map: HashMap<u64, u64> = HashMap::with_capacity(1_000);
    shrink_map(&mut map);
    assert!((64..128).contains(&map.capacity()), "{}", map.capacity());

    let mut set: HashSet<u64> = HashSet::with_capacity(1_000);
    let cap = set.capacity();
    set.extend(0..(cap / 4) as u64);
    shrink_set(&mut set);
    assert!(
        set.capacity() < cap && set.capacity() >= 2 * set.len(),
        "{cap} -> {}",
        set.capacity()
    );
    let mut set: HashSet<u64> = HashSet::with_capacity(1_000);
    set.extend(0..100);
    shrink_set(&mut set);
    assert!((200..cap).contains(&set.capacity()), "{}", set.capacity());
    let mut set: HashSet<u64> = HashSet::with_capacity(1_000);
    set.extend(0..=(cap / 4) as u64);
    shrink_set(&mut set);
    assert_eq!(set.capacity(), cap);
    let mut set: HashSet<u64> = HashSet::with_capacity(1_000);
    shrink_set(&mut set);
    assert!((64..128).contains(&set.capacity()), "{}", set.capacity());
}

/// A core that has lived through a flood of waiters, and one through a flood of leases, each
/// back to nothing held.
fn flooded() -> (Core, Core) {
    // Waiters: one slot, a flood queued behind its holder, then all withdrawn.
    let mut waiting = Core::on_broker(Some(1), false, false);
    for w in 1..=FLOOD {
        waiting.apply(Input::Enqueue {
            waiter: WaiterId(w),
            ask: Ask::one(Want::Lease),
        });
    }
    for w in 1..=FLOOD {
        waiting.apply(Input::Withdraw {
            waiter: WaiterId(w),
            why: Withdrawal::Cancelled,
        });
    }
    waiting.settle();
    drain(&mut waiting);

    // Leases: a flood of acquires in flight at once, granted, then all released.
    let mut leasing = Core::on_broker(Some(FLOOD as u32), false, false);
    for w in 1..=FLOOD {
        leasing.apply(Input::Enqueue {
            waiter: WaiterId(w),
            ask: Ask::one(Want::Lease),
        });
    }
    let keys: Vec<_> = grant_every_acquire(&mut leasing)
        .into_iter()
        .map(|(_, key)| key)
        .collect();
    assert_eq!(keys.len() as u64, FLOOD);
    for &key in &keys {
        leasing.apply(Input::ReleaseRequested { key });
    }
    for &key in &keys {
        leasing.apply(Input::Released {
            key,
            result: Ok(()),
        });
    }
    leasing.settle();
    drain(&mut leasing);
    assert_eq!(leasing.active(), 0);
    (waiting, leasing)
}

#[test]
fn after_a_flood_every_part_of_the_core_gives_its_memory_back_when_asked_and_only_then() {
    let (mut waiting, mut leasing) = flooded();
    let (w, l) = (waiting.retained(), leasing.retained());
    println!("after the floods: {w:?} (waiters) and {l:?} (leases)");
    // The flood left its mark on every part...
    assert!(w.waiters >= FLOOD as usize, "{w:?}");
    assert!(l.acquiring >= FLOOD as usize, "{l:?}");
    assert!(l.leases >= FLOOD as usize, "{l:?}");
    assert!(l.effects >= FLOOD as usize, "{l:?}");
    // ... and only an idle turn gives it back, in every part.
    waiting.shrink_idle();
    leasing.shrink_idle();
    let (ws, ls) = (waiting.retained(), leasing.retained());
    println!("shrunk: {ws:?} (waiters) and {ls:?} (leases)");
    let small = 1_000;
    assert!(ws.waiters < small && ws.effects < small, "{ws:?}");
    assert!(
        ls.acquiring < small && ls.leases < small && ls.effects < small,
        "{ls:?}"
    );
}

#[test]
fn a_queue_behind_a_live_head_never_holds_more_entries_than_twice_its_live_waiters_and_sixteen() {
    let mut queue = WaitQueue::default();
    queue.push(WaiterId(0), Ask::one(Want::Job));
    let mut next = 0;
    // Batches of one to four join and leave behind the head, for a long while.
    for round in 0..300u64 {
        let batch: Vec<WaiterId> = (0..=round % 4)
            .map(|_| {
                next += 1;
                WaiterId(next)
            })
            .collect();
        for w in &batch {
            queue.push(*w, Ask::one(Want::Lease));
        }
        for w in batch {
            assert_eq!(queue.remove(w), Some(1));
            let (queued, live, _) = queue.entries();
            assert!(
                queued <= 2 * live + 16,
                "round {round}: {queued} entries for {live} live waiters"
            );
        }
    }
    assert_eq!(queue.pop().map(|s| s.waiter), Some(WaiterId(0)));
    assert_eq!(queue.pop(), None);
}

#[test]
fn a_one_slot_waiter_costs_one_queue_entry_and_no_entry_in_the_multi_slot_map() {
    let mut queue = WaitQueue::default();
    for w in 0..1_000 {
        queue.push(WaiterId(w), Ask::one(Want::Job));
    }
    queue.push(WaiterId(1_000), ask_for(3));
    assert_eq!(queue.entries(), (1_001, 1_001, 1));
}

fn ask_for(slots: u32) -> Ask {
    Ask {
        slots,
        ..Ask::one(Want::Lease)
    }
}
