//! The six behaviours the seed documents test, against the real supervisor.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::{Plan, TestBroker, supervise};
use leasehold::JobSpec;

#[tokio::test]
async fn normal_completion_releases_the_slot_once() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let v = sup
        .run(JobSpec::new("ok").unwrap(), |ctx| async move {
            Ok::<_, std::io::Error>(ctx.slot_id() + 7)
        })
        .await
        .unwrap();
    assert_eq!(v, 7);
    assert_eq!(broker.release_calls(), 1);
    broker.assert_quiescent(sup.stats());
}

#[tokio::test]
async fn body_failure_still_releases_the_slot_once() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let err = sup
        .run(JobSpec::new("fails").unwrap(), |_ctx| async move {
            Err::<(), _>(std::io::Error::other("render failed"))
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_FAILED");
    assert_eq!(
        err.body_error().unwrap().error().unwrap().to_string(),
        "render failed"
    );
    assert!(err.cleanup_error().is_none());
    assert_eq!(broker.release_calls(), 1);
    broker.assert_quiescent(sup.stats());
}

#[tokio::test]
async fn sequential_double_release_calls_the_broker_once() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let mut lease = sup.acquire().await.unwrap();
    lease.release().await.unwrap();
    lease.release().await.unwrap();
    drop(lease);
    // The drop after release must not release again either: prove the supervisor is idle by
    // taking and returning the slot once more.
    let mut again = sup.acquire().await.unwrap();
    again.release().await.unwrap();
    assert_eq!(broker.release_calls(), 2);
    broker.assert_quiescent(sup.stats());
}

#[tokio::test]
async fn release_failure_reaches_the_caller() {
    let broker = TestBroker::new(1);
    broker.on_release(|_| Plan::Fail);
    let sup = supervise(&broker).await;

    let mut lease = sup.acquire().await.unwrap();
    let err = lease.release().await.unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_FAILED");
    assert!(err.broker_error().is_some());

    let err = sup
        .run(JobSpec::new("job").unwrap(), |_ctx| async {
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_FAILED");
    assert!(err.body_error().is_none());

    let err = sup
        .run(JobSpec::new("both").unwrap(), |_ctx| async {
            Err::<(), _>(std::io::Error::other("body"))
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_AND_CLEANUP_FAILED");
    assert_eq!(err.body_error().unwrap().code(), "LEASE_BODY_FAILED");
    assert_eq!(err.cleanup_error().unwrap().code(), "LEASE_CLEANUP_FAILED");
    let stats = sup.stats();
    assert_eq!(stats.release_failed_total, 3);
    broker.assert_quiescent(stats);
}

#[tokio::test]
async fn acquire_failure_releases_nothing_and_runs_no_body() {
    let broker = TestBroker::new(1);
    broker.on_acquire(|_| Plan::Fail);
    let sup = supervise(&broker).await;
    let ran = Arc::new(AtomicBool::new(false));
    let ran2 = Arc::clone(&ran);
    let err = sup
        .run(JobSpec::new("never").unwrap(), move |_ctx| async move {
            ran2.store(true, Ordering::SeqCst);
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_FAILED");
    assert!(!ran.load(Ordering::SeqCst));
    let err = sup.acquire().await.unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_FAILED");
    assert_eq!(broker.release_calls(), 0);
    let stats = sup.stats();
    assert_eq!(stats.acquired_total, 0);
    broker.assert_quiescent(stats);
}

#[tokio::test]
async fn use_after_release_is_refused() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let mut lease = sup.acquire().await.unwrap();
    assert_eq!(lease.slot_id().unwrap(), 0);
    assert!(lease.token().is_ok());
    lease.release().await.unwrap();
    assert_eq!(lease.slot_id().unwrap_err().code(), "LEASE_RELEASED");
    assert!(lease.lease_id().is_err());
    assert!(lease.token().is_err());
    assert!(lease.is_released());
}

#[tokio::test]
async fn dropping_a_lease_releases_it_without_blocking() {
    let broker = TestBroker::new(1);
    let sup = supervise(&broker).await;
    let lease = sup.acquire().await.unwrap();
    let released = broker.0.released.notified();
    drop(lease);
    released.await;
    // The slot can be taken again.
    let mut again = sup.acquire().await.unwrap();
    again.release().await.unwrap();
    broker.assert_quiescent(sup.stats());
}
