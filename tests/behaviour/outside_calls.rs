//! Where leasehold meets code it did not write (DESIGN.md invariants 9 and 11): a broker that
//! panics or hangs at any of its calls, a file system that refuses, and answers that leave
//! only once their effect shows. Each test is named as the behaviour it shows, through the
//! public API only.

use crate::common;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use common::{Plan, TestBroker, until};
use leasehold::{
    AcquireError, AcquireRequest, BrokerError, BrokerErrorKind, JobSpec, Lease, LocalBroker,
    SlotBroker, SlotToken, Supervisor, metric_names,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use parking_lot::Mutex;

/// Turns a hang into a failure (on the paused clock too: it advances when all is idle).
async fn guarded<F: Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(60), fut)
        .await
        .unwrap_or_else(|_| panic!("hung: {what}"))
}

async fn supervisor_on(broker: &TestBroker) -> Supervisor {
    Supervisor::builder()
        .broker(broker.clone())
        .cleanup_timeout(Duration::from_secs(1))
        .start()
        .await
        .unwrap()
}

fn is_panicked(err: &BrokerError) -> bool {
    err.kind() == BrokerErrorKind::Panicked && err.code() == Some(BrokerError::PANICKED)
}

/// After a broker call panicked: the supervisor still grants, runs and releases.
async fn still_serves(sup: &Supervisor) {
    let mut lease = guarded("an acquire after the panic", sup.acquire())
        .await
        .expect("the supervisor keeps serving after a broker panic");
    lease.release().await.unwrap();
    let ran = guarded(
        "a job after the panic",
        sup.run(JobSpec::new("after-the-panic").unwrap(), |_| async {
            Ok::<_, Infallible>(7)
        }),
    )
    .await;
    assert_eq!(ran.unwrap(), 7);
}

// ---------------------------------------------------------------------------------------------
// A broker that panics
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_broker_whose_acquire_panics_on_its_first_poll_fails_that_acquire_and_the_supervisor_keeps_serving()
 {
    let broker = TestBroker::new(2);
    broker.on_acquire(|n| if n == 0 { Plan::Panic } else { Plan::Ok });
    let sup = supervisor_on(&broker).await;
    let err = guarded("the panicking acquire", sup.acquire())
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_FAILED");
    assert!(
        matches!(&err, AcquireError::Failed(e) if is_panicked(e)),
        "{err:?}"
    );
    still_serves(&sup).await;
    let report = guarded("shutdown", sup.shutdown()).await.unwrap();
    assert_eq!(report.broker_close_failed, None);
    broker.assert_quiescent(sup.stats());
}

#[tokio::test]
async fn a_broker_whose_acquire_panics_after_an_await_fails_that_acquire_and_the_supervisor_keeps_serving()
 {
    let broker = TestBroker::new(2);
    broker.on_acquire(|n| {
        if n == 0 {
            Plan::PanicAfterAwait
        } else {
            Plan::Ok
        }
    });
    let sup = supervisor_on(&broker).await;
    let err = guarded("the panicking acquire", sup.acquire())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, AcquireError::Failed(e) if is_panicked(e)),
        "{err:?}"
    );
    // A job's acquire that panics: the run hears it, no body ran.
    broker.on_acquire(|n| if n == 1 { Plan::Panic } else { Plan::Ok });
    let ran = guarded(
        "a job whose acquire panics",
        sup.run(JobSpec::new("no-slot").unwrap(), |_| async {
            Ok::<_, Infallible>(())
        }),
    )
    .await;
    assert_eq!(ran.unwrap_err().code(), "LEASE_ACQUIRE_FAILED");
    still_serves(&sup).await;
    guarded("shutdown", sup.shutdown()).await.unwrap();
    broker.assert_quiescent(sup.stats());
}

#[tokio::test]
async fn a_broker_whose_release_panics_after_its_first_await_answers_the_release_and_shutdown_returns()
 {
    let broker = TestBroker::new(1);
    broker.on_release(|lease| {
        if lease == 1 {
            Plan::PanicAfterAwait
        } else {
            Plan::Ok
        }
    });
    let sup = supervisor_on(&broker).await;
    let mut lease = sup.acquire().await.unwrap();
    assert_eq!(lease.lease_id().unwrap(), 1);
    let err = guarded("the panicking release", lease.release())
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_FAILED");
    assert!(err.broker_error().is_some_and(is_panicked), "{err:?}");
    // Exactly one broker call: a second release is a no-op.
    guarded("the second release", lease.release())
        .await
        .unwrap_or_else(|e| panic!("a second release answers Ok: {e}"));
    assert_eq!(broker.release_calls(), 1);
    still_serves(&sup).await;
    let stats = guarded("shutdown", sup.shutdown()).await.unwrap().stats;
    assert_eq!(stats.release_failed_total, 1, "{stats:?}");
    broker.assert_quiescent(sup.stats());
}

