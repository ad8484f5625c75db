//! `EtcdBroker` against a neighbour on the same etcd that writes into the pool's keys
//! (markers, slot keys, the capacity record, pools nested in pools), against two acquires
//! sharing one request id, and against acquires dropped at every await point. Each test starts
//! its own etcd on free loopback ports.
//!
//! The promise under test: a value leasehold did not write grants nothing, is refused with a
//! typed error, and never leaves a waiter waiting on a pool that has a free slot.

mod etcd_support;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use etcd_client::{Client, GetOptions, PutOptions};
use etcd_support::{
    Etcd, etcd_binary, keep, slot_keys, test_config as config, wait_queued, wait_until,
};
use leasehold::{AcquireRequest, SlotBroker};
use leasehold_etcd::EtcdBroker;

async fn client(etcd: &Etcd) -> Client {
    Client::connect([etcd.endpoint()], None).await.unwrap()
}

fn request(id: u64) -> AcquireRequest {
    AcquireRequest::new(id, Some("job"))
}

/// Every key under `prefix`, with its value and lease.
async fn keys_under(c: &mut Client, prefix: &str) -> Vec<(String, String, i64)> {
    c.get(prefix, Some(GetOptions::new().with_prefix()))
        .await
        .unwrap()
        .kvs()
        .iter()
        .map(|kv| {
            (
                kv.key_str().unwrap().to_owned(),
                String::from_utf8_lossy(kv.value()).into_owned(),
                kv.lease(),
            )
        })
        .collect()
}

