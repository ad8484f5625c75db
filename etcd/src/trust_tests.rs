//! Property test of what the broker does with what it reads: the decoding of every key and
//! value (`Layout`), what a waiter decides from a look (`Look::read`, `decide`) and how a grant
//! is confirmed against its slot key (`Layout::confirm_grant`), over arbitrary pools — keys
//! leasehold writes, keys it does not, values of the wrong kind, garbage, other clients' leases
//! — read the way etcd answers the broker's transactions.
//!
//! Never a panic; never a grant from a value leasehold did not write for this waiter; every
//! outcome a typed error or a decision, and a wait only where a release or a deletion ends it.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::error::EtcdError;
use super::layout::{Confirmed, Layout, MarkerState, Raw};
use super::queue::{Look, Next, decide};

/// The waiter's own session, and its request and queue place.
const SESSION: i64 = 0x51;
const RK: u64 = 0x1111_2222_3333_4444;
const QK: u64 = 0x0aaa_bbbb_cccc_dddd;
/// The waiter's place in the queue (its queue key's create revision).
const JOINED: i64 = 50;

#[derive(Debug, Clone)]
struct Kv {
    value: Vec<u8>,
    lease: i64,
    create_rev: i64,
    mod_rev: i64,
}

fn raw<'a>(key: &'a [u8], kv: &'a Kv) -> Raw<'a> {
    Raw {
        key,
        value: &kv.value,
        lease: kv.lease,
        create_rev: kv.create_rev,
        mod_rev: kv.mod_rev,
    }
}

/// A pool as etcd holds it (keys sorted as etcd sorts them: bytewise).
type Pool = BTreeMap<Vec<u8>, Kv>;

fn lease() -> impl Strategy<Value = i64> {
    prop_oneof![Just(SESSION), Just(SESSION), Just(0), Just(0x52), Just(-1)]
}

fn rk() -> impl Strategy<Value = u64> {
    prop_oneof![Just(RK), Just(RK), Just(0x2a), any::<u64>()]
}

/// A key: one leasehold writes in this pool, or one it does not.
fn key(capacity: u32) -> impl Strategy<Value = Vec<u8>> {
    let l = Layout::new("lh", "p", capacity);
    let (a, b, c, d) = (l.clone(), l.clone(), l.clone(), l.clone());
    prop_oneof![
        4 => (0..capacity + 2).prop_map(move |i| a.slot_key(i).into_bytes()),
        2 => prop_oneof![Just(QK), Just(0x0bbb), any::<u64>()]
            .prop_map(move |qk| b.queue_key(qk).into_bytes()),
        3 => rk().prop_map(move |rk| c.request_key(rk).into_bytes()),
        1 => Just(d.capacity_key().into_bytes()),
        // Keys among the slot keys that are not slots.
        2 => prop_oneof![
            Just("slot/notes"),
            Just("slot/000001.bak"),
            Just("slot/000000x"),
            Just("slot/1"),
            Just("slot/00000"),
            Just("slot/"),
            Just("slot/0000001"),
            Just("slot/00000:"),
        ]
        .prop_map(|k| format!("lh/p/{k}").into_bytes()),
        1 => prop_oneof![Just("queue/zz"), Just("request/2a"), Just("notes"), Just("capacity/x")]
            .prop_map(|k| format!("lh/p/{k}").into_bytes()),
        1 => proptest::collection::vec(any::<u8>(), 0..24)
            .prop_map(|tail| [b"lh/p/".as_slice(), &tail].concat()),
    ]
}