#[tokio::test]
async fn a_broker_whose_release_panics_on_its_first_poll_fails_that_release_and_the_job_hears_it() {
    let broker = TestBroker::new(1);
    broker.on_release(|lease| if lease == 1 { Plan::Panic } else { Plan::Ok });
    let sup = supervisor_on(&broker).await;
    let ran = guarded(
        "a job whose release panics",
        sup.run(JobSpec::new("release-panics").unwrap(), |_| async {
            Ok::<_, Infallible>(1)
        }),
    )
    .await;
    let err = ran.unwrap_err();
    assert_eq!(err.code(), "LEASE_CLEANUP_FAILED");
    let cleanup = err.cleanup_error().expect("the cleanup error");
    assert!(cleanup.broker_error().is_some_and(is_panicked), "{err:?}");
    still_serves(&sup).await;
    guarded("shutdown", sup.shutdown()).await.unwrap();
    broker.assert_quiescent(sup.stats());
}

#[tokio::test]
async fn a_lease_whose_release_panics_while_shutdown_waits_for_it_lets_shutdown_return() {
    let broker = TestBroker::new(1);
    broker.on_release(|_| Plan::PanicAfterAwait);
    let sup = supervisor_on(&broker).await;
    let lease = sup.acquire().await.unwrap();
    // The supervisor releases it on its holder's behalf; that release panics.
    let report = guarded("shutdown", sup.shutdown()).await.unwrap();
    assert_eq!(report.released_leases, 1, "{report:?}");
    assert_eq!(report.stats.release_failed_total, 1, "{report:?}");
    drop(lease);
    assert_eq!(broker.release_calls(), 1);
}

// ---------------------------------------------------------------------------------------------
// A broker whose close panics or hangs
// ---------------------------------------------------------------------------------------------

async fn shutdown_with_close(plan: Plan) -> leasehold::ShutdownReport {
    let broker = TestBroker::new(1);
    broker.on_close(plan);
    let sup = supervisor_on(&broker).await;
    sup.run(JobSpec::new("before-close").unwrap(), |_| async {
        Ok::<_, Infallible>(())
    })
    .await
    .unwrap();
    let report = guarded("shutdown", sup.shutdown()).await.unwrap();
    assert_eq!(broker.close_calls(), 1);
    broker.assert_quiescent(sup.stats());
    report
}

#[tokio::test]
async fn a_broker_whose_close_panics_on_its_first_poll_lets_shutdown_return_and_say_so() {
    let report = shutdown_with_close(Plan::Panic).await;
    let failed = report.broker_close_failed.expect("the close's failure");
    assert!(is_panicked(&failed), "{failed:?}");
}

#[tokio::test]
async fn a_broker_whose_close_panics_after_an_await_lets_shutdown_return_and_say_so() {
    let report = shutdown_with_close(Plan::PanicAfterAwait).await;
    let failed = report.broker_close_failed.expect("the close's failure");
    assert!(is_panicked(&failed), "{failed:?}");
}

#[tokio::test(start_paused = true)]
async fn a_broker_whose_close_hangs_lets_shutdown_return_within_the_cleanup_timeout_and_say_so() {
    let started = tokio::time::Instant::now();
    let report = shutdown_with_close(Plan::Hang).await;
    let failed = report.broker_close_failed.expect("the close's failure");
    assert_eq!(failed.kind(), BrokerErrorKind::Timeout, "{failed:?}");
    // The cleanup timeout (1 s), and the shutdown's own bounds around it.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_broker_whose_close_fails_lets_shutdown_return_and_say_so() {
    let report = shutdown_with_close(Plan::Fail).await;
    let failed = report.broker_close_failed.expect("the close's failure");
    assert_eq!(failed.kind(), BrokerErrorKind::Other, "{failed:?}");
}

// ---------------------------------------------------------------------------------------------
// Answers leave once their effect shows
// ---------------------------------------------------------------------------------------------

