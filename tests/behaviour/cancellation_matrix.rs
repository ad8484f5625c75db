//! Every step of acquire → body → blocking work → release, crossed with every outcome of that
//! step (ok, error, slow, hangs until its timeout), cancelled at that point by the caller's
//! token and by dropping the `run` future. After each case, every invariant of DESIGN.md
//! section 3 is checked against the broker's own record.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{EventLog, Plan, TestBroker, ThreadGate};
use leasehold::{CancellationToken, JobError, JobSpec, OrphanedFailure, Supervisor};
use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    WaitingForSlot,
    BodyRunning,
    BlockingTaskRunning,
    BrokerReleaseRunning,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ok,
    Error,
    Slow,
    HangsUntilTimeout,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cancel {
    Token,
    DropRunFuture,
}

// Bounds that only the "hangs" outcomes reach; generous, so that a slow machine (a panic
// printing its backtrace, say) never reaches them in the other cases.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(1);
const GRACE: Duration = Duration::from_millis(100);
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

type JobResult = Result<u32, JobError<std::io::Error>>;

struct Case {
    step: Step,
    outcome: Outcome,
    cancel: Cancel,
}

impl Case {
    /// The code the caller must see when it cancels with its token (`None`: `Ok`).
    fn expected_code(&self) -> Option<&'static str> {
        use Outcome::*;
        use Step::*;
        match (self.step, self.outcome) {
            (WaitingForSlot, _) => Some("LEASE_ACQUIRE_CANCELLED"),
            // A body that finishes its work despite the request returns its value.
            (BodyRunning, Ok) => None,
            (BodyRunning, _) => Some("LEASE_BODY_CANCELLED"),
            (BlockingTaskRunning, Ok | Slow) => None,
            // A panic is a failure, and cancellation outranks it.
            (BlockingTaskRunning, Error) => Some("LEASE_BODY_CANCELLED"),
            (BlockingTaskRunning, HangsUntilTimeout) => Some("LEASE_CLEANUP_UNCONFIRMED"),
            (BrokerReleaseRunning, Ok | Slow) => None,
            (BrokerReleaseRunning, Error) => Some("LEASE_CLEANUP_FAILED"),
            (BrokerReleaseRunning, HangsUntilTimeout) => Some("LEASE_CLEANUP_TIMEOUT"),
        }
    }

    /// The code the error sink must see when nobody is left to hear it (run future dropped).
    fn expected_sink_code(&self) -> Option<&'static str> {
        use Outcome::*;
        use Step::*;
        match (self.step, self.outcome) {
            (BlockingTaskRunning, HangsUntilTimeout) => Some("LEASE_CLEANUP_UNCONFIRMED"),
            (BrokerReleaseRunning, Error) => Some("LEASE_CLEANUP_FAILED"),
            (BrokerReleaseRunning, HangsUntilTimeout) => Some("LEASE_CLEANUP_TIMEOUT"),
            _ => None,
        }
    }
}

