//! What etcd's NOSPACE alarm does to the broker, as its README says, each against a real etcd
//! whose alarm is raised through etcd's own Alarm API (what etcd raises itself once its database
//! reaches its quota): etcd then refuses every transaction with a put at its top level, and
//! lets deletions, reads, keep-alives and puts inside a nested transaction through.
//!
//! - an acquire fails `ETCD_UNAVAILABLE` (the claim, the join and a new session are refused),
//!   and writes nothing;
//! - a waiter already queued keeps its place, and a release hands it the slot (the hand-off's
//!   puts sit in a nested transaction);
//! - a release nobody waits for frees the slot (a deletion).
//!
//! Needs an etcd binary (`cargo test -p leasehold-etcd`); without the binary each test says
//! SKIPPED, and with `LEASEHOLD_REQUIRE_ETCD=1` it fails instead.

mod etcd_support;

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{AlarmAction, AlarmOptions, AlarmType, Client, GetOptions};
use etcd_support::{Etcd, etcd_binary, keep, slot_keys, test_config, wait_queued};
use leasehold::{AcquireRequest, SlotBroker};
use leasehold_etcd::EtcdBroker;

fn request(id: u64) -> AcquireRequest {
    AcquireRequest::new(id, Some("job"))
}

/// A broker of `pool` whose calls give up after 800 ms of refusals.
async fn connect(etcd: &Etcd, pool: &str, capacity: u32) -> Arc<EtcdBroker> {
    Arc::new(
        EtcdBroker::connect(
            test_config(&etcd.endpoint(), pool, capacity).retry_for(Duration::from_millis(800)),
        )
        .await
        .unwrap(),
    )
}

/// Raises (or disarms) etcd's NOSPACE alarm on its only member, and checks that it holds.
async fn nospace(c: &mut Client, action: AlarmAction) {
    let member = c.member_list().await.unwrap().members()[0].id();
    let mut options = AlarmOptions::new();
    options.with_member(member);
    c.alarm(action, AlarmType::Nospace, Some(options))
        .await
        .unwrap();
    let refused = c.put("leasehold-nospace-probe", "x", None).await;
    assert_eq!(
        refused.is_err(),
        action == AlarmAction::Activate,
        "a put under the alarm: {refused:?}"
    );
}

/// Every key under the pool besides its capacity record.
async fn pool_keys(c: &mut Client, pool: &str) -> Vec<String> {
    c.get(
        format!("leasehold/{pool}/"),
        Some(GetOptions::new().with_prefix().with_keys_only()),
    )
    .await
    .unwrap()
    .kvs()
    .iter()
    .map(|kv| kv.key_str().unwrap().to_owned())
    .filter(|k| !k.ends_with("/capacity"))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_nospace_an_acquire_fails_unavailable_and_writes_nothing() {
    let Some(bin) = etcd_binary("under_nospace_an_acquire_fails") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let idle = connect(&etcd, "nospace-acquire", 2).await;
    let busy = connect(&etcd, "nospace-acquire", 2).await;
    // `busy` has a session, and fills the pool.
    let a = busy.acquire(request(1)).await.unwrap();
    let b = busy.acquire(request(2)).await.unwrap();
    let (keep_a, keep_b) = (keep(&busy, a), keep(&busy, b));
    let waiting = {
        let busy = Arc::clone(&busy);
        tokio::spawn(async move { busy.acquire(request(3)).await })
    };
    wait_queued(&c, &busy, &request(3)).await;
    keep_b.abort();
    busy.release(b).await.unwrap();
    let c_token = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("handed over")
        .unwrap()
        .unwrap();
    let keep_c = keep(&busy, c_token);
    let before = pool_keys(&mut c, "nospace-acquire").await;

    nospace(&mut c, AlarmAction::Activate).await;
    // A broker without a session: the session's grant is refused.
    let err = idle.acquire(request(10)).await.unwrap_err();
    assert_eq!(err.code(), Some("ETCD_UNAVAILABLE"), "{err}");
    assert!(err.to_string().contains("space exceeded"), "{err}");
    // A broker with a session, on a full pool: its first transaction is refused.
    let err = busy.acquire(request(4)).await.unwrap_err();
    assert_eq!(err.code(), Some("ETCD_UNAVAILABLE"), "{err}");
    assert!(err.to_string().contains("space exceeded"), "{err}");
    assert_eq!(
        pool_keys(&mut c, "nospace-acquire").await,
        before,
        "nothing was written"
    );

    // Disarmed, the pool serves again.
    nospace(&mut c, AlarmAction::Deactivate).await;
    keep_c.abort();
    busy.release(c_token).await.unwrap();
    let token = idle.acquire(request(11)).await.unwrap();
    idle.release(token).await.unwrap();
    keep_a.abort();
    busy.release(a).await.unwrap();
    assert!(slot_keys(&mut c, "nospace-acquire").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_nospace_a_release_hands_the_slot_to_a_queued_waiter() {
    let Some(bin) = etcd_binary("under_nospace_a_release_hands_the_slot_on") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let holder = connect(&etcd, "nospace-handoff", 1).await;
    let waiter = connect(&etcd, "nospace-handoff", 1).await;
    let held = holder.acquire(request(1)).await.unwrap();
    let renewal = keep(&holder, held);
    let waiting = {
        let waiter = Arc::clone(&waiter);
        tokio::spawn(async move { waiter.acquire(request(2)).await })
    };
    wait_queued(&c, &waiter, &request(2)).await;

    nospace(&mut c, AlarmAction::Activate).await;
    // The waiter keeps its place; the release hands it the slot, alarm or not.
    renewal.abort();
    holder.release(held).await.unwrap();
    let token = tokio::time::timeout(Duration::from_secs(10), waiting)
        .await
        .expect("the waiter is handed the slot under the alarm")
        .unwrap()
        .unwrap();
    assert!(token.lease_id() > held.lease_id());
    assert_eq!(
        slot_keys(&mut c, "nospace-handoff").await,
        vec![(
            "leasehold/nospace-handoff/slot/000000".to_owned(),
            waiter.session_lease().unwrap()
        )],
        "the slot is the waiter's"
    );
    // And its release, with nobody waiting, frees it.
    waiter.release(token).await.unwrap();
    assert!(slot_keys(&mut c, "nospace-handoff").await.is_empty());
    nospace(&mut c, AlarmAction::Deactivate).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_nospace_a_release_nobody_waits_for_frees_the_slot() {
    let Some(bin) = etcd_binary("under_nospace_a_release_frees_the_slot") else {
        return;
    };
    let etcd = Etcd::start(&bin);
    let mut c = Client::connect([etcd.endpoint()], None).await.unwrap();
    let broker = connect(&etcd, "nospace-release", 2).await;
    let token = broker.acquire(request(1)).await.unwrap();

    nospace(&mut c, AlarmAction::Activate).await;
    broker.release(token).await.unwrap();
    assert!(
        pool_keys(&mut c, "nospace-release").await.is_empty(),
        "the slot key and the request's marker are gone"
    );
    nospace(&mut c, AlarmAction::Deactivate).await;
    let again = broker.acquire(request(2)).await.unwrap();
    assert!(again.lease_id() > token.lease_id());
    broker.release(again).await.unwrap();
}