/// Runs `test` on a current-thread runtime on this thread, with a debugging recorder installed
/// for this thread only (the supervisor's tasks run here too), so that what it reads is this
/// supervisor's metrics alone.
fn with_metrics(test: impl FnOnce(Snapshotter) -> Pin<Box<dyn Future<Output = ()>>>) {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(test(snapshotter));
    });
}

/// Counters summed over snapshots (a snapshot drains them); gauges keep their last value.
#[derive(Default)]
struct Seen {
    counters: HashMap<String, u64>,
    gauges: HashMap<String, f64>,
}

impl Seen {
    fn take(&mut self, snapshotter: &Snapshotter) {
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let name = key.key().name().to_owned();
            match value {
                DebugValue::Counter(n) => *self.counters.entry(name).or_default() += n,
                DebugValue::Gauge(v) => {
                    self.gauges.insert(name, v.into_inner());
                }
                DebugValue::Histogram(_) => {}
            }
        }
    }

    fn counter(&self, name: &str) -> u64 {
        self.counters.get(name).copied().unwrap_or(0)
    }
}

/// A broker whose second acquire runs a probe inside its first poll: the supervisor polls it
/// inline, in the middle of its batch, right after it handed the first acquire's lease over.
struct ProbeBroker {
    local: LocalBroker,
    calls: AtomicU64,
    probe: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl SlotBroker for ProbeBroker {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 1
            && let Some(probe) = self.probe.lock().take()
        {
            probe();
        }
        self.local.acquire(request).await
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.local.release(token).await
    }

    fn capacity(&self) -> Option<u32> {
        Some(2)
    }
}

type LeaseFuture = Pin<Box<dyn Future<Output = Result<Lease, AcquireError>> + Send>>;

fn poll_now(fut: &mut LeaseFuture) -> Poll<Result<Lease, AcquireError>> {
    fut.as_mut().poll(&mut Context::from_waker(Waker::noop()))
}

/// What the probe saw, mid-batch, once the first lease had been handed over.
#[derive(Debug, Default)]
struct MidBatch {
    probed: bool,
    lease: Option<Lease>,
    lease_id: Option<u64>,
    table: Vec<u64>,
    active: usize,
    acquired_total: u64,
    active_gauge: f64,
    acquire_counter: u64,
}

#[test]
fn an_acquire_answered_in_the_middle_of_a_batch_is_already_in_the_lease_table_stats_and_gauges() {
    with_metrics(|snapshotter| {
        Box::pin(async move {
            let broker = Arc::new(ProbeBroker {
                local: LocalBroker::new(2),
                calls: AtomicU64::new(0),
                probe: Mutex::new(None),
            });
            let sup = Supervisor::builder()
                .broker(Arc::clone(&broker))
                .start()
                .await
                .unwrap();
            let first: Arc<Mutex<LeaseFuture>> = Arc::new(Mutex::new(Box::pin({
                let sup = sup.clone();
                async move { sup.acquire().await }
            })));
            let seen = Arc::new(Mutex::new(MidBatch::default()));
            *broker.probe.lock() = Some(Box::new({
                let (sup, first, seen) = (sup.clone(), Arc::clone(&first), Arc::clone(&seen));
                move || {
                    let mut seen = seen.lock();
                    seen.probed = true;
                    if let Poll::Ready(lease) = poll_now(&mut first.lock()) {
                        let lease = lease.unwrap();
                        seen.lease_id = lease.lease_id().ok();
                        seen.lease = Some(lease);
                    }
                    seen.table = sup
                        .leases()
                        .iter()
                        .flat_map(|l| l.tokens.iter().map(|t| t.lease_id()))
                        .collect();
                    let stats = sup.stats();
                    seen.active = stats.active;
                    seen.acquired_total = stats.acquired_total;
                    let mut metrics = Seen::default();
                    metrics.take(&snapshotter);
                    seen.active_gauge = metrics.gauges[metric_names::ACTIVE_COUNT];
                    seen.acquire_counter = metrics.counter(metric_names::ACQUIRE_COUNT);
                }
            }));
            // Both acquires are in the inbox before the supervisor's next turn: one batch.
            assert!(poll_now(&mut first.lock()).is_pending());
            let mut second: LeaseFuture = Box::pin({
                let sup = sup.clone();
                async move { sup.acquire().await }
            });
            assert!(poll_now(&mut second).is_pending());
            let mut second = guarded("the second acquire", second).await.unwrap();
            let seen = std::mem::take(&mut *seen.lock());
            assert!(
                seen.probed,
                "the second acquire shared the first one's batch"
            );
            // Whenever the first lease had been handed over by then, everything shows it.
            if let Some(id) = seen.lease_id {
                assert_eq!(seen.table, [id], "{seen:?}");
                assert_eq!(seen.active, 1, "{seen:?}");
                assert_eq!(seen.active_gauge, 1.0, "{seen:?}");
                assert_eq!(seen.acquired_total, 1, "{seen:?}");
                assert_eq!(seen.acquire_counter, 1, "{seen:?}");
            }
            // And once the turn has ended, the first lease has been handed over.
            let mut first = match seen.lease {
                Some(lease) => lease,
                None => match poll_now(&mut first.lock()) {
                    Poll::Ready(lease) => lease.unwrap(),
                    Poll::Pending => panic!("the first lease was not handed over in its turn"),
                },
            };
            first.release().await.unwrap();
            second.release().await.unwrap();
            sup.shutdown().await.unwrap();
        })
    });
}

