//! Nothing strands a slot: each test puts a real etcd in a state the broker once left a slot
//! or a queue key stranded in (held by a live session that nobody uses), and checks that the
//! pool still serves: a watch etcd cancels, a cleanup that meets an outage longer than any
//! bound, a queue place that still holds a key, a grant of a slot index whose earlier token here
//! is not released, an acquire that reuses the request id of a release still settling, and a
//! key among the slot keys that is not a slot key.
//!
//! Needs an etcd binary (`cargo test -p leasehold-etcd`); without the binary each test says
//! SKIPPED, and with `LEASEHOLD_REQUIRE_ETCD=1` it fails instead.

mod etcd_support;

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{AlarmAction, AlarmOptions, AlarmType, Client, GetOptions, PutOptions};
use etcd_support::{
    Etcd, Proxy, connect_pool as connect, etcd_binary, keep, slot_keys, test_config as config,
    wait_queued, wait_until,
};
use leasehold::{AcquireRequest, BrokerErrorKind, SlotBroker, SlotToken};
use leasehold_etcd::EtcdBroker;

async fn client(etcd: &Etcd) -> Client {
    Client::connect([etcd.endpoint()], None).await.unwrap()
}

fn request(id: u64) -> AcquireRequest {
    AcquireRequest::new(id, Some("job"))
}

async fn exists(c: &Client, key: &str) -> bool {
    let mut c = c.clone();
    !c.get(key, None).await.unwrap().kvs().is_empty()
}

async fn queue_keys(c: &Client, pool: &str) -> Vec<String> {
    let mut c = c.clone();
    c.get(
        format!("leasehold/{pool}/queue/"),
        Some(GetOptions::new().with_prefix().with_keys_only()),
    )
    .await
    .unwrap()
    .kvs()
    .iter()
    .map(|kv| kv.key_str().unwrap().to_owned())
    .collect()
}

