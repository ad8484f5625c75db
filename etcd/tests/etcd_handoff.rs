//! The hand-off, against a real etcd: one transaction and one raft proposal, and one event to
//! one process, and the interleavings it must survive (see the etcd section of DESIGN.md): a
//! grant that lands before the grantee's watch is in place, and a release whose cached waiters
//! were all served by other processes' releases.
//!
//! Needs an etcd binary (`cargo test -p leasehold-etcd`); without the binary each test says
//! SKIPPED, and with `LEASEHOLD_REQUIRE_ETCD=1` it fails instead.

mod etcd_support;

use std::sync::Arc;
use std::time::Duration;

use etcd_client::Client;
use etcd_support::{
    Etcd, connect_pool as connect, etcd_binary, http_get, metric_sum, slot_keys, wait_queued,
};
use leasehold::{AcquireRequest, BrokerError, SlotBroker, SlotToken};
use leasehold_etcd::EtcdBroker;

fn request(id: u64) -> AcquireRequest {
    AcquireRequest::new(id, Some("job"))
}

type Pending = tokio::task::JoinHandle<Result<SlotToken, BrokerError>>;

/// Starts `broker`'s acquire of request `id` and returns once it waits in the queue (its queue
/// key exists in etcd under the broker's session).
async fn queued(c: &Client, broker: &Arc<EtcdBroker>, id: u64) -> Pending {
    let task = {
        let broker = Arc::clone(broker);
        tokio::spawn(async move { broker.acquire(request(id)).await })
    };
    wait_queued(c, broker, &request(id)).await;
    task
}