#[test]
fn a_grant_whose_caller_left_before_the_hand_over_counts_the_same_in_stats_and_the_acquire_counter()
{
    with_metrics(|snapshotter| {
        Box::pin(async move {
            let broker = TestBroker::new(1);
            let gate = Arc::new(tokio::sync::Notify::new());
            broker.on_acquire({
                let gate = Arc::clone(&gate);
                move |n| {
                    if n == 0 {
                        Plan::Gate(Arc::clone(&gate))
                    } else {
                        Plan::Ok
                    }
                }
            });
            let sup = supervisor_on(&broker).await;
            let cancel = leasehold::CancellationToken::new();
            let job = JobSpec::new("left").unwrap().with_cancel(cancel.clone());
            let mut run = Box::pin(sup.run(job, |_| async { Ok::<_, Infallible>(()) }));
            let polled = run.as_mut().poll(&mut Context::from_waker(Waker::noop()));
            assert!(polled.is_pending());
            broker.0.acquire_entered.notified().await;
            // The caller leaves (its run future is not polled again until the end) while the
            // broker answers: the grant comes with nobody to take it, and goes straight back.
            cancel.cancel();
            gate.notify_one();
            until("the grant nobody took went back", || {
                broker.release_calls() == 1
            })
            .await;
            let err = guarded("the cancelled run", run).await.unwrap_err();
            assert_eq!(err.code(), "LEASE_ACQUIRE_CANCELLED");
            let mut lease = sup.acquire().await.unwrap();
            lease.release().await.unwrap();
            let stats = sup.stats();
            let mut seen = Seen::default();
            seen.take(&snapshotter);
            assert_eq!(
                seen.counter(metric_names::ACQUIRE_COUNT),
                stats.acquired_total,
                "{stats:?}"
            );
            assert_eq!(stats.acquired_total, 2, "{stats:?}");
            sup.shutdown().await.unwrap();
            broker.assert_quiescent(sup.stats());
        })
    });
}

// ---------------------------------------------------------------------------------------------
// The file system
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_temp_dir_that_was_never_made_is_never_removed_and_the_run_keeps_its_result() {
    let scratch = tempfile::tempdir().unwrap();
    let root = scratch.path().join("work");
    std::fs::create_dir(&root).unwrap();
    let sup = Supervisor::builder()
        .slots(1)
        .work_root(&root)
        .start()
        .await
        .unwrap();
    // The work root is replaced by a file: no temp dir can be made under it.
    std::fs::remove_dir(&root).unwrap();
    std::fs::write(&root, b"not a directory").unwrap();
    let ran = guarded(
        "a job whose temp dir cannot be made",
        sup.run(JobSpec::new("no-dir").unwrap(), |ctx| async move {
            let err = ctx.try_temp_dir().unwrap_err();
            assert_eq!(err.code(), "LEASE_PREPARE_FAILED");
            Ok::<_, Infallible>(5)
        }),
    )
    .await;
    assert_eq!(ran.expect("the run keeps its own result"), 5);
    let stats = sup.stats();
    assert_eq!(stats.quarantined, 0, "{stats:?}");
    assert_eq!(sup.quarantined().await.unwrap(), []);
    assert_eq!(std::fs::read(&root).unwrap(), b"not a directory");
    let report = guarded("shutdown", sup.shutdown()).await.unwrap();
    assert_eq!(report.quarantined, 0, "{report:?}");
}

