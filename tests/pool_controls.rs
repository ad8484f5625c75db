//! What users of pools and semaphores ask for, through the public API: the live lease table,
//! cancel by job id, the held-too-long warning, priorities, multi-slot leases, `try_acquire`
//! and live resize.
//!
//! No test sleeps to win a race: bodies wait on gates, and the held-too-long test runs on
//! tokio's paused clock.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{TestBroker, pool, until};
use leasehold::{JobSpec, LeaseKind, LeasePhase, Priority, Supervisor, WaitingFor, metric_names};
use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

// ---------------------------------------------------------------------------------------------
// The lease table
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_table_shows_each_lease_with_its_job_phase_and_what_its_release_waits_for() {
    let (sup, _root) = pool(2).await;
    assert!(sup.leases().is_empty());
    let lease = sup.acquire().await.unwrap();

    // A job whose body returns while a tracked task it spawned still runs: draining, waiting
    // for its tasks.
    let gate = Arc::new(Notify::new());
    let (body_done_tx, body_done_rx) = oneshot::channel();
    let job = {
        let sup = sup.clone();
        let gate = Arc::clone(&gate);
        tokio::spawn(async move {
            sup.run(
                JobSpec::new("bake-7").unwrap().with_priority(Priority::Low),
                move |ctx| async move {
                    ctx.spawn(async move { gate.notified().await });
                    let _ = body_done_tx.send(());
                    Ok::<_, std::io::Error>(())
                },
            )
            .await
        })
    };
    body_done_rx.await.unwrap();
    // Draining from the first proof of the worker's end; waiting for its tasks alone once its
    // actor's task has been joined too.
    until("the job is shown draining, waiting for its tasks", || {
        sup.leases().iter().any(|l| {
            l.phase == LeasePhase::Draining
                && l.waiting_for == [WaitingFor::Tasks, WaitingFor::TempDir]
        })
    })
    .await;
    let table = sup.leases();
    assert_eq!(table.len(), 2);
    let explicit = table
        .iter()
        .find(|l| l.kind == LeaseKind::Explicit)
        .unwrap();
    assert_eq!(explicit.job_id, None);
    assert_eq!(explicit.slot_id, lease.slot_id().unwrap());
    assert_eq!(explicit.phase, LeasePhase::Running);
    assert!(explicit.waiting_for.is_empty());
    let bake = table.iter().find(|l| l.kind == LeaseKind::Job).unwrap();
    assert_eq!(bake.job_id.as_deref(), Some("bake-7"));
    assert_eq!(bake.priority, Priority::Low);
    assert_eq!(bake.tokens.len(), 1);
    assert_eq!(bake.waiting_for, [WaitingFor::Tasks, WaitingFor::TempDir]);
    assert!(bake.child_pids.is_empty());
    assert!(
        table.windows(2).all(|w| w[0].slot_id <= w[1].slot_id),
        "by slot"
    );

    gate.notify_one();
    job.await.unwrap().unwrap();
    until("the job's row is gone", || sup.leases().len() == 1).await;
    drop(lease);
    until("the table is empty", || sup.leases().is_empty()).await;
    sup.shutdown().await.unwrap();
}

#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lease_table_names_the_child_processes_a_job_still_waits_for() {
    use leasehold::ProcessSpec;
    let (sup, _root) = pool(1).await;
    let gate = Arc::new(Notify::new());
    let (pid_tx, pid_rx) = oneshot::channel();
    let job = {
        let sup = sup.clone();
        let gate = Arc::clone(&gate);
        tokio::spawn(async move {
            sup.run(JobSpec::new("encode").unwrap(), move |ctx| async move {
                let mut child = ctx.spawn_process(ProcessSpec::new("sleep").arg("30"))?;
                let _ = pid_tx.send(child.pid());
                gate.notified().await;
                child.kill();
                child.wait().await?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(())
            })
            .await
        })
    };
    let pid = pid_rx.await.unwrap();
    until("the child shows in the table", || {
        sup.leases().first().is_some_and(|l| l.child_pids == [pid])
    })
    .await;
    let row = sup.leases().remove(0);
    assert!(row.waiting_for.contains(&WaitingFor::ProcessGroup(pid)));
    assert_eq!(row.phase, LeasePhase::Running);
    gate.notify_one();
    job.await.unwrap().unwrap();
    until("the table is empty", || sup.leases().is_empty()).await;
    sup.shutdown().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Cancel by job id
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_by_job_id_cancels_a_running_job_and_a_waiting_one_and_finds_no_other() {
    let (sup, _root) = pool(1).await;
    let (started_tx, started_rx) = oneshot::channel();
    let running = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("stale-frame").unwrap(), |ctx| async move {
                let _ = started_tx.send(());
                ctx.cancelled().await;
                // A body that stops because it was cancelled says so with an error.
                Err::<(), _>(std::io::Error::other("stopped: cancelled"))
            })
            .await
        })
    };
    started_rx.await.unwrap();
    let waiting = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("queued-frame").unwrap(), |_ctx| async {
                Ok::<_, std::io::Error>(())
            })
            .await
        })
    };
    until("the second job waits", || sup.stats().waiting == 1).await;

    assert!(!sup.cancel("no-such-job").await.unwrap());
    assert!(sup.cancel("queued-frame").await.unwrap());
    let err = waiting.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_ACQUIRE_CANCELLED");

    assert!(sup.cancel("stale-frame").await.unwrap());
    let err = running.await.unwrap().unwrap_err();
    assert_eq!(err.code(), "LEASE_BODY_CANCELLED");
    // Through the whole pipeline: the slot is back, and the job cannot be found again.
    assert_eq!(sup.stats().active, 0);
    assert!(!sup.cancel("stale-frame").await.unwrap());
    sup.shutdown().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Held too long
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<BTreeMap<String, String>>>>);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: Subscriber> Layer<S> for Warnings {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        if fields.get("message").map(String::as_str) == Some("a lease has been held too long") {
            self.0.lock().push(fields);
        }
    }
}

