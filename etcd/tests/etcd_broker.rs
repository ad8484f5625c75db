//! `EtcdBroker` against a real etcd started by the test on free loopback ports: the counting
//! semaphore, idempotent acquire by request id, lost answers, validation, fencing.
//!
//! Needs an etcd binary (`cargo test -p leasehold-etcd`); without the
//! binary each test says SKIPPED, and with `LEASEHOLD_REQUIRE_ETCD=1` it fails instead.

mod etcd_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use etcd_client::{Client, GetOptions};
use etcd_support::{Etcd, Proxy, etcd_binary, wait_queued};
use leasehold::{
    AcquireRequest, BrokerErrorKind, BrokerEvents, FencingGuard, JobSpec, SlotBroker, SlotToken,
    Supervisor,
};
use leasehold_etcd::EtcdBroker;

use etcd_support::test_config as config;

async fn client(etcd: &Etcd) -> Client {
    Client::connect([etcd.endpoint()], None).await.unwrap()
}

use etcd_support::slot_keys;

/// Waits until etcd itself (asked directly, not through the proxy) has `key`.
async fn wait_for_key(c: &mut Client, key: &str) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while c.get(key, None).await.unwrap().kvs().is_empty() {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{key} never appeared"));
}

fn request(id: u64) -> AcquireRequest {
    AcquireRequest::new(id, Some("job"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_grants_its_capacity_in_fifo_order_and_fencing_tokens_increase() {
    let Some(bin) = etcd_binary("a_pool_grants_its_capacity_in_fifo_order") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let broker = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "fifo", 2))
            .await
            .unwrap(),
    );
    assert_eq!(broker.capacity(), Some(2));
    let a = broker.acquire(request(1)).await.unwrap();
    let b = broker.acquire(request(2)).await.unwrap();
    assert_ne!(a.slot_id(), b.slot_id());
    assert!(b.lease_id() > a.lease_id(), "fencing tokens increase");

    // Two more wait, in order; releasing one slot lets exactly the first waiter in.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut waiters = Vec::new();
    for id in [3u64, 4] {
        let b = Arc::clone(&broker);
        let tx = tx.clone();
        waiters.push(tokio::spawn(async move {
            let t = b.acquire(request(id)).await.unwrap();
            tx.send((id, t)).unwrap();
            t
        }));
        // Queue order is etcd's create revision: wait until this waiter's key exists.
        let c = client(&etcd).await;
        wait_queued(&c, &broker, &request(id)).await;
    }
    broker.release(a).await.unwrap();
    let (first, c) = rx.recv().await.unwrap();
    assert_eq!(first, 3, "FIFO: the older waiter gets the freed slot");
    assert_eq!(c.slot_id(), a.slot_id());
    assert!(c.lease_id() > b.lease_id());
    assert!(rx.try_recv().is_err(), "only one slot was freed");
    broker.release(b).await.unwrap();
    let (second, d) = rx.recv().await.unwrap();
    assert_eq!(second, 4);
    broker.release(c).await.unwrap();
    broker.release(d).await.unwrap();
    for w in waiters {
        w.await.unwrap();
    }
    let mut c = client(&etcd).await;
    assert!(
        slot_keys(&mut c, "fifo").await.is_empty(),
        "every slot free"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retrying_an_acquire_with_the_same_request_id_returns_the_same_grant() {
    let Some(bin) = etcd_binary("retrying_an_acquire_with_the_same_request_id") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let broker = EtcdBroker::connect(config(&etcd.endpoint(), "idem", 3))
        .await
        .unwrap();
    let first = broker.acquire(request(7)).await.unwrap();
    let again = broker.acquire(request(7)).await.unwrap();
    assert_eq!(first, again, "the retry finds the grant it already has");
    let mut c = client(&etcd).await;
    assert_eq!(
        slot_keys(&mut c, "idem").await.len(),
        1,
        "one slot for one request"
    );
    broker.release(first).await.unwrap();
    // Released twice: the second is refused as not ours (nothing else is touched).
    let err = broker.release(first).await.unwrap_err();
    assert_eq!(err.code(), Some("ETCD_TOKEN_NOT_OURS"));
    // A token this broker never granted is refused the same way and releases nothing.
    let other = broker.acquire(request(8)).await.unwrap();
    let forged = SlotToken::new(other.slot_id(), other.lease_id() + 1000);
    assert_eq!(
        broker.release(forged).await.unwrap_err().code(),
        Some("ETCD_TOKEN_NOT_OURS")
    );
    assert_eq!(slot_keys(&mut c, "idem").await.len(), 1);
    broker.release(other).await.unwrap();
    assert!(slot_keys(&mut c, "idem").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_grant_answers_are_recovered_by_request_id_and_never_take_two_slots() {
    let Some(bin) = etcd_binary("a_lost_grant_answer_is_recovered") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let proxy = Proxy::start(etcd.client_port());
    let cfg = config(&proxy.endpoint(), "lost", 2).retry_for(Duration::from_millis(1500));
    let broker = Arc::new(EtcdBroker::connect(cfg).await.unwrap());
    let mut c = client(&etcd).await;
    // The broker's session exists before the answers go missing.
    let warm = broker.acquire(request(100)).await.unwrap();
    broker.release(warm).await.unwrap();
    let session = broker.session_lease().expect("a live session");

    // Answers lost in the middle of an acquire: it retries with the same request key, and once
    // they get through again it has the very grant etcd made while nobody heard the answer.
    proxy.drop_responses();
    let pending = {
        let broker = Arc::clone(&broker);
        tokio::spawn(async move { broker.acquire(request(1)).await })
    };
    wait_for_key(&mut c, &broker.request_key_for(&request(1))).await;
    proxy.heal();
    let token = pending.await.unwrap().unwrap();
    assert_eq!(
        broker.etcd_lease_of(token),
        Some(session),
        "under the session"
    );
    let held = slot_keys(&mut c, "lost").await;
    assert_eq!(
        held,
        vec![(
            format!("leasehold/lost/slot/{:06}", token.slot_id()),
            session
        )]
    );

    // An acquire whose answers stay lost gives up (ambiguous); the broker cleans up what it may
    // have left in the background. A later retry with the same request id takes one slot:
    // never two for one request.
    proxy.drop_responses();
    let first = {
        let broker = Arc::clone(&broker);
        tokio::spawn(async move { broker.acquire(request(2)).await })
    };
    wait_for_key(&mut c, &broker.request_key_for(&request(2))).await;
    let err = first.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), BrokerErrorKind::Unavailable, "{err}");
    assert_eq!(err.code(), Some("ETCD_UNAVAILABLE"), "{err}");
    proxy.heal();
    let token2 = broker.acquire(request(2)).await.unwrap();
    let held = slot_keys(&mut c, "lost").await;
    assert_eq!(held.len(), 2, "one slot per request: {held:?}");
    assert!(held.contains(&(
        format!("leasehold/lost/slot/{:06}", token2.slot_id()),
        session
    )));

    broker.release(token).await.unwrap();
    broker.release(token2).await.unwrap();
    assert!(slot_keys(&mut c, "lost").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_answer_is_lost_frees_the_slot_within_the_ttl_and_counts_an_orphan() {
    let Some(bin) = etcd_binary("a_release_whose_answer_is_lost") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let proxy = Proxy::start(etcd.client_port());
    let cut_off = EtcdBroker::connect(
        config(&proxy.endpoint(), "orphan", 1).retry_for(Duration::from_millis(800)),
    )
    .await
    .unwrap();
    let expired = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&expired);
    let reported = Arc::new(tokio::sync::Notify::new());
    let report = Arc::clone(&reported);
    cut_off.attach(BrokerEvents::new(move |_| {
        seen.fetch_add(1, Ordering::SeqCst);
        report.notify_one();
    }));
    let other = EtcdBroker::connect(config(&etcd.endpoint(), "orphan", 1))
        .await
        .unwrap();

    let token = cut_off.acquire(request(1)).await.unwrap();
    proxy.blackhole();
    let err = cut_off.release(token).await.unwrap_err();
    assert_eq!(err.kind(), BrokerErrorKind::DeliveryUnknown, "{err}");

    // The other broker's acquire waits on its watch and gets the slot once the TTL has run.
    let started = tokio::time::Instant::now();
    let next = tokio::time::timeout(Duration::from_secs(10), other.acquire(request(1)))
        .await
        .expect("the slot returns within the ttl")
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(next.slot_id(), token.slot_id());
    assert!(next.lease_id() > token.lease_id());

    // Once etcd is reachable again the orphan is seen expired, exactly once.
    proxy.heal();
    tokio::time::timeout(Duration::from_secs(10), reported.notified())
        .await
        .expect("the orphan's expiry is reported once etcd answers");
    assert_eq!(cut_off.orphans_expired(), 1);
    assert_eq!(expired.load(Ordering::SeqCst), 1);
    other.release(next).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_capacity_for_the_same_pool_is_refused_at_start() {
    let Some(bin) = etcd_binary("a_different_capacity_is_refused") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let _first = EtcdBroker::connect(config(&etcd.endpoint(), "cap", 3))
        .await
        .unwrap();
    let err = EtcdBroker::connect(config(&etcd.endpoint(), "cap", 4))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "ETCD_CAPACITY_MISMATCH", "{err}");
    assert!(err.to_string().contains("capacity 3"), "{err}");
    // The same capacity under another prefix is another pool.
    EtcdBroker::connect(config(&etcd.endpoint(), "cap", 4).key_prefix("other"))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_keys_are_refused_at_connect_ignored_when_read_and_grant_nothing() {
    let Some(bin) = etcd_binary("foreign_keys_and_a_corrupt_capacity") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let broker = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "guard", 2))
            .await
            .unwrap(),
    );

    // A key leasehold did not write, under the pool prefix: refused at connect, where the
    // whole pool is checked.
    c.put("leasehold/guard/notes", "hello", None).await.unwrap();
    let refused = EtcdBroker::connect(config(&etcd.endpoint(), "guard", 2))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), "ETCD_FOREIGN_KEY");
    c.delete("leasehold/guard/notes", None).await.unwrap();

    // One in the queue's range that is not a queue key, where a running broker reads: it waits
    // for nothing, so it is ignored. The acquire is served, and the key is left alone.
    c.put("leasehold/guard/queue/notes", "hello", None)
        .await
        .unwrap();
    let served = tokio::time::timeout(Duration::from_secs(10), broker.acquire(request(1)))
        .await
        .expect("a stray key in the queue's range holds nobody up")
        .unwrap();
    assert_eq!(slot_keys(&mut c, "guard").await.len(), 1, "one grant");
    broker.release(served).await.unwrap();
    assert!(
        slot_keys(&mut c, "guard").await.is_empty(),
        "released: the stray key is nobody to hand the slot to"
    );
    assert_eq!(
        c.get("leasehold/guard/queue/notes", None)
            .await
            .unwrap()
            .kvs()
            .len(),
        1,
        "left alone"
    );
    c.delete("leasehold/guard/queue/notes", None).await.unwrap();

    // A slot key without a lease (someone wrote it by hand), seen when the queue's head looks
    // for a free slot: another client waits ahead, so this acquire queues, and leaves.
    c.put(
        "leasehold/guard/slot/000001",
        "leasehold/v1 holder request=000000000000002a",
        None,
    )
    .await
    .unwrap();
    let lease = c.lease_grant(30, None).await.unwrap().id();
    let under = || Some(etcd_client::PutOptions::new().with_lease(lease));
    c.put(
        "leasehold/guard/queue/000000000000002a",
        "leasehold/v1 waiter owner=0000000000000000 request=000000000000002a",
        under(),
    )
    .await
    .unwrap();
    let pending = {
        let broker = Arc::clone(&broker);
        tokio::spawn(async move { broker.acquire(request(2)).await })
    };
    wait_queued(&c, &broker, &request(2)).await;
    c.lease_revoke(lease).await.unwrap();
    let err = pending.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Some("ETCD_CORRUPT_RECORD"), "{err}");
    c.delete("leasehold/guard/slot/000001", None).await.unwrap();

    // A corrupted capacity record.
    c.put("leasehold/guard/capacity", "two", None)
        .await
        .unwrap();
    let err = broker.acquire(request(3)).await.unwrap_err();
    assert_eq!(err.code(), Some("ETCD_CORRUPT_RECORD"), "{err}");
    let refused = EtcdBroker::connect(config(&etcd.endpoint(), "guard", 2))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), "ETCD_CORRUPT_RECORD");
    assert!(
        slot_keys(&mut c, "guard").await.is_empty(),
        "nothing granted"
    );

    // Repaired, the pool works again; the refused acquires left no waiter behind.
    c.put("leasehold/guard/capacity", "leasehold/v1 capacity=2", None)
        .await
        .unwrap();
    let t = broker.acquire(request(4)).await.unwrap();
    broker.release(t).await.unwrap();
    // The refused acquires left their queue places before they answered.
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let left = c
                .get(
                    "leasehold/guard/queue/",
                    Some(GetOptions::new().with_prefix()),
                )
                .await
                .unwrap();
            if left.kvs().is_empty() {
                break;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("refused acquires leave no waiter behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_supervisor_runs_jobs_on_etcd_slots_and_the_fencing_guard_refuses_old_tokens() {
    let Some(bin) = etcd_binary("a_supervisor_runs_jobs_on_etcd_slots") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let broker = EtcdBroker::connect(config(&etcd.endpoint(), "sup", 2))
        .await
        .unwrap();
    let sup = Supervisor::builder().broker(broker).start().await.unwrap();
    let guard = Arc::new(FencingGuard::new());
    let mut tokens = Vec::new();
    for i in 0..6 {
        let guard = Arc::clone(&guard);
        let token = sup
            .run(
                JobSpec::new(format!("job-{i}")).unwrap(),
                move |ctx| async move {
                    guard.check(ctx.token()).expect("fresh token accepted");
                    Ok::<_, std::io::Error>(ctx.token())
                },
            )
            .await
            .unwrap();
        tokens.push(token);
    }
    assert!(tokens.windows(2).all(|w| w[0].lease_id() < w[1].lease_id()));
    assert_eq!(
        guard.check(tokens[0]).unwrap_err().code(),
        "LEASE_FENCED",
        "an older holder's token is refused"
    );
    let stats = sup.stats();
    assert_eq!(stats.acquired_total, 6);
    assert_eq!(stats.released_total, 6);
    sup.shutdown().await.unwrap();
    let mut c = client(&etcd).await;
    assert!(slot_keys(&mut c, "sup").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_slot_leases_try_acquire_and_resize_are_refused_on_etcd_with_a_typed_error() {
    let Some(bin) = etcd_binary("multi_slot_leases_try_acquire_and_resize_are_refused") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let broker = EtcdBroker::connect(config(&etcd.endpoint(), "unsupported", 2))
        .await
        .unwrap();
    let sup = Supervisor::builder().broker(broker).start().await.unwrap();
    assert_eq!(
        sup.acquire_many(2).await.unwrap_err().code(),
        "LEASE_BROKER_UNSUPPORTED"
    );
    let err = sup
        .run(JobSpec::new("wide").unwrap().with_slots(2), |_ctx| async {
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_BROKER_UNSUPPORTED");
    assert_eq!(
        sup.try_acquire().await.unwrap_err().code(),
        "LEASE_BROKER_UNSUPPORTED"
    );
    assert_eq!(
        sup.resize(4).await.unwrap_err().code(),
        "LEASE_BROKER_UNSUPPORTED"
    );
    // Nothing was asked of etcd, and single-slot leases still work, with priorities.
    let mut c = client(&etcd).await;
    assert!(slot_keys(&mut c, "unsupported").await.is_empty());
    sup.run(
        JobSpec::new("one")
            .unwrap()
            .with_priority(leasehold::Priority::High),
        |_ctx| async { Ok::<_, std::io::Error>(()) },
    )
    .await
    .unwrap();
    assert_eq!(sup.stats().acquired_total, 1);
    sup.shutdown().await.unwrap();
    assert!(slot_keys(&mut c, "unsupported").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_broker_shared_by_two_supervisors_never_gives_both_the_same_grant() {
    let Some(bin) = etcd_binary("one_broker_shared_by_two_supervisors") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let broker = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "shared", 2))
            .await
            .unwrap(),
    );
    // Both supervisors number their requests from 1: the origin keeps their requests apart.
    let a = Supervisor::builder()
        .broker(Arc::clone(&broker))
        .start()
        .await
        .unwrap();
    let b = Supervisor::builder()
        .broker(Arc::clone(&broker))
        .start()
        .await
        .unwrap();
    let mut la = a.acquire().await.unwrap();
    let mut lb = b.acquire().await.unwrap();
    let (ta, tb) = (la.token().unwrap(), lb.token().unwrap());
    assert_ne!(ta, tb);
    let mut c = client(&etcd).await;
    let held = slot_keys(&mut c, "shared").await;
    assert_eq!(held.len(), 2, "two slots for two requests: {held:?}");
    let session = broker.session_lease().unwrap();
    for t in [ta, tb] {
        let key = format!("leasehold/shared/slot/{:06}", t.slot_id());
        assert!(held.contains(&(key, session)), "{held:?}");
        assert_eq!(broker.etcd_lease_of(t), Some(session));
    }
    la.release().await.unwrap();
    lb.release().await.unwrap();
    assert!(slot_keys(&mut c, "shared").await.is_empty());
    assert_eq!(broker.orphans_expired(), 0);
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_handed_to_a_waiter_whose_process_died_comes_back_within_its_ttl() {
    let Some(bin) = etcd_binary("a_slot_handed_to_a_dead_waiter") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let broker = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "dead", 1))
            .await
            .unwrap(),
    );
    let first = broker.acquire(request(1)).await.unwrap();
    // Another client queues behind the holder, then dies: its session (a 3 s lease) is never
    // renewed, but its place stays until etcd expires it.
    let mut c = client(&etcd).await;
    let lease = c.lease_grant(3, None).await.unwrap().id();
    let under = || Some(etcd_client::PutOptions::new().with_lease(lease));
    let dead = 0x2a_u64;
    c.put(
        format!("leasehold/dead/queue/{dead:016x}"),
        "leasehold/v1 waiter owner=0000000000000000 request=000000000000002a",
        under(),
    )
    .await
    .unwrap();
    // A live waiter queues behind the dead one.
    let next = {
        let broker = Arc::clone(&broker);
        tokio::spawn(async move { broker.acquire(request(2)).await })
    };
    wait_queued(&c, &broker, &request(2)).await;

    // The release hands the slot to the dead waiter, in FIFO order; its TTL brings it back,
    // and the live waiter, now the head, takes it.
    broker.release(first).await.unwrap();
    let granted = c
        .get(format!("leasehold/dead/slot/{:06}", first.slot_id()), None)
        .await
        .unwrap();
    assert_eq!(
        granted.kvs().first().map(|kv| kv.lease()),
        Some(lease),
        "handed to the oldest waiter"
    );
    let token = tokio::time::timeout(Duration::from_secs(10), next)
        .await
        .expect("the slot returns within the dead waiter's ttl")
        .unwrap()
        .unwrap();
    assert!(token.lease_id() > first.lease_id());
    broker.release(token).await.unwrap();
    assert!(slot_keys(&mut c, "dead").await.is_empty());
}

/// Polls `check` until it says true, or panics with `what` after `within`.
async fn wait_until<F, Fut>(within: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn keys_under(c: &mut Client, prefix: &str) -> Vec<(String, String)> {
    c.get(prefix, Some(GetOptions::new().with_prefix()))
        .await
        .unwrap()
        .kvs()
        .iter()
        .map(|kv| {
            (
                kv.key_str().unwrap().to_owned(),
                kv.value_str().unwrap().to_owned(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_while_waiting_leaves_no_queue_place_and_no_slot_behind() {
    let Some(bin) = etcd_binary("an_acquire_dropped_while_waiting") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let broker = Arc::new(
        EtcdBroker::connect(config(&etcd.endpoint(), "drop", 1))
            .await
            .unwrap(),
    );
    let holder = broker.acquire(request(1)).await.unwrap();
    assert_eq!(broker.queue_key_for(&request(1)), None, "granted: no place");
    assert_eq!(broker.queue_key_for(&request(2)), None, "not asked yet");
    let waiting = {
        let broker = Arc::clone(&broker);
        tokio::spawn(async move { broker.acquire(request(2)).await })
    };
    wait_queued(&c, &broker, &request(2)).await;
    // The broker names the waiter's place, and it is the one key in the queue.
    let place = broker
        .queue_key_for(&request(2))
        .expect("a waiting acquire has a place");
    wait_for_key(&mut c, &place).await;
    let queued: Vec<String> = keys_under(&mut c, "leasehold/drop/queue/")
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(queued, vec![place]);

    // The supervisor drops acquires still in flight at shutdown: the waiter's place goes at
    // once (its session lives on, so no TTL would ever remove it).
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    wait_until(
        Duration::from_secs(10),
        "the dropped waiter's place goes",
        || {
            let mut c = c.clone();
            async move { keys_under(&mut c, "leasehold/drop/queue/").await.is_empty() }
        },
    )
    .await;
    // Its place is given up once its cleanup's answer is back (just after the key went).
    wait_until(
        Duration::from_secs(10),
        "the withdrawn place is given up",
        || {
            let place = broker.queue_key_for(&request(2));
            async move { place.is_none() }
        },
    )
    .await;
    let marker = keys_under(&mut c, &broker.request_key_for(&request(2))).await;
    assert!(
        marker.iter().all(|(_, v)| v.ends_with("abandoned")),
        "only a tombstone may stay: {marker:?}"
    );

    // The release frees the slot: nothing is handed to the dropped waiter.
    broker.release(holder).await.unwrap();
    assert!(slot_keys(&mut c, "drop").await.is_empty());
    let again = broker.acquire(request(3)).await.unwrap();
    broker.release(again).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_dropped_after_its_grant_passes_the_slot_on() {
    let Some(bin) = etcd_binary("an_acquire_dropped_after_its_grant") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let proxy = Proxy::start(etcd.client_port());
    let mut c = client(&etcd).await;
    let holder = EtcdBroker::connect(config(&etcd.endpoint(), "passon", 1))
        .await
        .unwrap();
    // The waiter's session outlives the test's bounds: only its cleanup can free the slot.
    let waiter = Arc::new(
        EtcdBroker::connect(config(&proxy.endpoint(), "passon", 1).ttl(Duration::from_secs(30)))
            .await
            .unwrap(),
    );
    let first = holder.acquire(request(1)).await.unwrap();
    let waiting = {
        let waiter = Arc::clone(&waiter);
        tokio::spawn(async move { waiter.acquire(request(2)).await })
    };
    wait_queued(&c, &waiter, &request(2)).await;

    // The waiter is cut off, the release hands it the slot, and its acquire is dropped before
    // it could hear of the grant.
    proxy.blackhole();
    holder.release(first).await.unwrap();
    let session = waiter.session_lease().unwrap();
    assert_eq!(
        slot_keys(&mut c, "passon").await,
        vec![("leasehold/passon/slot/000000".to_owned(), session)],
        "handed to the waiter"
    );
    waiting.abort();
    assert!(waiting.await.unwrap_err().is_cancelled());
    proxy.heal();

    // Its cleanup finds the grant and passes the slot on (here: frees it).
    wait_until(
        Duration::from_secs(15),
        "the dropped grant is passed on",
        || {
            let mut c = c.clone();
            async move { slot_keys(&mut c, "passon").await.is_empty() }
        },
    )
    .await;
    let next = holder.acquire(request(3)).await.unwrap();
    assert!(next.lease_id() > first.lease_id());
    holder.release(next).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_nobody_keeps_alive_is_given_back_after_a_ttl_and_its_index_serves_again() {
    let Some(bin) = etcd_binary("a_grant_nobody_keeps_alive") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let broker = EtcdBroker::connect(config(&etcd.endpoint(), "unclaimed", 1))
        .await
        .unwrap();
    // A grant that reached nobody (say, a supervisor that had stopped): never kept alive,
    // never released.
    let lost = broker.acquire(request(1)).await.unwrap();
    // The broker gives it back after one TTL and forgets the index, so that it serves again.
    let next = tokio::time::timeout(Duration::from_secs(10), broker.acquire(request(2)))
        .await
        .expect("the unclaimed grant's slot serves again")
        .unwrap();
    assert_eq!(next.slot_id(), lost.slot_id());
    assert!(next.lease_id() > lost.lease_id());
    // A late release of the forgotten token is answered without touching the new holder.
    broker.release(lost).await.unwrap();
    assert_eq!(slot_keys(&mut c, "unclaimed").await.len(), 1);
    broker.release(next).await.unwrap();
    assert!(slot_keys(&mut c, "unclaimed").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_landed_but_whose_answer_was_lost_is_not_counted_as_an_orphan_expiry() {
    let Some(bin) = etcd_binary("a_release_that_landed") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let proxy = Proxy::start(etcd.client_port());
    let mut c = client(&etcd).await;
    let broker = EtcdBroker::connect(
        config(&proxy.endpoint(), "landed", 1).retry_for(Duration::from_millis(800)),
    )
    .await
    .unwrap();
    let reported = Arc::new(AtomicU64::new(0));
    let seen = Arc::clone(&reported);
    broker.attach(BrokerEvents::new(move |_| {
        seen.fetch_add(1, Ordering::SeqCst);
    }));
    let token = broker.acquire(request(1)).await.unwrap();
    proxy.drop_responses();
    let err = broker.release(token).await.unwrap_err();
    assert_eq!(err.kind(), BrokerErrorKind::DeliveryUnknown, "{err}");
    // It did land: the slot is free in etcd.
    assert!(slot_keys(&mut c, "landed").await.is_empty());
    proxy.heal();
    wait_until(Duration::from_secs(15), "the release settles", || {
        let settling = broker.settling();
        async move { settling == 0 }
    })
    .await;
    // A failed release (the supervisor counts that), not an orphan that expired as well.
    assert_eq!(broker.orphans_expired(), 0);
    assert_eq!(reported.load(Ordering::SeqCst), 0);
}