#[tokio::test]
async fn a_reclaim_lists_a_slot_whose_temp_dir_still_cannot_be_removed_as_still_quarantined() {
    let (sup, _root) = common::pool(1).await;
    // A regular file where the temp dir was: removing a directory there fails.
    let path = common::quarantine_by_clobbering(&sup, "unremovable").await;
    for _ in 0..3 {
        // The retried removal fails again: the slot is not reported reclaimed.
        let report = guarded("a reclaim", sup.reclaim_quarantined())
            .await
            .unwrap();
        assert_eq!(report.reclaimed, [], "{report:?}");
        assert_eq!(report.still_quarantined.len(), 1, "{report:?}");
        assert!(
            report.still_quarantined[0]
                .reason
                .contains("could not be removed"),
            "{report:?}"
        );
        // What the report said is what the supervisor shows once it has answered.
        assert_eq!(sup.stats().quarantined, 1);
        assert_eq!(sup.quarantined().await.unwrap(), report.still_quarantined);
    }
    std::fs::remove_file(&path).unwrap();
    let report = guarded("a reclaim", sup.reclaim_quarantined())
        .await
        .unwrap();
    assert_eq!(report.reclaimed.len(), 1, "{report:?}");
    assert_eq!(report.still_quarantined, [], "{report:?}");
    assert_eq!(sup.stats().quarantined, 0);
    let report = guarded("shutdown", sup.shutdown()).await.unwrap();
    assert_eq!(report.quarantined, 0, "{report:?}");
}

// ---------------------------------------------------------------------------------------------
// Values the user wrote: panic payloads, job closures, the error sink, the broker's drop
// ---------------------------------------------------------------------------------------------

/// A panic payload whose own `Drop` panics.
struct PayloadThatPanicsWhenDropped;

impl Drop for PayloadThatPanicsWhenDropped {
    fn drop(&mut self) {
        panic!("the panic's payload panicked while it was dropped");
    }
}

/// A value a job's closure captures, whose `Drop` panics.
struct PanicsWhenDropped;

impl Drop for PanicsWhenDropped {
    fn drop(&mut self) {
        panic!("a job's closure panicked while it was dropped");
    }
}

/// A value whose `Drop` blocks its thread until the gate opens.
struct BlocksWhenDropped(common::ThreadGate);

impl Drop for BlocksWhenDropped {
    fn drop(&mut self) {
        self.0.wait();
    }
}

/// The in-process pool, but its `n`th acquire panics with a payload that panics when dropped.
struct PanickingPayloadBroker {
    local: LocalBroker,
    calls: AtomicU64,
    nth: u64,
}

impl SlotBroker for PanickingPayloadBroker {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == self.nth {
            std::panic::panic_any(PayloadThatPanicsWhenDropped);
        }
        self.local.acquire(request).await
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.local.release(token).await
    }

    fn capacity(&self) -> Option<u32> {
        Some(2)
    }
}

#[tokio::test]
async fn a_broker_acquire_that_panics_with_a_payload_that_panics_when_dropped_fails_that_acquire_and_the_supervisor_keeps_serving()
 {
    let sup = Supervisor::builder()
        .broker(PanickingPayloadBroker {
            local: LocalBroker::new(2),
            calls: AtomicU64::new(0),
            nth: 0,
        })
        .start()
        .await
        .unwrap();
    let err = guarded("the panicking acquire", sup.acquire())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, AcquireError::Failed(e) if is_panicked(e)),
        "{err:?}"
    );
    still_serves(&sup).await;
    sup.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_error_sink_that_panics_with_a_payload_that_panics_when_dropped_leaves_the_supervisor_serving()
 {
    let broker = TestBroker::new(2);
    broker.on_release(|_| Plan::Fail);
    let (heard_tx, mut heard) = tokio::sync::mpsc::unbounded_channel();
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .error_sink(move |failure| {
            let _ = heard_tx.send(failure.error.code());
            std::panic::panic_any(PayloadThatPanicsWhenDropped);
        })
        .start()
        .await
        .unwrap();
    // A dropped lease whose release fails: nobody is left to hear it but the sink.
    drop(guarded("an acquire", sup.acquire()).await.unwrap());
    let heard = guarded("the sink's call", heard.recv()).await.unwrap();
    assert_eq!(heard, "LEASE_CLEANUP_FAILED");
    broker.on_release(|_| Plan::Ok);
    still_serves(&sup).await;
    sup.shutdown().await.unwrap();
}

