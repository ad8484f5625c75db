//! Non-blocking submission for frame loops: a job handle polled without blocking, cancelled or
//! dropped from a thread that never awaits.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::TestBroker;
use leasehold::{JobSpec, Supervisor};
use tokio::sync::Notify;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Polls like a frame loop would, with a bound so a bug fails instead of hanging.
fn poll_until<T>(mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no result within 30 s"
        );
        std::thread::yield_now();
    }
}

#[test]
fn a_frame_loop_submits_and_polls_without_blocking() {
    let rt = runtime();
    let sup = rt.block_on(Supervisor::builder().slots(1).start()).unwrap();
    let gate = Arc::new(Notify::new());
    let g = Arc::clone(&gate);
    let mut handle = sup.submit(JobSpec::new("bake").unwrap(), move |ctx| async move {
        g.notified().await;
        Ok::<_, std::io::Error>(ctx.slot_id())
    });
    assert_eq!(handle.job_id(), "bake");
    // Still running: polling returns at once with nothing.
    assert!(handle.try_take().is_none());
    assert!(!handle.is_finished());
    gate.notify_one();
    let result = poll_until(|| handle.try_take());
    assert_eq!(result.unwrap(), 0);
    assert!(handle.is_finished());
    assert!(handle.try_take().is_none(), "a result is taken once");
    let report = rt.block_on(sup.shutdown()).unwrap();
    assert_eq!(report.stats.released_total, 1);
}

#[test]
fn cancelling_a_handle_cancels_the_job_and_the_result_still_arrives() {
    let rt = runtime();
    let sup = rt.block_on(Supervisor::builder().slots(1).start()).unwrap();
    let started = Arc::new(Notify::new());
    let s = Arc::clone(&started);
    let mut handle = sup.submit(JobSpec::new("stale").unwrap(), move |ctx| async move {
        s.notify_one();
        ctx.cancelled().await;
        Err::<(), _>(std::io::Error::from(std::io::ErrorKind::Interrupted))
    });
    rt.block_on(started.notified());
    handle.cancel();
    assert!(handle.is_cancelled());
    let err = poll_until(|| handle.try_take()).unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_CANCELLED");
    rt.block_on(sup.shutdown()).unwrap();
}

#[test]
fn dropping_a_handle_cancels_its_job_and_the_slot_still_comes_back_once() {
    let rt = runtime();
    let broker = TestBroker::new(1);
    let sup = rt
        .block_on(Supervisor::builder().broker(broker.clone()).start())
        .unwrap();
    let (started, ended) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (s, e) = (Arc::clone(&started), Arc::clone(&ended));
    let handle = sup.submit(JobSpec::new("dropped").unwrap(), move |ctx| async move {
        s.notify_one();
        ctx.cancelled().await;
        e.notify_one();
        Ok::<_, std::io::Error>(())
    });
    rt.block_on(started.notified());
    drop(handle);
    rt.block_on(ended.notified());
    let report = rt.block_on(sup.shutdown()).unwrap();
    broker.assert_quiescent(report.stats);
    assert_eq!(broker.release_calls(), 1);
}

#[test]
fn a_detached_handle_lets_its_job_finish() {
    let rt = runtime();
    let sup = rt.block_on(Supervisor::builder().slots(1).start()).unwrap();
    let done = Arc::new(Notify::new());
    let d = Arc::clone(&done);
    let handle = sup.submit(JobSpec::new("detached").unwrap(), move |ctx| async move {
        tokio::task::yield_now().await;
        assert!(!ctx.is_cancelled(), "a detached job was cancelled");
        d.notify_one();
        Ok::<_, std::io::Error>(())
    });
    handle.detach();
    rt.block_on(done.notified());
    rt.block_on(sup.shutdown()).unwrap();
}

#[test]
fn a_handle_whose_supervisor_runtime_is_gone_answers_supervisor_stopped() {
    let rt = runtime();
    let sup = rt.block_on(Supervisor::builder().slots(1).start()).unwrap();
    drop(rt);
    let mut handle = sup.submit(JobSpec::new("orphan").unwrap(), |_ctx| async {
        Ok::<_, std::io::Error>(())
    });
    let err = poll_until(|| handle.try_take()).unwrap_err();
    assert_eq!(err.code(), "SUPERVISOR_STOPPED");
}