/// What etcd counted so far: (raft proposals committed, transactions handled).
fn counted(etcd: &Etcd) -> (f64, f64) {
    let m = http_get(etcd.client_port(), "/metrics", Duration::from_secs(2)).unwrap();
    let txns = m
        .lines()
        .filter(|l| l.starts_with("grpc_server_handled_total") && l.contains("grpc_method=\"Txn\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    (
        metric_sum(&m, "etcd_server_proposals_committed_total"),
        txns,
    )
}

async fn granted(task: Pending) -> SlotToken {
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("granted")
        .unwrap()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_off_is_one_event_to_the_grantee_and_nobody_else_hears_the_grant() {
    let Some(bin) = etcd_binary("a_hand_off_is_one_event_to_the_grantee") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let holder = connect(&etcd, "events", 1).await;
    let (a, b, d) = (
        connect(&etcd, "events", 1).await,
        connect(&etcd, "events", 1).await,
        connect(&etcd, "events", 1).await,
    );
    let first = holder.acquire(request(1)).await.unwrap();
    // Three processes wait in this order.
    let for_a = queued(&c, &a, 2).await;
    let for_b = queued(&c, &b, 3).await;
    let for_d = queued(&c, &d, 4).await;
    // Each waiter's watches are in place: the slot keys' deletions and its marker; nothing else.
    for (x, n) in [(&a, 2), (&b, 2), (&d, 2)] {
        tokio::time::timeout(Duration::from_secs(10), async {
            while x.watch_count() < n {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("watches in place");
    }
    let before = |x: &EtcdBroker| x.watch_events_received();
    let (a0, b0, d0, h0) = (before(&a), before(&b), before(&d), before(&holder));

    // Three hand-offs in a row. The holder knew of no waiter (it claimed an idle pool): its
    // release reads who waits, then hands off. a's grant names who waits after a (b, d), and
    // b's names d: their releases are one transaction each, one raft proposal each.
    holder.release(first).await.unwrap();
    let ta = granted(for_a).await;
    let before_a = counted(&etcd);
    a.release(ta).await.unwrap();
    let tb = granted(for_b).await;
    let before_b = counted(&etcd);
    b.release(tb).await.unwrap();
    let td = granted(for_d).await;
    let after_b = counted(&etcd);
    assert!(ta.lease_id() < tb.lease_id() && tb.lease_id() < td.lease_id());
    for (who, (p0, t0), (p1, t1)) in [("a", before_a, before_b), ("b", before_b, after_b)] {
        assert_eq!(
            (p1 - p0, t1 - t0),
            (1.0, 1.0),
            "{who}'s release with waiters: (proposals, transactions)"
        );
    }

    // Per process: its grant's event, and nothing else. Events on one stream arrive in
    // revision order, so each count is complete once its grant arrived.
    let got = |x: &EtcdBroker, from: u64| x.watch_events_received() - from;
    assert_eq!(got(&a, a0), 1, "a: its grant");
    assert_eq!(got(&b, b0), 1, "b: its grant");
    assert_eq!(got(&d, d0), 1, "d: its grant");
    assert_eq!(got(&holder, h0), 0, "the releaser hears nothing");
    d.release(td).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_that_lands_before_the_grantees_watch_is_in_place_is_replayed() {
    let Some(bin) = etcd_binary("a_grant_before_the_grantees_watch") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let holder = connect(&etcd, "replay", 1).await;
    let waiter = connect(&etcd, "replay", 1).await;
    let first = holder.acquire(request(1)).await.unwrap();

    // The waiter joins, and stops before it sets up its marker's watch.
    waiter.hold_marker_watches(true);
    let pending = queued(&c, &waiter, 2).await;
    // The hand-off lands meanwhile: the grant is in the waiter's marker, and no watch saw it.
    holder.release(first).await.unwrap();
    let marker = c
        .get(waiter.request_key_for(&request(2)), None)
        .await
        .unwrap();
    let written = String::from_utf8_lossy(marker.kvs()[0].value()).into_owned();
    assert!(written.contains(" granted slot=0"), "{written}");
    assert!(!pending.is_finished());

    // The watch, set up from the revision after the join, replays it.
    waiter.hold_marker_watches(false);
    let token = granted(pending).await;
    assert!(token.lease_id() > first.lease_id());
    assert_eq!(slot_keys(&mut c, "replay").await.len(), 1);
    waiter.release(token).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_whose_cached_waiters_were_all_served_elsewhere_hands_to_the_oldest_waiter() {
    let Some(bin) = etcd_binary("a_release_with_a_stale_cache") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let stale = connect(&etcd, "stale", 2).await;
    let queue = connect(&etcd, "stale", 2).await;
    let kept = stale.acquire(request(1)).await.unwrap();
    let moving = stale.acquire(request(2)).await.unwrap();

    // Fifteen waiters of another process, then one of `stale`'s.
    let mut waiting = Vec::new();
    for id in 100..115 {
        waiting.push(queued(&c, &queue, id).await);
    }
    let last = queued(&c, &stale, 3).await;

    // `stale` releases one slot knowing of no waiter: it reads who waits (the oldest, more
    // than a chain holds) and hands to the first. Then that slot serves the first fourteen,
    // one after the other, in order.
    stale.release(moving).await.unwrap();
    let mut waiting = waiting.into_iter();
    let mut previous = 0;
    for _ in 0..13 {
        let token = granted(waiting.next().unwrap()).await;
        assert!(token.lease_id() > previous);
        previous = token.lease_id();
        queue.release(token).await.unwrap();
    }
    let fourteenth = granted(waiting.next().unwrap()).await;
    let fifteenth = waiting.next().unwrap();

    // The first waiters `stale` read, a chain's worth, are served. Its release finds none of
    // them waiting, reads who waits now, and hands to the oldest: the fifteenth, not its own
    // waiter behind it.
    stale.release(kept).await.unwrap();
    let fifteenth = granted(fifteenth).await;
    assert!(fifteenth.lease_id() > fourteenth.lease_id());
    assert!(
        !last.is_finished(),
        "FIFO: its own waiter joined after the fifteenth"
    );
    queue.release(fourteenth).await.unwrap();
    let own = granted(last).await;
    assert!(own.lease_id() > fifteenth.lease_id());
    stale.release(own).await.unwrap();
    queue.release(fifteenth).await.unwrap();
}