/// A job waiting behind the one slot, whose closure holds `value`; the caller gives up.
async fn a_queued_job_is_cancelled<V: Send + 'static>(sup: &Supervisor, value: V) {
    let held = guarded("the slot", sup.acquire()).await.unwrap();
    let cancel = tokio_util::sync::CancellationToken::new();
    let job = JobSpec::new("queued-then-cancelled")
        .unwrap()
        .with_cancel(cancel.clone());
    let waiting = tokio::spawn({
        let sup = sup.clone();
        async move {
            sup.run(job, move |_ctx| async move {
                drop(value);
                Ok::<_, Infallible>(())
            })
            .await
        }
    });
    until("the job to queue", || sup.stats().waiting == 1).await;
    cancel.cancel();
    let ended = guarded("the cancelled job", waiting).await.unwrap();
    assert_eq!(ended.unwrap_err().code(), "LEASE_ACQUIRE_CANCELLED");
    drop(held);
}

#[tokio::test]
async fn a_queued_job_whose_closure_panics_when_dropped_is_cancelled_and_the_supervisor_keeps_serving()
 {
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    a_queued_job_is_cancelled(&sup, PanicsWhenDropped).await;
    still_serves(&sup).await;
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_job_whose_closure_blocks_when_dropped_is_cancelled_and_no_other_caller_waits_for_it()
 {
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    let gate = common::ThreadGate::default();
    let _open = OpenOnDrop(gate.clone());
    a_queued_job_is_cancelled(&sup, BlocksWhenDropped(gate.clone())).await;
    // The closure's drop is still blocked: the supervisor answers all the same.
    still_serves(&sup).await;
    gate.open();
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_sink_that_blocks_does_not_delay_an_acquire_of_a_free_slot() {
    let broker = TestBroker::new(2);
    broker.on_release(|_| Plan::Fail);
    let gate = common::ThreadGate::default();
    let _open = OpenOnDrop(gate.clone());
    let (entered_tx, mut entered) = tokio::sync::mpsc::unbounded_channel();
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .error_sink({
            let gate = gate.clone();
            move |_failure| {
                let _ = entered_tx.send(());
                gate.wait();
            }
        })
        .start()
        .await
        .unwrap();
    drop(guarded("an acquire", sup.acquire()).await.unwrap());
    guarded("the sink to be called", entered.recv())
        .await
        .unwrap();
    // The sink blocks now. Another failure for it, and an acquire of a free slot: answered.
    drop(guarded("a second acquire", sup.acquire()).await.unwrap());
    let mut lease = tokio::time::timeout(Duration::from_secs(10), sup.acquire())
        .await
        .expect("an acquire of a free slot waited for the blocked error sink")
        .unwrap();
    broker.on_release(|_| Plan::Ok);
    lease.release().await.unwrap();
    gate.open();
    let report = sup.shutdown().await.unwrap();
    assert!(report.outlived.is_empty(), "{:?}", report.outlived);
}

/// The in-process pool, whose `Drop` blocks until the gate opens.
struct BrokerThatBlocksWhenDropped {
    local: LocalBroker,
    gate: common::ThreadGate,
}

impl Drop for BrokerThatBlocksWhenDropped {
    fn drop(&mut self) {
        self.gate.wait();
    }
}

impl SlotBroker for BrokerThatBlocksWhenDropped {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        self.local.acquire(request).await
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.local.release(token).await
    }

    fn capacity(&self) -> Option<u32> {
        Some(1)
    }
}

/// Opens the gate when the test ends, failed or not: a thread still blocked on it would hold
/// the runtime's own shutdown.
struct OpenOnDrop(common::ThreadGate);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_within_its_bound_when_the_brokers_drop_blocks_and_names_it() {
    let gate = common::ThreadGate::default();
    let _open = OpenOnDrop(gate.clone());
    let sup = Supervisor::builder()
        .broker(BrokerThatBlocksWhenDropped {
            local: LocalBroker::new(1),
            gate: gate.clone(),
        })
        .shutdown_timeout(Duration::from_secs(1))
        .start()
        .await
        .unwrap();
    still_serves(&sup).await;
    let report = tokio::time::timeout(Duration::from_secs(10), sup.shutdown())
        .await
        .expect("shutdown waited for the broker's drop past its bound")
        .unwrap();
    assert_eq!(report.outlived, ["the broker"]);
    gate.open();
}

// ---------------------------------------------------------------------------------------------
// What a broker is told
// ---------------------------------------------------------------------------------------------

/// The in-process pool, recording each request and the origin of the events it was handed.
struct Recording {
    local: LocalBroker,
    requests: Mutex<Vec<AcquireRequest>>,
    attached: Mutex<Vec<u64>>,
}

impl SlotBroker for Recording {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        self.requests.lock().push(request.clone());
        self.local.acquire(request).await
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.local.release(token).await
    }

    fn attach(&self, events: leasehold::BrokerEvents) {
        self.attached.lock().push(events.origin());
    }
}