#[test]
fn a_lease_held_past_the_threshold_warns_once_naming_the_job_and_what_it_waits_for() {
    let warnings = Warnings::default();
    let _guard =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(warnings.clone()));
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let root = tempfile::tempdir().unwrap();
            let sup = Supervisor::builder()
                .slots(2)
                .work_root(root.path())
                .held_warning(Duration::from_secs(60))
                .start()
                .await
                .unwrap();
            let gate = Arc::new(Notify::new());
            let job = {
                let sup = sup.clone();
                let gate = Arc::clone(&gate);
                tokio::spawn(async move {
                    sup.run(
                        JobSpec::new("lightmap-bake").unwrap(),
                        move |_ctx| async move {
                            gate.notified().await;
                            Ok::<_, std::io::Error>(())
                        },
                    )
                    .await
                })
            };
            // A short job does not warn.
            sup.run(JobSpec::new("quick").unwrap(), |_ctx| async {
                Ok::<_, std::io::Error>(())
            })
            .await
            .unwrap();
            tokio::time::sleep(Duration::from_secs(59)).await;
            assert!(warnings.0.lock().is_empty(), "warned before the threshold");
            tokio::time::sleep(Duration::from_secs(20)).await;
            assert_eq!(warnings.0.lock().len(), 1);
            // Held much longer: still one warning.
            tokio::time::sleep(Duration::from_secs(600)).await;
            assert_eq!(warnings.0.lock().len(), 1);
            let row = sup.leases().remove(0);
            assert!(row.held_for >= Duration::from_secs(600));
            gate.notify_one();
            job.await.unwrap().unwrap();
            sup.shutdown().await.unwrap();
        });
    });
    let warning = warnings.0.lock().remove(0);
    assert_eq!(warning["job_id"], "lightmap-bake");
    // The body still runs: its worker, then its tasks and its temp dir, are still owed.
    assert_eq!(
        warning["waiting_for"],
        "the worker, tracked tasks, the temp dir"
    );
    let held_ms: u64 = warning["held_ms"].parse().unwrap();
    assert!((60_000..=75_000).contains(&held_ms), "{held_ms}");
    let counted = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .find(|(key, ..)| key.key().name() == metric_names::HELD_TOO_LONG_COUNT)
        .map(|(.., value)| value);
    assert_eq!(
        counted,
        Some(metrics_util::debugging::DebugValue::Counter(1)),
        "counted once"
    );
}