/// A value: one leasehold writes (for any key), or not.
fn value(capacity: u32) -> impl Strategy<Value = Vec<u8>> {
    let l = Layout::new("lh", "p", capacity);
    let (a, b, c, d) = (l.clone(), l.clone(), l.clone(), l.clone());
    prop_oneof![
        3 => (0..capacity + 2).prop_map(move |slot| {
            a.marker_value(MarkerState::Granted { slot }).into_bytes()
        }),
        2 => prop_oneof![
            Just(b.marker_value(MarkerState::Abandoned)),
            Just("leasehold/v1 request waiting".to_owned()),
            (0..capacity + 2).prop_map(move |slot| b.grant_value(slot, &[crate::layout::Waiter {
                qk: QK,
                rk: 0x2a,
                lease: 0x52,
                create_rev: JOINED + 1,
            }])),
        ]
        .prop_map(String::into_bytes),
        3 => rk().prop_map(move |rk| c.holder_value(rk).into_bytes()),
        2 => (any::<u64>(), rk()).prop_map(move |(owner, rk)| d.waiter_value(owner, rk).into_bytes()),
        1 => (0..capacity + 2).prop_map(|n| format!("leasehold/v1 capacity={n}").into_bytes()),
        1 => prop_oneof![
            Just("leasehold/v1 request granted slot=".to_owned()),
            Just("leasehold/v1 request granted slot=-1".to_owned()),
            Just("leasehold/v1 holder request=2a".to_owned()),
            Just("leasehold/v2 request granted slot=0".to_owned()),
            Just(String::new()),
        ]
        .prop_map(String::into_bytes),
        1 => proptest::collection::vec(any::<u8>(), 0..48),
    ]
}

fn pool(capacity: u32) -> impl Strategy<Value = Pool> {
    proptest::collection::vec(
        (
            key(capacity),
            value(capacity),
            lease(),
            1..100i64,
            1..100i64,
        ),
        0..12,
    )
    .prop_map(|kvs| {
        kvs.into_iter()
            .map(|(key, value, lease, a, b)| {
                let kv = Kv {
                    value,
                    lease,
                    create_rev: a.min(b),
                    mod_rev: a.max(b),
                };
                (key, kv)
            })
            .collect()
    })
}

/// The stable codes a refusal may carry.
fn typed(err: &EtcdError) {
    assert!(
        [
            "ETCD_FOREIGN_KEY",
            "ETCD_CORRUPT_RECORD",
            "ETCD_CAPACITY_MISMATCH",
            "ETCD_INVALID_RESPONSE",
        ]
        .contains(&err.code()),
        "{err}"
    );
    assert!(!err.message().is_empty());
}