fn acquire_in_background(
    broker: &Arc<EtcdBroker>,
    id: u64,
) -> tokio::task::JoinHandle<Result<SlotToken, leasehold::BrokerError>> {
    let broker = Arc::clone(broker);
    tokio::spawn(async move { broker.acquire(request(id)).await })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_that_etcd_cancels_is_set_up_again_and_the_waiter_still_hears_its_grant() {
    let Some(bin) = etcd_binary("a_watch_that_etcd_cancels") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let c = client(&etcd).await;
    let holder = connect(&etcd, "cancelled", 1).await;
    let waiter = connect(&etcd, "cancelled", 1).await;
    let held = holder.acquire(request(1)).await.unwrap();
    let renewal = keep(&holder, held);
    let waiting = acquire_in_background(&waiter, 2);
    // The waiter's marker and slot watches are in place.
    wait_queued(&c, &waiter, &request(2)).await;
    wait_until(
        Duration::from_secs(10),
        "the waiter watches its marker",
        || {
            let n = waiter.watch_count();
            async move { n >= 2 }
        },
    )
    .await;

    // etcd cancels every watch of the waiter's stream (as it does to a watcher that a
    // compaction passed), and has said so.
    let cancelled = waiter.cancel_watches_on_server().await;
    assert!(
        cancelled >= 2,
        "the marker's and the slot keys' watches: {cancelled}"
    );
    wait_until(
        Duration::from_secs(10),
        "the watches are set up again",
        || {
            let n = waiter.watches_recreated();
            async move { n >= cancelled as u64 }
        },
    )
    .await;

    // The hand-off reaches the waiter through its watch set up again.
    renewal.abort();
    holder.release(held).await.unwrap();
    let token = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter hears its grant after etcd cancelled its watches")
        .unwrap()
        .unwrap();
    assert!(token.lease_id() > held.lease_id());
    waiter.release(token).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_acquire_is_cleaned_up_after_an_outage_longer_than_any_bound_while_its_session_lives()
 {
    let Some(bin) = etcd_binary("an_abandoned_acquire_outlasts_an_outage") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let holder = connect(&etcd, "nospace", 1).await;
    let waiter = connect(&etcd, "nospace", 1).await;
    let held = holder.acquire(request(1)).await.unwrap();
    let renewal = keep(&holder, held);
    let waiting = acquire_in_background(&waiter, 2);
    let queue_key = wait_queued(&c, &waiter, &request(2)).await;

    // Another client fills etcd's quota: etcd refuses every write (keep-alives go on) until
    // the alarm is disarmed. The waiter gives up its acquire meanwhile.
    let member = c.member_list().await.unwrap().members()[0].id();
    let endpoint = etcd.endpoint();
    let alarm = |action| {
        let endpoint = endpoint.clone();
        async move {
            let mut c = Client::connect([endpoint], None).await.unwrap();
            let mut options = AlarmOptions::new();
            options.with_member(member);
            c.alarm(action, AlarmType::Nospace, Some(options))
                .await
                .unwrap();
        }
    };
    alarm(AlarmAction::Activate).await;
    let refused = c.put("leasehold/elsewhere", "x", None).await;
    assert!(refused.is_err(), "the alarm refuses writes: {refused:?}");
    waiting.abort();
    let _ = waiting.await;

    // Longer than any bound the cleanup once had (sixty seconds): its session is renewed all
    // along, so its queue key would stay the oldest waiter for as long as the broker runs.
    tokio::time::sleep(Duration::from_secs(70)).await;
    assert!(
        exists(&c, &queue_key).await,
        "nothing could be written meanwhile"
    );
    assert!(waiter.session_lease().is_some(), "the session lives");
    alarm(AlarmAction::Deactivate).await;

    wait_until(
        Duration::from_secs(15),
        "the abandoned acquire's queue key goes once etcd takes writes again",
        || {
            let c = c.clone();
            let key = queue_key.clone();
            async move { !exists(&c, &key).await }
        },
    )
    .await;
    // The slot goes to nobody stranded: released, it is free, and the waiter's broker serves.
    renewal.abort();
    holder.release(held).await.unwrap();
    assert!(slot_keys(&mut c, "nospace").await.is_empty());
    let token = tokio::time::timeout(Duration::from_secs(10), waiter.acquire(request(3)))
        .await
        .expect("served")
        .unwrap();
    waiter.release(token).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_never_writes_over_a_live_queue_key() {
    let Some(bin) = etcd_binary("a_join_never_writes_over_a_live_queue_key") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let holder = connect(&etcd, "places", 1).await;
    let waiter = connect(&etcd, "places", 1).await;
    let held = holder.acquire(request(1)).await.unwrap();
    let renewal = keep(&holder, held);

    // The waiter's first place, taken and given back once served.
    let first = acquire_in_background(&waiter, 2);
    let place = wait_queued(&c, &waiter, &request(2)).await;
    renewal.abort();
    holder.release(held).await.unwrap();
    let served = first.await.unwrap().unwrap();
    let renewal = keep(&waiter, served);
    assert!(!exists(&c, &place).await);

    // A live key appears at that place (a cleanup of this broker's that could not reach
    // etcd, say): another waiter's, older than anything the waiter joins with next.
    let lease = c.lease_grant(30, None).await.unwrap().id();
    let value = "leasehold/v1 waiter owner=00000000000000aa request=00000000000000bb";
    c.put(
        place.as_str(),
        value,
        Some(PutOptions::new().with_lease(lease)),
    )
    .await
    .unwrap();
    let before = c.get(place.as_str(), None).await.unwrap().kvs()[0].clone();

    let next = acquire_in_background(&waiter, 3);
    let mine = wait_queued(&c, &waiter, &request(3)).await;
    assert_ne!(mine, place, "the join took another place");
    let after = c.get(place.as_str(), None).await.unwrap().kvs()[0].clone();
    assert_eq!(
        (
            after.value(),
            after.lease(),
            after.create_revision(),
            after.mod_revision()
        ),
        (
            before.value(),
            before.lease(),
            before.create_revision(),
            before.mod_revision()
        ),
        "the live key is untouched"
    );
    assert_eq!(queue_keys(&c, "places").await.len(), 2);

    // Its owner gone, the queue goes on in order: the waiter's next request is served.
    c.lease_revoke(lease).await.unwrap();
    renewal.abort();
    waiter.release(served).await.unwrap();
    let token = tokio::time::timeout(Duration::from_secs(10), next)
        .await
        .expect("served")
        .unwrap()
        .unwrap();
    waiter.release(token).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_of_a_slot_index_whose_earlier_token_here_is_not_released_is_handed_on() {
    let Some(bin) = etcd_binary("a_grant_of_a_slot_index_still_held_here") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let busy = connect(&etcd, "park", 1).await;
    let other = connect(&etcd, "park", 1).await;

    // A token whose holder stops keeping it alive while its job hangs: after a TTL the broker
    // gives its slot back to the pool, and keeps its index off limits until it is released.
    let hung = busy.acquire(request(1)).await.unwrap();
    let _ = tokio::time::timeout(Duration::from_millis(50), busy.keep_alive(hung)).await;
    // The same broker waits for the pool, and so does another one behind it.
    let same = acquire_in_background(&busy, 2);
    wait_queued(&c, &busy, &request(2)).await;
    let behind = acquire_in_background(&other, 3);
    wait_queued(&c, &other, &request(3)).await;

    // The TTL hands the slot to the oldest waiter, the same broker's, which cannot hand it out
    // while the hung token holds its index: it hands it on, and the other waiter is served.
    let token = tokio::time::timeout(Duration::from_secs(15), behind)
        .await
        .expect("the grant is handed on instead of idling behind a hung job")
        .unwrap()
        .unwrap();
    assert_eq!(token.slot_id(), hung.slot_id());
    assert!(token.lease_id() > hung.lease_id());
    assert!(!same.is_finished(), "the same broker's request waits again");
    assert_eq!(slot_keys(&mut c, "park").await.len(), 1);

    // The hung job ends; with the slot released too, the same broker's request is served.
    busy.release(hung).await.unwrap();
    other.release(token).await.unwrap();
    let last = tokio::time::timeout(Duration::from_secs(15), same)
        .await
        .expect("served once the earlier token is released")
        .unwrap()
        .unwrap();
    assert!(last.lease_id() > token.lease_id());
    busy.release(last).await.unwrap();
    assert!(slot_keys(&mut c, "park").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_that_reuses_the_request_id_of_a_release_still_settling_is_refused() {
    let Some(bin) = etcd_binary("an_acquire_reusing_a_settling_request_id") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let proxy = Proxy::start(etcd.client_port());
    let broker = EtcdBroker::connect(
        config(&proxy.endpoint(), "settling", 1).retry_for(Duration::from_millis(800)),
    )
    .await
    .unwrap();
    let token = broker.acquire(request(5)).await.unwrap();
    proxy.blackhole();
    let err = broker.release(token).await.unwrap_err();
    assert_eq!(err.kind(), BrokerErrorKind::DeliveryUnknown, "{err}");
    assert_eq!(
        broker.settling(),
        1,
        "the release settles in the background"
    );
    proxy.heal();

    // The same request again, while its grant is being handed on: refused, never the old
    // grant (it would be held twice).
    let refused = broker.acquire(request(5)).await.unwrap_err();
    assert_eq!(refused.code(), Some("ETCD_REQUEST_SETTLING"), "{refused}");

    // Once settled, the slot is free and the request id serves again with a new grant.
    wait_until(Duration::from_secs(10), "the release settles", || {
        let n = broker.settling();
        async move { n == 0 }
    })
    .await;
    assert!(slot_keys(&mut c, "settling").await.is_empty());
    let again = broker.acquire(request(5)).await.unwrap();
    assert!(again.lease_id() > token.lease_id());
    broker.release(again).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stray_key_among_the_slot_keys_does_not_count_as_a_held_slot() {
    let Some(bin) = etcd_binary("a_stray_key_among_the_slot_keys") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = client(&etcd).await;
    let holder = connect(&etcd, "bak", 2).await;
    let waiter = connect(&etcd, "bak", 2).await;
    // Sorts among the slot keys, inside the pool's slot range.
    let stray = "leasehold/bak/slot/000000.bak";
    c.put(stray, "a copy someone kept", None).await.unwrap();

    let a = holder.acquire(request(1)).await.unwrap();
    let b = holder.acquire(request(2)).await.unwrap();
    let (keep_a, keep_b) = (keep(&holder, a), keep(&holder, b));
    // The pool is full: the waiter queues, and counts two held slots, not three.
    let first = acquire_in_background(&waiter, 3);
    wait_queued(&c, &waiter, &request(3)).await;
    keep_a.abort();
    holder.release(a).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("handed over")
        .unwrap()
        .unwrap();
    let keep_got = keep(&waiter, got);
    keep_b.abort();
    holder.release(b).await.unwrap();

    // One slot held and one free; the waiter's broker, which has seen a queue, joins it and
    // counts what is held as it joins: one slot, not the stray key too.
    let second = tokio::time::timeout(Duration::from_secs(10), waiter.acquire(request(4)))
        .await
        .expect("a free slot is taken, not waited for behind a key that holds nothing")
        .unwrap();
    assert_ne!(second.slot_id(), got.slot_id());
    keep_got.abort();
    waiter.release(got).await.unwrap();
    waiter.release(second).await.unwrap();
    let keys = slot_keys(&mut c, "bak").await;
    assert_eq!(keys.len(), 1, "only the stray key is left: {keys:?}");
    assert!(keys[0].0.ends_with(".bak"));
}