// ---------------------------------------------------------------------------------------------
// Priorities
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_high_priority_job_is_served_before_normal_and_low_ones_queued_earlier() {
    let (sup, _root) = pool(1).await;
    let holder = sup.acquire().await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut jobs = Vec::new();
    for (id, priority) in [
        ("low", Priority::Low),
        ("normal", Priority::Normal),
        ("high", Priority::High),
    ] {
        let sup2 = sup.clone();
        let order = Arc::clone(&order);
        let waiting = sup.stats().waiting;
        jobs.push(tokio::spawn(async move {
            sup2.run(
                JobSpec::new(id).unwrap().with_priority(priority),
                move |_ctx| async move {
                    order.lock().push(id);
                    Ok::<_, std::io::Error>(())
                },
            )
            .await
        }));
        // Queued in this order.
        until("queued", || sup.stats().waiting == waiting + 1).await;
    }
    drop(holder);
    for job in jobs {
        job.await.unwrap().unwrap();
    }
    assert_eq!(*order.lock(), ["high", "normal", "low"]);
    sup.shutdown().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// Multi-slot leases
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_slot_job_holds_all_its_slots_at_once_and_gives_them_all_back() {
    let (sup, _root) = pool(3).await;
    let tokens = sup
        .run(
            JobSpec::new("global-illumination").unwrap().with_slots(3),
            |ctx| async move { Ok::<_, std::io::Error>(ctx.tokens()) },
        )
        .await
        .unwrap();
    let mut slots: Vec<u32> = tokens.iter().map(|t| t.slot_id()).collect();
    slots.sort_unstable();
    assert_eq!(slots, [0, 1, 2]);
    let stats = sup.stats();
    assert_eq!((stats.active, stats.held_slots), (0, 0));
    assert_eq!(stats.acquired_total, stats.released_total);
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquire_many_waits_for_all_its_slots_while_later_callers_wait_behind_it() {
    let (sup, _root) = pool(2).await;
    let first = sup.acquire().await.unwrap();
    let many = {
        let sup = sup.clone();
        tokio::spawn(async move { sup.acquire_many(2).await })
    };
    until("the two-slot request gathers the free slot", || {
        sup.stats().held_slots == 2
    })
    .await;
    // Head-of-line blocking: a single-slot caller behind it gets nothing, not even a try.
    assert_eq!(
        sup.try_acquire().await.unwrap_err().code(),
        "LEASE_NO_SLOT_FREE"
    );
    let later = {
        let sup = sup.clone();
        tokio::spawn(async move { sup.acquire().await })
    };
    until("the later caller waits", || sup.stats().waiting == 2).await;
    drop(first);
    let mut lease = many.await.unwrap().unwrap();
    assert_eq!(lease.tokens().unwrap().len(), 2);
    assert_eq!(sup.leases()[0].tokens.len(), 2);
    lease.release().await.unwrap();
    let last = later.await.unwrap().unwrap();
    drop(last);
    sup.shutdown().await.unwrap();
}

#[tokio::test]
async fn zero_slots_or_more_than_the_capacity_are_refused_and_nothing_leaks() {
    let (sup, _root) = pool(2).await;
    assert_eq!(
        sup.acquire_many(3).await.unwrap_err().code(),
        "LEASE_SLOT_COUNT_INVALID"
    );
    assert_eq!(
        sup.acquire_many(0).await.unwrap_err().code(),
        "LEASE_SLOT_COUNT_INVALID"
    );
    let err = sup
        .run(JobSpec::new("huge").unwrap().with_slots(9), |_ctx| async {
            Ok::<_, std::io::Error>(())
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_SLOT_COUNT_INVALID");
    let stats = sup.stats();
    assert_eq!(
        (stats.acquired_total, stats.held_slots, stats.waiting),
        (0, 0, 0)
    );
    sup.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_broker_that_is_not_the_pool_refuses_multi_slot_try_and_resize_with_a_typed_error() {
    let broker = TestBroker::new(4);
    let root = tempfile::tempdir().unwrap();
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .work_root(root.path())
        .start()
        .await
        .unwrap();
    assert_eq!(
        sup.acquire_many(2).await.unwrap_err().code(),
        "LEASE_BROKER_UNSUPPORTED"
    );
    assert_eq!(
        sup.try_acquire().await.unwrap_err().code(),
        "LEASE_BROKER_UNSUPPORTED"
    );
    assert!(!sup.can_resize(), "said before anyone tries");
    assert_eq!(
        sup.resize(8).await.unwrap_err().code(),
        "LEASE_BROKER_UNSUPPORTED"
    );
    assert_eq!(broker.acquire_calls(), 0, "nothing was asked of the broker");
    // A single-slot acquire still works.
    drop(sup.acquire().await.unwrap());
    sup.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_local_broker_given_to_the_builder_is_still_the_supervisors_own_pool() {
    let root = tempfile::tempdir().unwrap();
    let sup = Supervisor::builder()
        .broker(leasehold::LocalBroker::new(2))
        .work_root(root.path())
        .start()
        .await
        .unwrap();
    assert!(sup.can_resize());
    let mut lease = sup.acquire_many(2).await.unwrap();
    assert_eq!(lease.slot_count(), 2);
    lease.release().await.unwrap();
    sup.shutdown().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// try_acquire
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_acquire_takes_a_free_slot_and_refuses_when_all_are_held_or_callers_wait() {
    let (sup, _root) = pool(2).await;
    let a = sup.try_acquire().await.unwrap();
    let b = sup.try_acquire().await.unwrap();
    assert_ne!(a.slot_id().unwrap(), b.slot_id().unwrap());
    let err = sup.try_acquire().await.unwrap_err();
    assert_eq!(err.code(), "LEASE_NO_SLOT_FREE");
    assert_eq!(
        sup.stats().waiting,
        0,
        "a refused try leaves nothing queued"
    );
    drop(a);
    until("a slot is free", || sup.stats().active == 1).await;
    let c = sup.try_acquire().await.unwrap();
    drop((b, c));
    sup.shutdown().await.unwrap();
    assert_eq!(
        sup.try_acquire().await.unwrap_err().code(),
        "SUPERVISOR_STOPPED"
    );
}

// ---------------------------------------------------------------------------------------------
// Live resize
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raising_the_capacity_wakes_waiters_at_once_and_lowering_it_revokes_nothing() {
    let (sup, _root) = pool(1).await;
    assert_eq!(sup.stats().capacity, Some(1));
    let first = sup.acquire().await.unwrap();
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let sup = sup.clone();
            tokio::spawn(async move { sup.acquire().await })
        })
        .collect();
    until("two callers wait", || sup.stats().waiting == 2).await;
    assert_eq!(sup.resize(3).await.unwrap(), 3);
    let mut held = vec![first];
    for w in waiters {
        held.push(w.await.unwrap().unwrap());
    }
    assert_eq!(sup.stats().capacity, Some(3));

    // Lowered to 1 with 3 held: nobody loses a slot; a new caller waits until all three have
    // returned (then one slot is held of one).
    assert_eq!(sup.resize(1).await.unwrap(), 1);
    assert!(held.iter().all(|l| l.slot_id().is_ok() && !l.is_lost()));
    assert_eq!(sup.stats().held_slots, 3);
    let next = {
        let sup = sup.clone();
        tokio::spawn(async move { sup.acquire().await })
    };
    until("the new caller waits", || sup.stats().waiting == 1).await;
    for left in [2, 1] {
        held.pop();
        until("a slot returned", || sup.stats().held_slots == left).await;
        assert_eq!(sup.stats().waiting, 1, "still at or above the new capacity");
    }
    held.pop();
    let last = next.await.unwrap().unwrap();
    // Slots 1 and 2 were retired as they came back: the grant is slot 0.
    assert_eq!(last.slot_id().unwrap(), 0);
    assert_eq!(sup.stats().held_slots, 1);
    drop(last);
    assert_eq!(
        sup.resize(0).await.unwrap_err().code(),
        "LEASE_SLOT_COUNT_INVALID"
    );
    sup.shutdown().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// The waiting callers
// ---------------------------------------------------------------------------------------------

/// `waiters()` lists the callers in the order they are served: by class under the aging rule,
/// FIFO within one; each with its job id (none for an explicit acquire), class, slots and how
/// long it has waited. Once it answers, the list includes every caller queued before the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_waiting_callers_are_listed_in_the_order_they_are_served() {
    let (sup, _root) = pool(1).await;
    assert!(sup.waiters().await.unwrap().is_empty());
    let held = sup.acquire().await.unwrap();
    let mut jobs = Vec::new();
    for (id, priority) in [
        ("low-a", Priority::Low),
        ("normal-b", Priority::Normal),
        ("high-c", Priority::High),
    ] {
        let caller = sup.clone();
        jobs.push(tokio::spawn(async move {
            caller
                .run(
                    JobSpec::new(id).unwrap().with_priority(priority),
                    |_ctx| async { Ok::<_, std::io::Error>(()) },
                )
                .await
        }));
        // One at a time, so that their arrival order is known.
        let n = jobs.len();
        until("the job waits", || sup.stats().waiting == n).await;
    }
    let explicit = {
        let sup = sup.clone();
        tokio::spawn(async move { sup.acquire().await })
    };
    until("four callers wait", || sup.stats().waiting == 4).await;
    let listed = sup.waiters().await.unwrap();
    let order: Vec<(Option<&str>, Priority)> = listed
        .iter()
        .map(|w| (w.job_id.as_deref(), w.priority))
        .collect();
    assert_eq!(
        order,
        [
            (Some("high-c"), Priority::High),
            (Some("normal-b"), Priority::Normal),
            (None, Priority::Normal),
            (Some("low-a"), Priority::Low),
        ]
    );
    assert!(listed.iter().all(|w| w.slots == 1 && w.gathered == 0));
    drop(held);
    // The explicit acquire is served third; the lease it returns is given back at once, so
    // that the last job gets the slot.
    drop(explicit.await.unwrap().unwrap());
    for job in jobs {
        job.await.unwrap().unwrap();
    }
    until("nobody waits", || sup.stats().waiting == 0).await;
    assert!(sup.waiters().await.unwrap().is_empty());
    sup.shutdown().await.unwrap();
}