async fn run_case(case: Case) {
    let label = format!("{:?}/{:?}/{:?}", case.step, case.outcome, case.cancel);
    let broker = TestBroker::new(1);
    let log = EventLog::default();
    let gate = Arc::new(Notify::new());
    let thread_gate = ThreadGate::default();
    let sink: Arc<Mutex<Vec<OrphanedFailure>>> = Arc::default();
    let sink_heard = Arc::new(Notify::new());

    match (case.step, case.outcome) {
        (Step::WaitingForSlot, Outcome::Ok | Outcome::Slow) => {
            let g = Arc::clone(&gate);
            broker.on_acquire(move |_| Plan::Gate(Arc::clone(&g)));
        }
        (Step::WaitingForSlot, Outcome::Error) => {
            let g = Arc::clone(&gate);
            broker.on_acquire(move |_| Plan::GateThenFail(Arc::clone(&g)));
        }
        (Step::WaitingForSlot, Outcome::HangsUntilTimeout) => {
            broker.on_acquire(|_| Plan::Hang);
        }
        (Step::BrokerReleaseRunning, outcome) => {
            let (g, log) = (Arc::clone(&gate), log.clone());
            broker.on_release(move |_| {
                log.push("release");
                match outcome {
                    Outcome::Ok | Outcome::Slow => Plan::Gate(Arc::clone(&g)),
                    Outcome::Error => Plan::GateThenFail(Arc::clone(&g)),
                    Outcome::HangsUntilTimeout => Plan::Hang,
                }
            });
        }
        _ => {
            broker.log_releases(&log);
        }
    }

    let root = tempfile::tempdir().unwrap();
    let sup = {
        let (sink, heard) = (Arc::clone(&sink), Arc::clone(&sink_heard));
        Supervisor::builder()
            .broker(broker.clone())
            .cleanup_timeout(CLEANUP_TIMEOUT)
            .cancel_grace(GRACE)
            .drain_timeout(DRAIN_TIMEOUT)
            .work_root(root.path())
            .error_sink(move |f| {
                sink.lock().push(f.clone());
                heard.notify_one();
            })
            .start()
            .await
            .unwrap()
    };

    let token = CancellationToken::new();
    let (started_tx, started_rx) = oneshot::channel::<()>();
    let spec = JobSpec::new(format!("case-{}", label.replace('/', "-")))
        .unwrap()
        .with_cancel(token.clone());
    let job = {
        let (sup, log, gate, thread_gate) = (
            sup.clone(),
            log.clone(),
            Arc::clone(&gate),
            thread_gate.clone(),
        );
        let (step, outcome) = (case.step, case.outcome);
        tokio::spawn(async move {
            sup.run(spec, move |ctx| async move {
                log.push("body-start");
                match step {
                    Step::BodyRunning => {
                        started_tx.send(()).unwrap();
                        match outcome {
                            Outcome::Ok => {
                                ctx.cancelled().await;
                                log.push("body-end");
                                return Ok(42);
                            }
                            Outcome::Error => ctx.cancelled().await,
                            Outcome::Slow => {
                                ctx.cancelled().await;
                                log.push("cancel-seen");
                                gate.notified().await;
                            }
                            Outcome::HangsUntilTimeout => std::future::pending::<()>().await,
                        }
                        log.push("body-end");
                        Err(std::io::Error::other("body gave up"))
                    }
                    Step::BlockingTaskRunning => {
                        let thread_log = log.clone();
                        ctx.spawn_blocking(move || {
                            thread_gate.wait();
                            thread_log.push("thread-end");
                            if outcome == Outcome::Error {
                                panic!("blocking task failed");
                            }
                        });
                        started_tx.send(()).unwrap();
                        ctx.cancelled().await;
                        log.push("body-end");
                        Ok(7)
                    }
                    Step::BrokerReleaseRunning | Step::WaitingForSlot => {
                        log.push("body-end");
                        Ok(1)
                    }
                }
            })
            .await
        })
    };

    // Bring the job to the step, then cancel it there.
    match case.step {
        Step::WaitingForSlot => broker.0.acquire_entered.notified().await,
        Step::BodyRunning | Step::BlockingTaskRunning => started_rx.await.unwrap(),
        Step::BrokerReleaseRunning => broker.0.release_entered.notified().await,
    }
    let held_at_cancel = broker.held();
    let job = match case.cancel {
        Cancel::Token => {
            token.cancel();
            token.cancel(); // repeated cancellation changes nothing
            Some(job)
        }
        Cancel::DropRunFuture => {
            job.abort();
            let _ = job.await;
            None
        }
    };
    if case.step != Step::WaitingForSlot {
        assert_eq!(held_at_cancel, 1, "{label}");
    }

    // Let the step finish the way the case says.
    let result: Option<JobResult> = match (case.step, case.outcome) {
        (Step::WaitingForSlot, Outcome::Ok | Outcome::Slow) => {
            // The caller hears its cancellation without waiting for the broker.
            let r = match job {
                Some(job) => Some(job.await.unwrap()),
                None => None,
            };
            // Nobody needs the broker acquire any more: the supervisor drops it (a round trip
            // makes sure it has seen the withdrawal). A grant that was already on its way when
            // it did is released; a dropped acquire takes nothing.
            sup.quarantined().await.unwrap();
            gate.notify_one();
            if case.outcome == Outcome::Ok {
                // Wait until the grant (if any) is back.
                finish(None, &broker).await;
            }
            r
        }
        (Step::WaitingForSlot, Outcome::Error) => {
            gate.notify_one();
            match job {
                Some(job) => Some(job.await.unwrap()),
                None => None,
            }
        }
        (Step::BodyRunning, Outcome::Slow) => {
            while !log.events().contains(&"cancel-seen".to_owned()) {
                tokio::task::yield_now().await;
            }
            assert_eq!(
                broker.held(),
                1,
                "{label}: slot returned before the body ended"
            );
            gate.notify_one();
            finish(job, &broker).await
        }
        (Step::BlockingTaskRunning, Outcome::Ok | Outcome::Error) => {
            thread_gate.open();
            finish(job, &broker).await
        }
        (Step::BlockingTaskRunning, Outcome::Slow) => {
            while !log.events().contains(&"body-end".to_owned()) {
                tokio::task::yield_now().await;
            }
            assert_eq!(
                broker.held(),
                1,
                "{label}: slot returned while the blocking task ran"
            );
            assert_eq!(broker.release_calls(), 0, "{label}");
            thread_gate.open();
            finish(job, &broker).await
        }
        (Step::BlockingTaskRunning, Outcome::HangsUntilTimeout) => {
            // The caller (or the sink) hears LEASE_CLEANUP_UNCONFIRMED while the thread still
            // runs; the slot stays quarantined, then is released once the thread ends.
            let r = match job {
                Some(job) => Some(job.await.unwrap()),
                None => {
                    sink_heard.notified().await;
                    None
                }
            };
            assert_eq!(broker.held(), 1, "{label}");
            assert_eq!(sup.stats().quarantined, 1, "{label}");
            assert_eq!(
                broker.release_calls(),
                0,
                "{label}: a quarantined slot was released"
            );
            let released = broker.0.released.notified();
            thread_gate.open();
            released.await;
            r
        }
        (Step::BrokerReleaseRunning, Outcome::Slow) => {
            // The caller's cancellation does not cut the release short. On this current-thread
            // runtime, one yield lets the woken job task run (it sees the cancellation and
            // tells the supervisor), and a round trip to the supervisor comes back after that.
            tokio::task::yield_now().await;
            sup.quarantined().await.unwrap();
            if let Some(job) = &job {
                assert!(
                    !job.is_finished(),
                    "{label}: run returned before its release finished"
                );
            }
            assert_eq!(broker.held(), 1, "{label}");
            gate.notify_one();
            finish(job, &broker).await
        }
        (Step::BrokerReleaseRunning, Outcome::Ok | Outcome::Error) => {
            gate.notify_one();
            finish(job, &broker).await
        }
        (Step::BodyRunning, _) | (Step::BrokerReleaseRunning, Outcome::HangsUntilTimeout) => {
            finish(job, &broker).await
        }
        (Step::WaitingForSlot, Outcome::HangsUntilTimeout) => match job {
            Some(job) => Some(job.await.unwrap()),
            None => None,
        },
    };

    // What the caller heard.
    if let Some(result) = result {
        match (case.expected_code(), result) {
            (None, Ok(_)) => {}
            (Some(code), Err(err)) => {
                assert_eq!(err.code(), code, "{label}: {err}");
                if code == "LEASE_ACQUIRE_CANCELLED" {
                    assert!(
                        !log.events().contains(&"body-start".to_owned()),
                        "{label}: body ran"
                    );
                }
            }
            (want, got) => panic!(
                "{label}: expected {want:?}, got {:?}",
                got.map_err(|e| e.code())
            ),
        }
    }

    // Physical order: blocking work ended before the release, the body before both.
    let events = log.events();
    if events.contains(&"release".to_owned()) {
        let release = log.position("release");
        if events.contains(&"thread-end".to_owned()) {
            assert!(log.position("thread-end") < release, "{label}: {events:?}");
        }
        if events.contains(&"body-start".to_owned()) && case.outcome != Outcome::HangsUntilTimeout {
            assert!(log.position("body-end") < release, "{label}: {events:?}");
        }
    }

    // Every invariant, after everything has ended.
    let report = tokio::time::timeout(Duration::from_secs(10), sup.shutdown())
        .await
        .unwrap_or_else(|_| panic!("{label}: shutdown hung"))
        .unwrap();
    broker.assert_quiescent(report.stats);
    assert_eq!(report.stats.quarantined, 0, "{label}");
    let leftovers: Vec<_> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(
        leftovers.is_empty(),
        "{label}: temp dirs left behind: {leftovers:?}"
    );
    let sunk: Vec<_> = sink.lock().iter().map(|f| f.error.code()).collect();
    match case.cancel {
        Cancel::DropRunFuture => {
            let want: Vec<_> = case.expected_sink_code().into_iter().collect();
            assert_eq!(sunk, want, "{label}: error sink");
        }
        // A caller that is still there hears everything itself.
        Cancel::Token => assert!(sunk.is_empty(), "{label}: {sunk:?}"),
    }
    match case.step {
        // A grant that raced the withdrawal is released at once; a dropped acquire took none.
        Step::WaitingForSlot => {
            assert!(report.stats.acquired_total <= 1, "{label}");
            assert_eq!(
                report.stats.acquired_total, report.stats.released_total,
                "{label}"
            );
        }
        _ => assert_eq!(report.stats.acquired_total, 1, "{label}"),
    }
}