async fn queue_is_empty(c: &Client, pool: &str) -> bool {
    let mut c = c.clone();
    keys_under(&mut c, &format!("leasehold/{pool}/queue/"))
        .await
        .is_empty()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marker_another_client_wrote_grants_nothing() {
    let Some(bin) = etcd_binary("a_marker_another_client_wrote_grants_nothing") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let holder = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "forged", 1))
            .await
            .unwrap(),
    );
    let waiter = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "forged", 1))
            .await
            .unwrap(),
    );
    let held = holder.acquire(request(1)).await.unwrap();
    let renewal = keep(&holder, held);
    let waiting = {
        let waiter = Arc::clone(&waiter);
        tokio::spawn(async move { waiter.acquire(request(2)).await })
    };
    let marker = waiter.request_key_for(&request(2));
    wait_queued(&c, &waiter, &request(2)).await;

    // A neighbour writes a well-formed grant of the held slot into the waiter's marker, under
    // its own etcd lease: not a grant leasehold made.
    let neighbour = c.lease_grant(30, None).await.unwrap().id();
    c.put(
        marker.as_str(),
        "leasehold/v1 request granted slot=0",
        Some(PutOptions::new().with_lease(neighbour)),
    )
    .await
    .unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter answers")
        .unwrap();
    let err = match outcome {
        Ok(token) => panic!(
            "granted {token} from a marker another client wrote, while {held} holds slot {}",
            held.slot_id()
        ),
        Err(err) => err,
    };
    assert_eq!(err.code(), Some("ETCD_CORRUPT_RECORD"), "{err}");

    // The holder still holds its slot, alone; the refused waiter left the queue.
    assert_eq!(
        slot_keys(&mut c, "forged").await,
        vec![(
            "leasehold/forged/slot/000000".to_owned(),
            holder.session_lease().unwrap()
        )]
    );
    wait_until(Duration::from_secs(5), "the refused waiter leaves", || {
        queue_is_empty(&c, "forged")
    })
    .await;
    // And the pool serves on: the slot goes to the next acquire once it is released.
    c.delete(marker.as_str(), None).await.unwrap();
    renewal.abort();
    holder.release(held).await.unwrap();
    let next = waiter.acquire(request(3)).await.unwrap();
    assert!(next.lease_id() > held.lease_id());
    waiter.release(next).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_capacity_record_on_a_pool_in_use_is_refused_and_never_recreated() {
    let Some(bin) = etcd_binary("a_missing_capacity_record_on_a_pool_in_use") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let first = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "cap", 1))
            .await
            .unwrap(),
    );
    let held = first.acquire(request(1)).await.unwrap();
    let renewal = keep(&first, held);

    // Someone deletes the capacity record while slot 0 is held.
    c.delete("leasehold/cap/capacity", None).await.unwrap();
    for capacity in [2, 1] {
        match EtcdBroker::connect(config(&etcd.endpoint(), "cap", capacity)).await {
            Ok(broker) => {
                let extra = broker.acquire(request(9)).await;
                panic!(
                    "a broker of capacity {capacity} connected to a pool of 1 in use \
                     (its acquire: {extra:?}; held now: {:?})",
                    slot_keys(&mut c, "cap").await
                );
            }
            Err(err) => assert_eq!(err.code(), "ETCD_CORRUPT_RECORD", "{err}"),
        }
    }
    assert!(
        c.get("leasehold/cap/capacity", None)
            .await
            .unwrap()
            .kvs()
            .is_empty(),
        "the capacity record was re-created"
    );
    // The broker already connected refuses to grant from the pool as it is.
    let err = first.acquire(request(2)).await.unwrap_err();
    assert_eq!(err.code(), Some("ETCD_CORRUPT_RECORD"), "{err}");
    assert_eq!(slot_keys(&mut c, "cap").await.len(), 1, "nothing granted");

    // An altered record is refused the same way, and is not overwritten either.
    c.put("leasehold/cap/capacity", "leasehold/v1 capacity=7", None)
        .await
        .unwrap();
    let err = EtcdBroker::connect(config(&etcd.endpoint(), "cap", 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "ETCD_CAPACITY_MISMATCH", "{err}");
    let err = first.acquire(request(3)).await.unwrap_err();
    assert_eq!(err.code(), Some("ETCD_CAPACITY_MISMATCH"), "{err}");
    let kept = c.get("leasehold/cap/capacity", None).await.unwrap();
    assert_eq!(kept.kvs()[0].value(), b"leasehold/v1 capacity=7");

    // Repaired by hand, the pool serves again.
    c.put("leasehold/cap/capacity", "leasehold/v1 capacity=1", None)
        .await
        .unwrap();
    renewal.abort();
    first.release(held).await.unwrap();
    let again = first.acquire(request(4)).await.unwrap();
    first.release(again).await.unwrap();
    // An empty pool whose record is gone is simply a new pool (closing the broker takes its
    // refused requests' tombstones with its session).
    first.close().await.unwrap();
    c.delete("leasehold/cap/capacity", None).await.unwrap();
    wait_until(Duration::from_secs(10), "the pool empties", || {
        let mut c = c.clone();
        async move {
            keys_under(&mut c, "leasehold/cap/")
                .await
                .iter()
                .all(|(k, _, _)| k.ends_with("/capacity"))
        }
    })
    .await;
    EtcdBroker::connect(config(&etcd.endpoint(), "cap", 2))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_key_under_the_slot_prefix_is_ignored_and_never_stalls_a_waiter() {
    let Some(bin) = etcd_binary("a_foreign_key_under_the_slot_prefix") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let holder = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "stray", 1))
            .await
            .unwrap(),
    );
    let waiter = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "stray", 1))
            .await
            .unwrap(),
    );
    let held = holder.acquire(request(1)).await.unwrap();
    let _renewal = keep(&holder, held);
    let waiting = {
        let waiter = Arc::clone(&waiter);
        tokio::spawn(async move { waiter.acquire(request(2)).await })
    };
    wait_queued(&c, &waiter, &request(2)).await;

    // A key leasehold did not write lands among the slot keys; then the holder's session goes
    // (its slot freed without a hand-off): the pool has a free slot and a waiter.
    c.put("leasehold/stray/slot/notes", "hello", None)
        .await
        .unwrap();
    c.lease_revoke(holder.session_lease().unwrap())
        .await
        .unwrap();
    let token = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter is served instead of waiting on a free pool for ever")
        .unwrap()
        .expect("a key that is not a slot key holds no slot");
    assert_eq!(token.slot_id(), 0);
    let keys = slot_keys(&mut c, "stray").await;
    assert_eq!(
        keys.len(),
        2,
        "the grant, and the stray key left alone: {keys:?}"
    );
    waiter.release(token).await.unwrap();
    assert_eq!(
        slot_keys(&mut c, "stray").await.len(),
        1,
        "only the stray key is left"
    );
    c.delete("leasehold/stray/slot/notes", None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_whose_keys_would_nest_are_refused_at_connect_and_never_stall_each_other() {
    let Some(bin) = etcd_binary("pools_whose_keys_would_nest") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let ep = etcd.endpoint();

    // A pool or a prefix part named like a section of the layout could land inside another
    // pool's slot, queue or request keys: refused before any call.
    for (prefix, pool) in [
        ("lh/render", "slot"),
        ("lh/render/slot", "x"),
        ("lh", "queue"),
        ("lh/request", "p"),
        ("lh", "capacity"),
    ] {
        match EtcdBroker::connect(config(&ep, pool, 1).key_prefix(prefix)).await {
            Ok(_) => panic!("pool {pool:?} under {prefix:?} was accepted"),
            Err(err) => assert_eq!(err.code(), "ETCD_INVALID_CONFIG", "{prefix} {pool}: {err}"),
        }
    }
    assert!(
        keys_under(&mut c, "lh/").await.is_empty(),
        "nothing written"
    );

    // Pool `render` under `lh`: a pool under `lh/render` would put its keys inside render's
    // range. Refused at connect, whichever comes first.
    let render = EtcdBroker::connect(config(&ep, "render", 1).key_prefix("lh"))
        .await
        .unwrap();
    let err = EtcdBroker::connect(config(&ep, "inner", 1).key_prefix("lh/render"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "ETCD_POOL_NESTED", "{err}");
    assert!(
        keys_under(&mut c, "lh/render/inner/").await.is_empty(),
        "the refused pool wrote nothing"
    );
    let inner = EtcdBroker::connect(config(&ep, "inner", 1).key_prefix("lh2/render"))
        .await
        .unwrap();
    let err = EtcdBroker::connect(config(&ep, "render", 1).key_prefix("lh2"))
        .await
        .unwrap_err();
    assert!(
        ["ETCD_POOL_NESTED", "ETCD_FOREIGN_KEY"].contains(&err.code()),
        "{err}"
    );
    assert!(
        c.get("lh2/render/capacity", None)
            .await
            .unwrap()
            .kvs()
            .is_empty(),
        "the outer pool was not created around the inner one"
    );

    // The pools that were accepted serve, each on its own.
    let a = render.acquire(request(1)).await.unwrap();
    let b = inner.acquire(request(1)).await.unwrap();
    render.release(a).await.unwrap();
    inner.release(b).await.unwrap();
    EtcdBroker::connect(config(&ep, "render", 1).key_prefix("lh"))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_concurrent_acquires_with_one_request_id_never_return_a_freed_token() {
    let Some(bin) = etcd_binary("two_concurrent_acquires_with_one_request_id") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let holder = EtcdBroker::connect(config(&etcd.endpoint(), "dup", 1))
        .await
        .unwrap();
    let broker = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "dup", 1))
            .await
            .unwrap(),
    );
    let held = holder.acquire(request(1)).await.unwrap();
    let first = {
        let broker = Arc::clone(&broker);
        tokio::spawn(async move { broker.acquire(request(7)).await })
    };
    wait_queued(&c, &broker, &request(7)).await;
    // The second copy is in flight (suspended once) before the first is granted.
    let mut second = {
        let broker = Arc::clone(&broker);
        Box::pin(async move { broker.acquire(request(7)).await })
    };
    std::future::poll_fn(|cx| match second.as_mut().poll(cx) {
        Poll::Pending => Poll::Ready(()),
        Poll::Ready(r) => panic!("the second copy answered at once: {r:?}"),
    })
    .await;
    let mut second = tokio::spawn(second);

    holder.release(held).await.unwrap();
    let token = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("the first copy answers")
        .unwrap()
        .unwrap();
    // Kept alive, as a supervisor does with every grant.
    let renewal = {
        let broker = Arc::clone(&broker);
        tokio::spawn(async move { broker.keep_alive(token).await })
    };
    // While the grant is held, the other copy of the request returns that same grant.
    match tokio::time::timeout(Duration::from_secs(5), &mut second).await {
        Ok(again) => {
            let again = again.unwrap().unwrap();
            // Its slot is held, now that it has it.
            let slot = c
                .get(format!("leasehold/dup/slot/{:06}", again.slot_id()), None)
                .await
                .unwrap();
            assert!(
                slot.kvs()
                    .first()
                    .is_some_and(|kv| kv.mod_revision() as u64 == again.lease_id()),
                "the second copy returned {again} (the first's token was {token}), whose slot \
                 key is {:?}",
                slot.kvs()
                    .first()
                    .map(|kv| (kv.value_str().unwrap().to_owned(), kv.mod_revision()))
            );
            assert_eq!(again, token, "the same grant");
            broker.release(token).await.unwrap();
        }
        Err(_) => {
            broker.release(token).await.unwrap();
            let late = tokio::time::timeout(Duration::from_secs(10), second)
                .await
                .expect("the second copy answers")
                .unwrap();
            if let Ok(late) = late {
                let slot = c
                    .get(format!("leasehold/dup/slot/{:06}", late.slot_id()), None)
                    .await
                    .unwrap();
                let held_now = slot
                    .kvs()
                    .first()
                    .is_some_and(|kv| kv.mod_revision() as u64 == late.lease_id());
                assert!(
                    held_now,
                    "the second copy returned {late} (the first's token was {token}) after its \
                     release: its slot key is {:?}",
                    slot.kvs()
                        .first()
                        .map(|kv| kv.value_str().unwrap().to_owned())
                );
                broker.release(late).await.unwrap();
            }
            panic!("the second copy of the request did not answer while its grant was held");
        }
    }
    renewal.abort();
    assert!(slot_keys(&mut c, "dup").await.is_empty());
    // A later retry is a new acquire.
    let next = broker.acquire(request(7)).await.unwrap();
    assert!(next.lease_id() > token.lease_id());
    broker.release(next).await.unwrap();
}