#[tokio::test]
async fn a_broker_is_told_the_head_jobs_id_and_its_supervisors_origin_the_same_as_its_events() {
    let broker = Arc::new(Recording {
        local: LocalBroker::new(2),
        requests: Mutex::new(Vec::new()),
        attached: Mutex::new(Vec::new()),
    });
    let sups = [
        Supervisor::builder()
            .broker(Arc::clone(&broker))
            .start()
            .await
            .unwrap(),
        Supervisor::builder()
            .broker(Arc::clone(&broker))
            .start()
            .await
            .unwrap(),
    ];
    let attached = broker.attached.lock().clone();
    assert_eq!(attached.len(), 2, "each supervisor attaches once");
    assert_ne!(
        attached[0], attached[1],
        "each supervisor has an origin of its own"
    );
    assert!(
        attached.iter().all(|o| *o != 0),
        "an origin is never 0: {attached:?}"
    );
    for (i, sup) in sups.iter().enumerate() {
        let id = format!("render-{i}");
        let ran = sup
            .run(JobSpec::new(id.clone()).unwrap(), |_ctx| async {
                Ok::<_, Infallible>(())
            })
            .await;
        ran.unwrap();
        let request = broker.requests.lock().last().cloned().unwrap();
        assert_eq!(request.job_id(), Some(id.as_str()));
        assert_eq!(request.origin(), attached[i]);
    }
    // An explicit lease names no job.
    let lease = sups[0].acquire().await.unwrap();
    assert_eq!(broker.requests.lock().last().unwrap().job_id(), None);
    drop(lease);
    // Request ids are unique per supervisor.
    let ids: Vec<(u64, u64)> = broker
        .requests
        .lock()
        .iter()
        .map(|r| (r.origin(), r.request_id()))
        .collect();
    let unique: std::collections::HashSet<_> = ids.iter().collect();
    assert_eq!(unique.len(), ids.len(), "{ids:?}");
    for sup in sups {
        sup.shutdown().await.unwrap();
    }
}

/// A broker that says it needs no renewal and counts every `keep_alive` asked of it.
struct NoRenewals {
    pool: LocalBroker,
    keep_alives: AtomicU64,
}

impl SlotBroker for NoRenewals {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        self.pool.acquire(request).await
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.pool.release(token).await
    }

    fn keep_alive(&self, _token: SlotToken) -> impl Future<Output = BrokerError> + Send {
        self.keep_alives.fetch_add(1, Ordering::SeqCst);
        std::future::pending()
    }
}

/// `SlotBroker::renews` is `false` by default, and then the supervisor never calls
/// `keep_alive`: not for a job, not for an explicit lease.
#[tokio::test]
async fn a_broker_that_needs_no_renewal_is_never_asked_to_keep_a_lease_alive() {
    let broker = Arc::new(NoRenewals {
        pool: LocalBroker::new(1),
        keep_alives: AtomicU64::new(0),
    });
    let sup = Supervisor::builder()
        .broker(Arc::clone(&broker))
        .start()
        .await
        .unwrap();
    sup.run(JobSpec::new("job").unwrap(), |_ctx| async {
        Ok::<_, Infallible>(())
    })
    .await
    .unwrap();
    let mut lease = sup.acquire().await.unwrap();
    lease.release().await.unwrap();
    sup.shutdown().await.unwrap();
    assert_eq!(broker.keep_alives.load(Ordering::SeqCst), 0);
    assert_eq!(broker.pool.held(), 0);
}

/// A broker whose leases lapse unless renewed: each renewal runs until the supervisor drops it,
/// and says when it starts and when it is dropped.
struct Renewing {
    pool: LocalBroker,
    started: Arc<AtomicU64>,
    ended: Arc<AtomicU64>,
    /// Rung at each start and each drop.
    changed: Arc<tokio::sync::Notify>,
}

impl Renewing {
    /// Waits until `count` reaches `n` (rung by each renewal's start and drop).
    async fn reaches(&self, count: &AtomicU64, n: u64) {
        loop {
            let changed = self.changed.notified();
            if count.load(Ordering::SeqCst) >= n {
                return;
            }
            changed.await;
        }
    }
}