/// What the waiter's look reads, as etcd answers it.
fn look_of(l: &Layout, pool: &Pool, closer: bool) -> Result<Look, EtcdError> {
    let marker_key = l.request_key(RK).into_bytes();
    let marker = pool.get(&marker_key).map(|kv| raw(&marker_key, kv));
    let queued = pool.contains_key(l.queue_key(QK).as_bytes());
    let slot_prefix = l.slot_prefix().into_bytes();
    let held = l.held_among(
        pool.keys()
            .filter(|k| k.starts_with(&slot_prefix))
            .map(Vec::as_slice),
    );
    // The queue key just older than the waiter's place (keys that are not queue keys skipped).
    let queue_prefix = l.queue_prefix().into_bytes();
    let predecessor = closer.then(|| {
        pool.iter()
            .filter(|(k, kv)| {
                k.starts_with(&queue_prefix) && l.is_queue_key(k) && kv.create_rev < JOINED
            })
            .max_by_key(|(_, kv)| kv.create_rev)
            .map(|(k, kv)| raw(k, kv))
    });
    Look::read(l, marker, queued, held, predecessor)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn whatever_a_pool_holds_a_waiter_gets_a_typed_refusal_or_a_decision_and_only_leaseholds_own_grant(
        (capacity, pool) in (1u32..5).prop_flat_map(|c| (Just(c), pool(c))),
        closer in any::<bool>(),
    ) {
        let l = Layout::new("lh", "p", capacity);
        // Every key and value, decoded on its own: a value or a typed refusal.
        for (k, kv) in &pool {
            let r = raw(k, kv);
            for decoded in [
                l.holder(r).map(|_| ()),
                l.waiter(r).map(|_| ()),
                l.marker(r).map(|_| ()),
                l.check_capacity(Some(r)),
            ] {
                if let Err(e) = decoded {
                    typed(&e);
                }
            }
        }
        // The whole pool, as `connect` checks it.
        let pool_check = l.check_pool(pool.iter().map(|(k, kv)| raw(k, kv)));
        match &pool_check {
            Err(e) => typed(e),
            Ok(()) => {
                // Accepted: every key is the layout's and its value leasehold's.
                for (k, kv) in &pool {
                    let r = raw(k, kv);
                    let key = String::from_utf8_lossy(k);
                    prop_assert!(
                        l.holder(r).is_ok() || l.waiter(r).is_ok() || l.marker(r).is_ok()
                            || (key == l.capacity_key() && l.check_capacity(Some(r)).is_ok()),
                        "accepted {key}"
                    );
                }
            }
        }

        // What the waiter decides from its look.
        let look = match look_of(&l, &pool, closer) {
            Ok(look) => look,
            Err(e) => {
                typed(&e);
                return Ok(());
            }
        };
        let marker_key = l.request_key(RK).into_bytes();
        match decide(&look, capacity, SESSION) {
            Next::Granted { slot, revision } => {
                let marker = look.marker.expect("granted from a marker");
                let slot_key = l.slot_key(slot).into_bytes();
                let slot_kv = pool.get(&slot_key).map(|kv| raw(&slot_key, kv));
                match l.confirm_grant(RK, SESSION, &marker, slot_kv) {
                    Ok(Confirmed::Held) => {
                        // The one grant a waiter takes: both records exactly as leasehold
                        // writes them for this request, under its session, at one revision.
                        let m = &pool[&marker_key];
                        let s = &pool[&slot_key];
                        prop_assert_eq!(
                            l.marker(raw(&marker_key, m)).map(|m| m.state),
                            Ok(MarkerState::Granted { slot })
                        );
                        prop_assert!(
                            m.value == l.marker_value(MarkerState::Granted { slot }).into_bytes()
                                || m.value == l.grant_value(slot, &l.next_of(&m.value)).into_bytes(),
                            "a value leasehold writes"
                        );
                        prop_assert_eq!(&s.value, &l.holder_value(RK).into_bytes());
                        prop_assert_eq!((m.lease, s.lease), (SESSION, SESSION));
                        prop_assert_eq!((m.mod_rev, s.mod_rev), (revision, revision));
                        prop_assert!(slot < capacity);
                    }
                    Ok(Confirmed::Missing) => prop_assert!(!pool.contains_key(&slot_key)),
                    Err(e) => typed(&e),
                }
            }
            Next::NotOurs { lease } => {
                prop_assert_ne!(lease, SESSION);
                typed(&l.not_ours(RK, lease, SESSION));
            }
            Next::Wait => {
                // Only on a pool all of whose slot keys exist: a hand-off (a write of the
                // waiter's marker) or a slot's deletion (which the broker watches) ends it.
                // Nothing that is not a slot key counts.
                prop_assert_eq!(look.held, i64::from(capacity));
                let exact = (0..capacity)
                    .filter(|i| pool.contains_key(l.slot_key(*i).as_bytes()))
                    .count();
                prop_assert_eq!(exact as u32, capacity);
            }
            Next::Head | Next::Behind { .. } | Next::LookCloser => {
                // A slot may be free: only ever decided when a slot key is missing.
                prop_assert!(look.held < i64::from(capacity));
                prop_assert!((0..capacity).any(|i| !pool.contains_key(l.slot_key(i).as_bytes())));
                // The predecessor, when read, is a queue key.
                if let Next::Behind { predecessor } = decide(&look, capacity, SESSION) {
                    prop_assert!(pool.contains_key(l.queue_key(predecessor).as_bytes()));
                }
            }
            Next::Gone => {
                // Neither a marker nor a queue key: nothing to wait for.
                prop_assert!(look.marker.is_none() && !look.queued);
            }
            Next::Abandoned => {}
        }
    }

    #[test]
    fn any_bytes_decode_to_a_record_or_a_typed_refusal(
        key in proptest::collection::vec(any::<u8>(), 0..40),
        value in proptest::collection::vec(any::<u8>(), 0..60),
        lease in any::<i64>(),
        capacity in 1u32..100_001,
    ) {
        let l = Layout::new("leasehold", "p", capacity);
        let kv = Kv { value, lease, create_rev: 3, mod_rev: 4 };
        for key in [key.clone(), [b"leasehold/p/slot/".as_slice(), &key].concat()] {
            let r = raw(&key, &kv);
            for decoded in [
                l.holder(r).map(|_| ()),
                l.waiter(r).map(|_| ()),
                l.marker(r).map(|_| ()),
                l.check_capacity(Some(r)),
                l.check_pool([r]),
            ] {
                if let Err(e) = decoded {
                    typed(&e);
                }
            }
        }
    }
}