/// Polls `fut` until it has been suspended `n` times, then drops it there (`None`); `Some` if
/// it finished first.
struct DropAfter<F: Future> {
    fut: Option<Pin<Box<F>>>,
    left: usize,
}

impl<F: Future> Future for DropAfter<F> {
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.left == 0 {
            self.fut = None;
            return Poll::Ready(None);
        }
        let Some(fut) = self.fut.as_mut() else {
            return Poll::Ready(None);
        };
        match fut.as_mut().poll(cx) {
            Poll::Ready(v) => Poll::Ready(Some(v)),
            Poll::Pending => {
                self.left -= 1;
                if self.left == 0 {
                    self.fut = None;
                    return Poll::Ready(None);
                }
                Poll::Pending
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_at_any_await_point_withdraws_its_queue_key_at_once() {
    let Some(bin) = etcd_binary("an_acquire_dropped_at_any_await_point") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let c = client(&etcd).await;
    let mut dropped_at = 0;
    for n in 0.. {
        // A pool whose one slot is held by another broker, given up as soon as the acquire
        // under test has joined the queue: the acquire goes through the queue to a grant, and
        // is dropped after its n-th suspension, wherever that is.
        let pool = format!("drop{n}");
        let holder = EtcdBroker::connect(config(&etcd.endpoint(), &pool, 1))
            .await
            .unwrap();
        let broker = Arc::new(
            EtcdBroker::connect(config(&etcd.endpoint(), &pool, 1))
                .await
                .unwrap(),
        );
        let held = holder.acquire(request(1)).await.unwrap();
        let (go, now) = tokio::sync::oneshot::channel::<()>();
        let releaser = {
            let (c, pool) = (c.clone(), pool.clone());
            tokio::spawn(async move {
                let joined = async {
                    while queue_is_empty(&c, &pool).await {
                        tokio::task::yield_now().await;
                    }
                };
                tokio::select! {
                    () = joined => {}
                    _ = now => {}
                }
                holder.release(held).await.unwrap();
            })
        };
        let done = DropAfter {
            fut: Some(Box::pin(broker.acquire(request(2)))),
            left: n,
        }
        .await;
        if let Some(result) = done {
            let token = result.unwrap();
            broker.release(token).await.unwrap();
            drop(go);
            releaser.await.unwrap();
            break;
        }
        dropped_at = n;
        let session = broker.session_lease();
        // Whatever it had reached, it leaves: no queue key, no slot, at most a tombstone.
        wait_until(
            Duration::from_secs(5),
            &format!("the acquire dropped after {n} suspensions leaves the queue"),
            || queue_is_empty(&c, &pool),
        )
        .await;
        wait_until(
            Duration::from_secs(5),
            &format!("the acquire dropped after {n} suspensions gives up its place"),
            || {
                let place = broker.queue_key_for(&request(2));
                async move { place.is_none() }
            },
        )
        .await;
        let mut cc = c.clone();
        wait_until(
            Duration::from_secs(5),
            &format!("the acquire dropped after {n} suspensions holds no slot"),
            || {
                let (mut cc, pool) = (cc.clone(), pool.clone());
                async move {
                    slot_keys(&mut cc, &pool)
                        .await
                        .iter()
                        .all(|(_, lease)| Some(*lease) != session)
                }
            },
        )
        .await;
        let marker = keys_under(&mut cc, &broker.request_key_for(&request(2))).await;
        assert!(
            marker.iter().all(|(_, v, _)| v.ends_with("abandoned")),
            "after {n} suspensions only a tombstone may stay: {marker:?}"
        );
        // The pool serves the next acquire once the holder has let go.
        drop(go);
        releaser.await.unwrap();
        let next = broker.acquire(request(3)).await.unwrap();
        broker.release(next).await.unwrap();
    }
    eprintln!("dropped at every point up to {dropped_at} suspensions");
    assert!(
        dropped_at >= 4,
        "the acquire was dropped at {dropped_at} points only"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_forged_under_the_waiters_own_lease_is_taken_and_only_fencing_orders_the_two_holders()
 {
    let Some(bin) = etcd_binary("a_grant_forged_under_the_waiters_own_lease") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let holder = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "forged", 1))
            .await
            .unwrap(),
    );
    let waiter = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "forged", 1))
            .await
            .unwrap(),
    );
    let first = holder.acquire(request(1)).await.unwrap();
    let _renewal = keep(&holder, first);
    let waiting = {
        let waiter = Arc::clone(&waiter);
        tokio::spawn(async move { waiter.acquire(request(2)).await })
    };
    let queue_key = wait_queued(&c, &waiter, &request(2)).await;

    // What a neighbour with write access reads: the waiter's lease and request, on its queue
    // key. One transaction under that lease forges the grant leasehold would write.
    let queued = c.get(queue_key.as_str(), None).await.unwrap().kvs()[0].clone();
    let lease = queued.lease();
    let rk = queued
        .value_str()
        .unwrap()
        .rsplit("request=")
        .next()
        .unwrap()
        .to_owned();
    let under = || Some(PutOptions::new().with_lease(lease));
    let forge = etcd_client::Txn::new().and_then([
        etcd_client::TxnOp::put(
            format!("leasehold/forged/request/{rk}"),
            "leasehold/v1 request granted slot=0",
            under(),
        ),
        etcd_client::TxnOp::put(
            "leasehold/forged/slot/000000",
            format!("leasehold/v1 holder request={rk}"),
            under(),
        ),
        etcd_client::TxnOp::delete(queue_key.as_str(), None),
    ]);
    c.txn(forge).await.unwrap();

    // It passes every check: the waiter takes slot 0 while its holder still holds it.
    let second = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the forged grant is indistinguishable from leasehold's")
        .unwrap()
        .unwrap();
    assert_eq!(second.slot_id(), first.slot_id(), "one slot, two holders");
    assert!(second.lease_id() > first.lease_id());

    // Only fencing orders them: once the resource has seen the newer token, the older holder
    // is refused.
    let resource = leasehold::FencingGuard::new();
    resource.check(second).unwrap();
    assert!(
        resource.check(first).is_err(),
        "the older holder is fenced off"
    );

    waiter.release(second).await.unwrap();
    holder.release(first).await.unwrap();
    assert!(slot_keys(&mut c, "forged").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grants_list_of_waiters_hands_the_slot_only_to_what_the_waiters_queue_key_says() {
    let Some(bin) = etcd_binary("a_grants_list_of_waiters") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let connect = || async {
        Arc::new(
            EtcdBroker::connect(config(&etcd.endpoint(), "listed", 1))
                .await
                .unwrap(),
        )
    };
    let (holder, waiter, behind) = (connect().await, connect().await, connect().await);
    let first = holder.acquire(request(1)).await.unwrap();
    let _renewal = keep(&holder, first);
    // The waiter's releases chain over what its grants name, nothing it read on its own.
    waiter.hold_queue_reads(true);
    let waiting = {
        let waiter = Arc::clone(&waiter);
        tokio::spawn(async move { waiter.acquire(request(2)).await })
    };
    let queue_key = wait_queued(&c, &waiter, &request(2)).await;
    let next = {
        let behind = Arc::clone(&behind);
        tokio::spawn(async move { behind.acquire(request(3)).await })
    };
    let next_key = wait_queued(&c, &behind, &request(3)).await;

    // A neighbour forges the waiter's grant (under the waiter's own lease, as in the test
    // above), and its list names the place of the waiter behind, at its revision, but under
    // the neighbour's own lease and request.
    let reader = c.clone();
    let kv = |key: &str| {
        let mut c = reader.clone();
        let key = key.to_owned();
        async move { c.get(key, None).await.unwrap().kvs()[0].clone() }
    };
    let (queued, behind_kv) = (kv(&queue_key).await, kv(&next_key).await);
    let rk = |kv: &etcd_client::KeyValue| {
        kv.value_str()
            .unwrap()
            .rsplit("request=")
            .next()
            .unwrap()
            .to_owned()
    };
    let neighbour = c.lease_grant(30, None).await.unwrap().id();
    let place = next_key.rsplit('/').next().unwrap();
    let entry = format!(
        "{place}.{:x}.{neighbour:x}.00000000000000ff",
        behind_kv.create_revision()
    );
    let under = || Some(PutOptions::new().with_lease(queued.lease()));
    let forge = etcd_client::Txn::new().and_then([
        etcd_client::TxnOp::put(
            format!("leasehold/listed/request/{}", rk(&queued)),
            format!("leasehold/v1 request granted slot=0 next={entry}"),
            under(),
        ),
        etcd_client::TxnOp::put(
            "leasehold/listed/slot/000000",
            format!("leasehold/v1 holder request={}", rk(&queued)),
            under(),
        ),
        etcd_client::TxnOp::delete(queue_key.as_str(), None),
    ]);
    c.txn(forge).await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the forged grant is taken (see above)")
        .unwrap()
        .unwrap();

    // Its release tries the listed place under the listed lease: the queue key is not under
    // it, so that link grants nothing; the release reads who waits and hands to the waiter
    // behind, under its own lease and request.
    waiter.release(second).await.unwrap();
    let third = tokio::time::timeout(Duration::from_secs(10), next)
        .await
        .expect("the waiter behind is served")
        .unwrap()
        .unwrap();
    let slot = kv("leasehold/listed/slot/000000").await;
    assert_eq!(slot.lease(), behind.session_lease().unwrap());
    assert_eq!(
        slot.value_str().unwrap(),
        format!("leasehold/v1 holder request={}", rk(&behind_kv))
    );
    assert!(
        c.get("leasehold/listed/request/00000000000000ff", None)
            .await
            .unwrap()
            .kvs()
            .is_empty(),
        "no grant was written for the request the list made up"
    );
    behind.release(third).await.unwrap();
    c.lease_revoke(neighbour).await.unwrap();
}