#[test]
fn jobs_submitted_one_after_another_are_served_in_that_order() {
    let rt = runtime();
    let sup = rt.block_on(Supervisor::builder().slots(1).start()).unwrap();
    // From a task on a runtime thread, as a frame loop driven by the runtime would: each
    // submission is queued when `submit` returns, whatever the runtime runs first.
    let order = rt.block_on(rt.spawn({
        let sup = sup.clone();
        async move {
            let served = Arc::new(parking_lot::Mutex::new(Vec::new()));
            let handles: Vec<_> = (0..8)
                .map(|i| {
                    let served = Arc::clone(&served);
                    sup.submit(JobSpec::new(format!("frame-{i}")).unwrap(), move |_ctx| {
                        served.lock().push(i);
                        async { Ok::<_, std::io::Error>(()) }
                    })
                })
                .collect();
            for handle in handles {
                handle.join().await.unwrap();
            }
            served.lock().clone()
        }
    }));
    assert_eq!(order.unwrap(), (0..8).collect::<Vec<_>>());
    rt.block_on(sup.shutdown()).unwrap();
}

#[test]
fn a_cancel_by_id_right_after_submit_finds_the_job() {
    let rt = runtime();
    let sup = rt.block_on(Supervisor::builder().slots(1).start()).unwrap();
    // The slot is busy: the job waits in the queue.
    let held = rt.block_on(sup.acquire()).unwrap();
    let (found, handle) = rt
        .block_on(rt.spawn({
            let sup = sup.clone();
            async move {
                let handle = sup.submit(JobSpec::new("stale-bake").unwrap(), |_ctx| async {
                    Ok::<_, std::io::Error>(())
                });
                (sup.cancel("stale-bake").await.unwrap(), handle)
            }
        }))
        .unwrap();
    assert!(
        found,
        "the cancel did not find the job submitted just before it"
    );
    let ended = rt.block_on(handle.join());
    assert_eq!(ended.unwrap_err().code(), "LEASE_ACQUIRE_CANCELLED");
    drop(held);
    rt.block_on(sup.shutdown()).unwrap();
}

#[test]
fn spawn_job_queues_the_job_before_its_future_is_polled() {
    struct Idle;
    impl ractor::Actor for Idle {
        type Msg = ();
        type State = ();
        type Arguments = ();
        async fn pre_start(
            &self,
            _myself: ractor::ActorRef<()>,
            _args: (),
        ) -> Result<(), ractor::ActorProcessingErr> {
            Ok(())
        }
    }
    let rt = runtime();
    let sup = rt.block_on(Supervisor::builder().slots(1).start()).unwrap();
    let held = rt.block_on(sup.acquire()).unwrap();
    let spawned = sup.spawn_job(JobSpec::new("actor-job").unwrap(), Idle, |_ctx| ());
    assert!(
        rt.block_on(sup.cancel("actor-job")).unwrap(),
        "the job was not in the queue before its future was polled"
    );
    let err = rt.block_on(spawned).unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_CANCELLED");
    drop(held);
    rt.block_on(sup.shutdown()).unwrap();
}

#[test]
fn a_handle_whose_supervisor_runtime_is_gone_says_it_is_finished() {
    let rt = runtime();
    let sup = rt.block_on(Supervisor::builder().slots(1).start()).unwrap();
    // The slot is busy: the job waits in the queue when the runtime goes.
    let held = rt.block_on(sup.acquire()).unwrap();
    let mut handle = sup.submit(JobSpec::new("waiting").unwrap(), |_ctx| async {
        Ok::<_, std::io::Error>(())
    });
    assert!(!handle.is_finished());
    drop(rt);
    drop(held);
    poll_until(|| handle.is_finished().then_some(()));
    let err = handle
        .try_take()
        .expect("finished, so the result is there")
        .unwrap_err();
    assert_eq!(err.code(), "SUPERVISOR_STOPPED");
}