/// Waits for the job's answer (token case) or for the broker to have seen the release (drop
/// case, where nobody can be answered).
async fn finish(
    job: Option<tokio::task::JoinHandle<JobResult>>,
    broker: &TestBroker,
) -> Option<JobResult> {
    match job {
        Some(job) => Some(job.await.unwrap()),
        None => {
            while broker.held() > 0 {
                let released = broker.0.released.notified();
                if broker.held() == 0 {
                    break;
                }
                released.await;
            }
            None
        }
    }
}

macro_rules! matrix {
    ($($name:ident: $step:ident, $outcome:ident, $cancel:ident;)*) => {$(
        // Current-thread: the order in which woken tasks run is the order they were woken in,
        // which the release case relies on (see `BrokerReleaseRunning, Slow`).
        #[tokio::test]
        async fn $name() {
            run_case(Case { step: Step::$step, outcome: Outcome::$outcome, cancel: Cancel::$cancel }).await;
        }
    )*};
}

matrix! {
    cancel_while_waiting_then_grant_arrives_by_token: WaitingForSlot, Ok, Token;
    cancel_while_waiting_then_broker_fails_by_token: WaitingForSlot, Error, Token;
    cancel_while_waiting_then_grant_arrives_late_by_token: WaitingForSlot, Slow, Token;
    cancel_while_waiting_on_a_hung_broker_by_token: WaitingForSlot, HangsUntilTimeout, Token;
    cancel_while_waiting_then_grant_arrives_by_drop: WaitingForSlot, Ok, DropRunFuture;
    cancel_while_waiting_then_broker_fails_by_drop: WaitingForSlot, Error, DropRunFuture;
    cancel_while_waiting_then_grant_arrives_late_by_drop: WaitingForSlot, Slow, DropRunFuture;
    cancel_while_waiting_on_a_hung_broker_by_drop: WaitingForSlot, HangsUntilTimeout, DropRunFuture;
    cancel_body_that_finishes_ok_by_token: BodyRunning, Ok, Token;
    cancel_body_that_fails_by_token: BodyRunning, Error, Token;
    cancel_body_that_ends_late_by_token: BodyRunning, Slow, Token;
    cancel_body_that_ignores_it_by_token: BodyRunning, HangsUntilTimeout, Token;
    cancel_body_that_finishes_ok_by_drop: BodyRunning, Ok, DropRunFuture;
    cancel_body_that_fails_by_drop: BodyRunning, Error, DropRunFuture;
    cancel_body_that_ends_late_by_drop: BodyRunning, Slow, DropRunFuture;
    cancel_body_that_ignores_it_by_drop: BodyRunning, HangsUntilTimeout, DropRunFuture;
    cancel_during_blocking_task_that_ends_ok_by_token: BlockingTaskRunning, Ok, Token;
    cancel_during_blocking_task_that_panics_by_token: BlockingTaskRunning, Error, Token;
    cancel_during_blocking_task_that_ends_late_by_token: BlockingTaskRunning, Slow, Token;
    cancel_during_blocking_task_that_outlives_the_drain_bound_by_token: BlockingTaskRunning, HangsUntilTimeout, Token;
    cancel_during_blocking_task_that_ends_ok_by_drop: BlockingTaskRunning, Ok, DropRunFuture;
    cancel_during_blocking_task_that_panics_by_drop: BlockingTaskRunning, Error, DropRunFuture;
    cancel_during_blocking_task_that_ends_late_by_drop: BlockingTaskRunning, Slow, DropRunFuture;
    cancel_during_blocking_task_that_outlives_the_drain_bound_by_drop: BlockingTaskRunning, HangsUntilTimeout, DropRunFuture;
    cancel_during_release_that_succeeds_by_token: BrokerReleaseRunning, Ok, Token;
    cancel_during_release_that_fails_by_token: BrokerReleaseRunning, Error, Token;
    cancel_during_release_that_is_slow_by_token: BrokerReleaseRunning, Slow, Token;
    cancel_during_release_that_hangs_until_the_cleanup_timeout_by_token: BrokerReleaseRunning, HangsUntilTimeout, Token;
    cancel_during_release_that_succeeds_by_drop: BrokerReleaseRunning, Ok, DropRunFuture;
    cancel_during_release_that_fails_by_drop: BrokerReleaseRunning, Error, DropRunFuture;
    cancel_during_release_that_is_slow_by_drop: BrokerReleaseRunning, Slow, DropRunFuture;
    cancel_during_release_that_hangs_until_the_cleanup_timeout_by_drop: BrokerReleaseRunning, HangsUntilTimeout, DropRunFuture;
}