/// Dropped with its renewal's future.
struct RenewalEnds {
    ended: Arc<AtomicU64>,
    changed: Arc<tokio::sync::Notify>,
}

impl Drop for RenewalEnds {
    fn drop(&mut self) {
        self.ended.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
}

impl SlotBroker for Renewing {
    async fn acquire(&self, request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        self.pool.acquire(request).await
    }

    async fn release(&self, token: SlotToken) -> Result<(), BrokerError> {
        self.pool.release(token).await
    }

    fn renews(&self) -> bool {
        true
    }

    fn keep_alive(&self, _token: SlotToken) -> impl Future<Output = BrokerError> + Send {
        let ends = RenewalEnds {
            ended: Arc::clone(&self.ended),
            changed: Arc::clone(&self.changed),
        };
        self.started.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
        async move {
            let _ends = ends;
            std::future::pending().await
        }
    }
}

/// A lease's renewal ends with the lease: once a `release` or a `run` has answered, the
/// renewal it started is stopped (its future dropped), before the supervisor's shutdown. Each
/// lease ends only once its renewal has started (a renewal aborted before its first poll
/// never calls `keep_alive`, and there would be nothing to see dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leases_renewal_is_stopped_when_the_lease_ends() {
    let broker = Arc::new(Renewing {
        pool: LocalBroker::new(2),
        started: Arc::new(AtomicU64::new(0)),
        ended: Arc::new(AtomicU64::new(0)),
        changed: Arc::new(tokio::sync::Notify::new()),
    });
    let sup = Supervisor::builder()
        .broker(Arc::clone(&broker))
        .start()
        .await
        .unwrap();
    let b = &broker;
    // An explicit lease, with another held beside it (the renewals' map is not empty when the
    // second ends).
    let mut held = sup.acquire().await.unwrap();
    guarded("the first renewal to start", b.reaches(&b.started, 1)).await;
    let mut lease = sup.acquire().await.unwrap();
    guarded("the second renewal to start", b.reaches(&b.started, 2)).await;
    lease.release().await.unwrap();
    guarded(
        "the released lease's renewal to stop",
        b.reaches(&b.ended, 1),
    )
    .await;
    let job_broker = Arc::clone(&broker);
    sup.run(JobSpec::new("renewed").unwrap(), move |_ctx| async move {
        let b = &job_broker;
        guarded("the job's renewal to start", b.reaches(&b.started, 3)).await;
        Ok::<_, Infallible>(())
    })
    .await
    .unwrap();
    guarded("the job's renewal to stop", b.reaches(&b.ended, 2)).await;
    held.release().await.unwrap();
    guarded("the last renewal to stop", b.reaches(&b.ended, 3)).await;
    assert_eq!(b.started.load(Ordering::SeqCst), 3);
    sup.shutdown().await.unwrap();
    assert_eq!(broker.pool.held(), 0);
}

/// A broker whose `attach` panics, and which says when it is dropped.
struct PanicsOnAttach(Arc<std::sync::atomic::AtomicBool>);

impl SlotBroker for PanicsOnAttach {
    async fn acquire(&self, _request: AcquireRequest) -> Result<SlotToken, BrokerError> {
        Err(BrokerError::new("never asked"))
    }
    async fn release(&self, _token: SlotToken) -> Result<(), BrokerError> {
        Ok(())
    }
    fn attach(&self, _events: leasehold::BrokerEvents) {
        panic!("attach refused");
    }
}

impl Drop for PanicsOnAttach {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// `attach` is the broker's code too: its panic fails `start` with `SUPERVISOR_START_FAILED`
/// instead of unwinding into the caller, and the supervisor already spawned is stopped, the
/// broker dropped with it (before, both were left running with no handle to stop them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_whose_attach_panics_fails_start_and_leaves_no_supervisor_behind() {
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = Supervisor::builder()
        .broker(PanicsOnAttach(Arc::clone(&dropped)))
        .start()
        .await;
    let err = started.expect_err("start failed");
    assert_eq!(err.code(), "SUPERVISOR_START_FAILED");
    assert!(
        matches!(&err, leasehold::StartError::BrokerAttach(m) if m.contains("attach refused")),
        "{err:?}"
    );
    until("the stopped supervisor drops the broker", || {
        dropped.load(Ordering::SeqCst)
    })
    .await;
}
