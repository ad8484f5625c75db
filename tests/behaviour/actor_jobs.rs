//! Job actors and the lease desk, through the public API: an engine's own ractor actors hold
//! slots for exactly their lifetime.
//!
//! No test sleeps to win a race. Where a test shows that something does *not* happen while a
//! gate is closed (a slot not handed on while a state is still being dropped), it waits for it
//! under a bound: a correct supervisor passes however slow the machine, and a wrong one fails.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::{EventLog, Plan, TestBroker, ThreadGate, until};
use leasehold::ractor::{Actor, ActorProcessingErr, ActorRef, call};
use leasehold::{
    ActorExit, ActorJobError, ActorLease, BodyErrorKind, JobSpec, LeaseMsg, Supervisor,
    WorkerContext, codes,
};
use tokio::sync::{Notify, oneshot};

/// A supervisor on a broker that logs each release into `log`.
async fn logged_pool(slots: u32, log: &EventLog) -> (Supervisor, TestBroker) {
    let broker = TestBroker::new(slots);
    let l = log.clone();
    broker.on_release(move |lease_id| {
        l.push(format!("release {lease_id}"));
        Plan::Ok
    });
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .start()
        .await
        .unwrap();
    (sup, broker)
}

/// Part of a state whose drop blocks (on a thread gate) until the test opens it.
struct SlowDrop {
    log: EventLog,
    entered: Option<oneshot::Sender<()>>,
    gate: ThreadGate,
}

impl Drop for SlowDrop {
    fn drop(&mut self) {
        self.log.push("drop begins");
        if let Some(entered) = self.entered.take() {
            let _ = entered.send(());
        }
        // Off the worker's core: tasks woken meanwhile (queued on this thread) keep running
        // elsewhere, so a supervisor that did not wait for this drop would show it.
        tokio::task::block_in_place(|| self.gate.wait());
        self.log.push("state dropped");
    }
}

/// Opens a gate when dropped, so that a failing assertion does not leave a drop blocked (and
/// the runtime's shutdown waiting for it).
struct OpenOnDrop(ThreadGate);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// A waiter for the slot that must not be served while `gate` is closed.
async fn not_served_while_closed(sup: &Supervisor) -> tokio::task::JoinHandle<leasehold::Lease> {
    let waiter = {
        let sup = sup.clone();
        tokio::spawn(async move { sup.acquire().await.unwrap() })
    };
    until("the waiter queued", || sup.stats().waiting == 1).await;
    waiter
}

// ---------------------------------------------------------------------------------------------
// Job actors
// ---------------------------------------------------------------------------------------------

/// Panics on its first message; its state drops slowly.
struct Panicker;

impl Actor for Panicker {
    type Msg = ();
    type State = (WorkerContext, SlowDrop);
    type Arguments = (WorkerContext, SlowDrop);

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        _myself: ActorRef<()>,
        _msg: (),
        _state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        panic!("boom in a handler")
    }
}

/// DESIGN section 2: `ActorFailed` can reach a supervisor before the actor's state is dropped.
/// The state's drop is held on a gate here: the slot must stay held until it has finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn an_actor_that_panics_cannot_have_its_slot_released_before_its_state_is_dropped() {
    let log = EventLog::default();
    let (sup, broker) = logged_pool(1, &log).await;
    let gate = ThreadGate::default();
    let _open = OpenOnDrop(gate.clone());
    let (entered_tx, entered_rx) = oneshot::channel();
    let slow = SlowDrop {
        log: log.clone(),
        entered: Some(entered_tx),
        gate: gate.clone(),
    };
    let (actor, outcome) = sup
        .spawn_job(JobSpec::new("panicker").unwrap(), Panicker, move |ctx| {
            (ctx, slow)
        })
        .await
        .unwrap();
    let waiter = not_served_while_closed(&sup).await;
    actor.cast(()).unwrap();
    entered_rx.await.unwrap();
    let mut waiter = waiter;
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut waiter)
            .await
            .is_err(),
        "the slot was handed on while the panicked actor's state was still being dropped"
    );
    assert_eq!(broker.release_calls(), 0);
    assert_eq!(sup.stats().active, 1);
    gate.open();
    let err = outcome.join().await.unwrap_err();
    assert_eq!(err.code(), codes::LEASE_BODY_PANICKED);
    let body = err.body_error().unwrap();
    assert!(body.panics()[0].contains("boom in a handler"), "{body:?}");
    assert!(matches!(body.error(), Some(ActorJobError::Failed(_))));
    let mut next = waiter.await.unwrap();
    assert!(log.position("state dropped") < log.position(&format!("release {}", 1)));
    next.release().await.unwrap();
    sup.shutdown().await.unwrap();
    broker.assert_quiescent(sup.stats());
}

/// Stops itself on its first message (its state goes into the `ActorTerminated` event).
struct Polite {
    log: EventLog,
}

impl Actor for Polite {
    type Msg = ();
    type State = (WorkerContext, Option<SlowDrop>);
    type Arguments = (WorkerContext, Option<SlowDrop>);

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        args: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        self.log.push(format!("{} started", args.0.job_id()));
        Ok(args)
    }

    async fn handle(
        &self,
        myself: ActorRef<()>,
        _msg: (),
        _state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        myself.stop(Some("done".into()));
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<()>,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        self.log.push(format!("{} post_stop", state.0.job_id()));
        Ok(())
    }
}

/// On a normal stop ractor moves the state into the supervision event: the slot waits until
/// that state has been dropped too.
#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn an_actor_that_stops_returns_its_slot_only_after_the_state_it_left_in_its_event_is_dropped()
{
    let log = EventLog::default();
    let (sup, broker) = logged_pool(1, &log).await;
    let gate = ThreadGate::default();
    let _open = OpenOnDrop(gate.clone());
    let (entered_tx, entered_rx) = oneshot::channel();
    let slow = SlowDrop {
        log: log.clone(),
        entered: Some(entered_tx),
        gate: gate.clone(),
    };
    let polite = Polite { log: log.clone() };
    let (actor, outcome) = sup
        .spawn_job(JobSpec::new("polite").unwrap(), polite, move |ctx| {
            (ctx, Some(slow))
        })
        .await
        .unwrap();
    let mut waiter = not_served_while_closed(&sup).await;
    actor.cast(()).unwrap();
    entered_rx.await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut waiter)
            .await
            .is_err(),
        "the slot was handed on while the stopped actor's state was still being dropped"
    );
    assert_eq!(broker.release_calls(), 0);
    gate.open();
    let exit: ActorExit = outcome.join().await.unwrap();
    assert_eq!(exit.reason(), Some("done"));
    let mut next = waiter.await.unwrap();
    assert!(log.position("polite post_stop") < log.position("state dropped"));
    assert!(log.position("state dropped") < log.position("release 1"));
    next.release().await.unwrap();
    sup.shutdown().await.unwrap();
    broker.assert_quiescent(sup.stats());
}

/// Spawns a tracked task through its context that outlives it.
struct Spawner {
    gate: Arc<Notify>,
}

impl Actor for Spawner {
    type Msg = ();
    type State = WorkerContext;
    type Arguments = WorkerContext;

    async fn pre_start(
        &self,
        myself: ActorRef<()>,
        ctx: WorkerContext,
    ) -> Result<WorkerContext, ActorProcessingErr> {
        std::fs::write(ctx.temp_dir().join("part"), b"x")?;
        let gate = Arc::clone(&self.gate);
        drop(ctx.spawn(async move { gate.notified().await }));
        myself.stop(None);
        Ok(ctx)
    }
}

/// A job actor's context is a job's context: what it spawned through it holds the slot and
/// the temp dir after the actor has gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_actors_tracked_tasks_hold_its_slot_and_temp_dir_after_it_has_stopped() {
    let log = EventLog::default();
    let (sup, broker) = logged_pool(1, &log).await;
    let gate = Arc::new(Notify::new());
    let spawner = Spawner {
        gate: Arc::clone(&gate),
    };
    let (_actor, outcome) = sup
        .spawn_job(JobSpec::new("spawner").unwrap(), spawner, |ctx| ctx)
        .await
        .unwrap();
    until("the actor ended and the job drains", || {
        sup.stats().draining == 1
    })
    .await;
    assert_eq!(sup.leases()[0].job_id.as_deref(), Some("spawner"));
    assert_eq!(broker.release_calls(), 0);
    assert_eq!(sup.stats().active, 1);
    let temp_dirs = std::fs::read_dir(sup.work_root()).unwrap().count();
    assert_eq!(
        temp_dirs, 1,
        "the temp dir is kept while a tracked task runs"
    );
    gate.notify_one();
    let exit = outcome.join().await.unwrap();
    assert_eq!(exit.reason(), None);
    assert_eq!(std::fs::read_dir(sup.work_root()).unwrap().count(), 0);
    sup.shutdown().await.unwrap();
    broker.assert_quiescent(sup.stats());
}

/// What an actor can do wrong, on cue.
#[derive(Clone, Copy)]
enum Fault {
    StartError,
    StartPanic,
    HandlerError,
    None,
}

struct Faulty(Fault);

impl Actor for Faulty {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _myself: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> {
        match self.0 {
            Fault::StartError => Err("no mesh".into()),
            Fault::StartPanic => panic!("pre_start blew up"),
            _ => Ok(()),
        }
    }

    async fn handle(
        &self,
        _myself: ActorRef<()>,
        _msg: (),
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        match self.0 {
            Fault::HandlerError => Err("corrupt texture".into()),
            _ => Ok(()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_jobs_outcome_maps_to_the_stable_codes() {
    let (sup, broker) = logged_pool(2, &EventLog::default()).await;

    // pre_start fails or panics: no actor, and the error comes after the pipeline.
    let err = sup
        .spawn_job(
            JobSpec::new("start-error").unwrap(),
            Faulty(Fault::StartError),
            |_| (),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), codes::LEASE_BODY_FAILED);
    let started = err.body_error().unwrap().error().unwrap();
    assert!(
        matches!(started, ActorJobError::StartFailed(why) if why.contains("no mesh")),
        "{started:?}"
    );
    let err = sup
        .spawn_job(
            JobSpec::new("start-panic").unwrap(),
            Faulty(Fault::StartPanic),
            |_| (),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), codes::LEASE_BODY_PANICKED);
    assert!(err.body_error().unwrap().panics()[0].contains("pre_start blew up"));

    // A handler returns an error.
    let (actor, outcome) = sup
        .spawn_job(
            JobSpec::new("handler-error").unwrap(),
            Faulty(Fault::HandlerError),
            |_| (),
        )
        .await
        .unwrap();
    actor.cast(()).unwrap();
    let err = outcome.join().await.unwrap_err();
    assert_eq!(err.code(), codes::LEASE_BODY_FAILED);
    assert_eq!(err.body_error().unwrap().kind(), BodyErrorKind::Failed);
    assert!(
        matches!(err.body_error().unwrap().error(), Some(ActorJobError::Failed(why)) if why.contains("corrupt texture"))
    );

    // Cancelled by job id: stopped (it stops at once), `LEASE_BODY_CANCELLED`.
    let (_actor, outcome) = sup
        .spawn_job(
            JobSpec::new("cancel-me").unwrap(),
            Faulty(Fault::None),
            |_| (),
        )
        .await
        .unwrap();
    assert!(sup.cancel("cancel-me").await.unwrap());
    let err = outcome.join().await.unwrap_err();
    assert_eq!(err.code(), codes::LEASE_BODY_CANCELLED);
    assert_eq!(
        err.body_error().unwrap().error(),
        Some(&ActorJobError::Cancelled { killed: false })
    );

    // Killed by someone else: its post_stop never ran, and that is no success.
    let (actor, outcome) = sup
        .spawn_job(JobSpec::new("killed").unwrap(), Faulty(Fault::None), |_| ())
        .await
        .unwrap();
    actor.kill();
    let err = outcome.join().await.unwrap_err();
    assert_eq!(err.code(), codes::LEASE_BODY_FAILED);
    assert!(matches!(
        err.body_error().unwrap().error(),
        Some(ActorJobError::Killed(_))
    ));

    sup.shutdown().await.unwrap();
    broker.assert_quiescent(sup.stats());
    assert_eq!(broker.acquire_calls(), broker.release_calls());
}

/// Stops itself as soon as it has started, logging its start.
struct Quick {
    log: EventLog,
}

impl Actor for Quick {
    type Msg = ();
    type State = ();
    type Arguments = String;

    async fn pre_start(&self, myself: ActorRef<()>, id: String) -> Result<(), ActorProcessingErr> {
        self.log.push(format!("{id} started"));
        myself.stop(None);
        Ok(())
    }
}

/// `spawn_job` awaits its actor's start, not its handle: the acquire timeout must still end
/// the wait (and take the job out of the queue) when no slot comes in time.
#[tokio::test(start_paused = true)]
async fn spawn_job_ends_with_lease_acquire_timeout_when_no_slot_comes_in_time() {
    let log = EventLog::default();
    let timeout = Duration::from_secs(2);
    let (broker, sup, mut holder) = common::one_slot_held_under_acquire_timeout(timeout).await;
    let t0 = tokio::time::Instant::now();
    let spawned = tokio::time::timeout(
        timeout * 10,
        sup.spawn_job(
            JobSpec::new("late").unwrap(),
            Quick { log: log.clone() },
            |_ctx| "late".to_owned(),
        ),
    )
    .await
    .expect("spawn_job ends at its acquire timeout");
    let err = spawned.unwrap_err();
    assert_eq!(err.code(), codes::LEASE_ACQUIRE_TIMEOUT, "{err:?}");
    let waited = t0.elapsed();
    assert!(
        waited >= timeout && waited < timeout * 2,
        "waited {waited:?}"
    );
    assert_eq!(sup.stats().waiting, 0, "the job left the queue");
    // The slot freed now goes to the next caller, never to the job that timed out.
    holder.release().await.unwrap();
    let mut next = sup.acquire().await.unwrap();
    next.release().await.unwrap();
    assert!(
        log.events().is_empty(),
        "the actor never started: {:?}",
        log.events()
    );
    broker.assert_quiescent(sup.stats());
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actor_jobs_and_closure_jobs_share_one_fifo_queue() {
    let log = EventLog::default();
    let (sup, broker) = logged_pool(1, &log).await;
    let gate = Arc::new(Notify::new());
    let holder = {
        let gate = Arc::clone(&gate);
        sup.submit(JobSpec::new("holder").unwrap(), move |_ctx| async move {
            gate.notified().await;
            Ok::<_, std::io::Error>(())
        })
    };
    until("the holder runs", || sup.stats().active == 1).await;
    let mut waiting = Vec::new();
    for (i, id) in ["actor-a", "closure-b", "actor-c", "closure-d"]
        .into_iter()
        .enumerate()
    {
        let (sup2, log2) = (sup.clone(), log.clone());
        waiting.push(tokio::spawn(async move {
            if id.starts_with("actor") {
                let quick = Quick { log: log2 };
                let (_actor, outcome) = sup2
                    .spawn_job(JobSpec::new(id).unwrap(), quick, move |_| id.to_owned())
                    .await
                    .unwrap();
                outcome.join().await.map(|_| ()).map_err(|e| e.code())
            } else {
                sup2.run(JobSpec::new(id).unwrap(), move |_ctx| async move {
                    log2.push(format!("{id} started"));
                    Ok::<_, std::io::Error>(())
                })
                .await
                .map_err(|e| e.code())
            }
        }));
        until("the job queued", || sup.stats().waiting == i + 1).await;
    }
    gate.notify_one();
    holder.join().await.unwrap();
    for job in waiting {
        job.await.unwrap().unwrap();
    }
    let started: Vec<_> = log
        .events()
        .into_iter()
        .filter(|e| e.ends_with("started"))
        .collect();
    assert_eq!(
        started,
        [
            "actor-a started",
            "closure-b started",
            "actor-c started",
            "closure-d started"
        ]
    );
    sup.shutdown().await.unwrap();
    broker.assert_quiescent(sup.stats());
}

/// Its first handler waits for the gate (one that never opens: a stop cannot reach it, only a
/// kill), then it stops.
struct Gated {
    log: EventLog,
    gate: Arc<Notify>,
}

impl Actor for Gated {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _myself: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        myself: ActorRef<()>,
        (): (),
        (): &mut (),
    ) -> Result<(), ActorProcessingErr> {
        self.log.push("gated handler entered");
        self.gate.notified().await;
        myself.stop(None);
        Ok(())
    }

    async fn post_stop(&self, _myself: ActorRef<()>, _: &mut ()) -> Result<(), ActorProcessingErr> {
        self.log.push("gated post_stop");
        Ok(())
    }
}

/// Shutdown stops every job actor, and kills the one still running a cancel grace later; both
/// slots go back and shutdown returns (on tokio's paused clock, the grace passes by itself).
#[tokio::test(start_paused = true)]
async fn shutdown_stops_job_actors_and_kills_those_still_running_after_the_grace() {
    let log = EventLog::default();
    let broker = TestBroker::new(2);
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .cancel_grace(Duration::from_secs(3))
        .start()
        .await
        .unwrap();
    let polite = Polite { log: log.clone() };
    let (_polite, polite_outcome) = sup
        .spawn_job(JobSpec::new("polite").unwrap(), polite, |ctx| (ctx, None))
        .await
        .unwrap();
    let stuck = Gated {
        log: log.clone(),
        gate: Arc::new(Notify::new()),
    };
    let (stuck_ref, stuck_outcome) = sup
        .spawn_job(JobSpec::new("stuck").unwrap(), stuck, |_| ())
        .await
        .unwrap();
    stuck_ref.cast(()).unwrap();
    until("the stuck handler runs", || {
        log.events().contains(&"gated handler entered".to_owned())
    })
    .await;
    let t0 = tokio::time::Instant::now();
    let report = sup.shutdown().await.unwrap();
    assert!(
        t0.elapsed() >= Duration::from_secs(3),
        "killed before the grace"
    );
    assert_eq!(report.cancelled_jobs, 2);
    assert_eq!(report.quarantined, 0);
    let err = polite_outcome.join().await.unwrap_err();
    assert_eq!(err.code(), codes::LEASE_BODY_CANCELLED);
    assert_eq!(
        err.body_error().unwrap().error(),
        Some(&ActorJobError::Cancelled { killed: false })
    );
    let err = stuck_outcome.join().await.unwrap_err();
    assert_eq!(err.code(), codes::LEASE_BODY_CANCELLED);
    assert_eq!(
        err.body_error().unwrap().error(),
        Some(&ActorJobError::Cancelled { killed: true })
    );
    assert!(log.events().contains(&"polite post_stop".to_owned()));
    assert!(!log.events().contains(&"gated post_stop".to_owned()));
    broker.assert_quiescent(sup.stats());
}

/// Dropping the `spawn_job` future while it waits for a slot withdraws it: nothing leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_waiting_spawn_job_withdraws_it() {
    let (sup, broker) = logged_pool(1, &EventLog::default()).await;
    let mut lease = sup.acquire().await.unwrap();
    let quick = Quick {
        log: EventLog::default(),
    };
    let spawn = sup.spawn_job(JobSpec::new("late").unwrap(), quick, |_| "late".to_owned());
    assert!(
        tokio::time::timeout(Duration::from_millis(50), spawn)
            .await
            .is_err()
    );
    until("the waiter withdrew", || sup.stats().waiting == 0).await;
    lease.release().await.unwrap();
    sup.shutdown().await.unwrap();
    broker.assert_quiescent(sup.stats());
    assert_eq!(broker.acquire_calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleanup_failure_of_an_actor_job_reaches_its_handle_or_once_detached_the_error_sink() {
    let (sup, mut failures) = common::supervisor_whose_releases_fail().await;
    let quick = Quick {
        log: EventLog::default(),
    };
    let (_actor, outcome) = sup
        .spawn_job(JobSpec::new("q").unwrap(), quick, |_| "q".to_owned())
        .await
        .unwrap();
    let err = outcome.join().await.unwrap_err();
    assert_eq!(err.code(), codes::LEASE_CLEANUP_FAILED);
    assert!(
        failures.try_recv().is_err(),
        "the handle heard it: not the sink"
    );

    // Nobody waits for this one: its failure reaches the sink, once.
    let gate = Arc::new(Notify::new());
    let waiter = Gated {
        log: EventLog::default(),
        gate: Arc::clone(&gate),
    };
    let (actor, outcome) = sup
        .spawn_job(JobSpec::new("detached").unwrap(), waiter, |_| ())
        .await
        .unwrap();
    outcome.detach();
    actor.cast(()).unwrap();
    gate.notify_one();
    let failure = tokio::time::timeout(Duration::from_secs(20), failures.recv())
        .await
        .expect("the failure never reached the sink")
        .unwrap();
    assert_eq!(failure.job_id.as_deref(), Some("detached"));
    assert_eq!(failure.error.code(), codes::LEASE_CLEANUP_FAILED);
    sup.shutdown().await.unwrap();
    assert!(failures.try_recv().is_err(), "reported once");
}

// ---------------------------------------------------------------------------------------------
// The lease desk
// ---------------------------------------------------------------------------------------------

/// Asks the desk for a slot in `pre_start` and keeps the `ActorLease` in its state; panics or
/// stops on its first message, as told.
struct Requester {
    desk: ActorRef<LeaseMsg>,
    panic: bool,
}

impl Actor for Requester {
    type Msg = ();
    /// The slow part drops first (tuple fields drop in order), the lease last.
    type State = (SlowDrop, ActorLease);
    type Arguments = SlowDrop;

    async fn pre_start(
        &self,
        myself: ActorRef<()>,
        slow: SlowDrop,
    ) -> Result<Self::State, ActorProcessingErr> {
        let lease = call!(self.desk, LeaseMsg::Acquire, myself.get_cell())??;
        slow.log.push(format!("holds {}", lease.lease_id()));
        Ok((slow, lease))
    }

    async fn handle(
        &self,
        myself: ActorRef<()>,
        _msg: (),
        _state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        if self.panic {
            panic!("requester died");
        }
        myself.stop(None);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 3)]
async fn a_requester_that_dies_returns_its_lease_only_after_its_exit() {
    for panic in [true, false] {
        let log = EventLog::default();
        let (sup, broker) = logged_pool(1, &log).await;
        let desk = sup.lease_desk().await.unwrap();
        let gate = ThreadGate::default();
        let _open = OpenOnDrop(gate.clone());
        let (entered_tx, entered_rx) = oneshot::channel();
        let slow = SlowDrop {
            log: log.clone(),
            entered: Some(entered_tx),
            gate: gate.clone(),
        };
        let requester = Requester {
            desk: desk.clone(),
            panic,
        };
        let (actor, join) = Actor::spawn(None, requester, slow).await.unwrap();
        assert_eq!(sup.stats().active, 1);
        let mut waiter = not_served_while_closed(&sup).await;
        actor.cast(()).unwrap();
        entered_rx.await.unwrap();
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut waiter)
                .await
                .is_err(),
            "the lease went back before the requester's state was dropped (panic: {panic})"
        );
        assert_eq!(broker.release_calls(), 0);
        gate.open();
        join.await.unwrap();
        let mut next = waiter.await.unwrap();
        assert!(log.position("state dropped") < log.position("release 1"));
        next.release().await.unwrap();
        sup.shutdown().await.unwrap();
        broker.assert_quiescent(sup.stats());
    }
}

/// An actor that does nothing: a holder for leases asked for from the test.
struct Idle;

impl Actor for Idle {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _myself: ActorRef<()>, _: ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_asked_for_by_message_is_released_by_message_once_and_only_by_its_holder() {
    let (sup, broker) = logged_pool(1, &EventLog::default()).await;
    let desk = sup.lease_desk().await.unwrap();
    let (holder, holder_join) = Actor::spawn(None, Idle, ()).await.unwrap();
    let (other, other_join) = Actor::spawn(None, Idle, ()).await.unwrap();
    let lease: ActorLease = call!(desk, LeaseMsg::Acquire, holder.get_cell())
        .unwrap()
        .unwrap();
    assert_eq!(lease.holder(), holder.get_id());
    let id = lease.lease_id();

    // Another actor's release, or a lease id nobody holds: refused, nothing released.
    let refused = call!(desk, LeaseMsg::Release, other.get_cell(), id)
        .unwrap()
        .unwrap_err();
    assert_eq!(refused.code(), codes::LEASE_NOT_HELD);
    let refused = call!(desk, LeaseMsg::Release, holder.get_cell(), id + 1000)
        .unwrap()
        .unwrap_err();
    assert_eq!(refused.code(), codes::LEASE_NOT_HELD);
    assert_eq!(sup.stats().active, 1);
    assert_eq!(broker.release_calls(), 0);

    // The holder's release: the broker release is awaited and answered, once.
    call!(desk, LeaseMsg::Release, holder.get_cell(), id)
        .unwrap()
        .unwrap();
    assert_eq!(broker.release_calls(), 1);
    assert_eq!(sup.stats().active, 0);
    let again = call!(desk, LeaseMsg::Release, holder.get_cell(), id)
        .unwrap()
        .unwrap_err();
    assert_eq!(again.code(), codes::LEASE_NOT_HELD);

    // The holder's exit after an explicit release releases nothing more.
    drop(lease);
    holder.stop(None);
    holder_join.await.unwrap();
    other.stop(None);
    other_join.await.unwrap();
    sup.shutdown().await.unwrap();
    assert_eq!(broker.release_calls(), 1);
    broker.assert_quiescent(sup.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requester_that_exits_before_its_grant_withdraws_and_nothing_leaks() {
    let (sup, broker) = logged_pool(1, &EventLog::default()).await;
    let desk = sup.lease_desk().await.unwrap();
    let mut lease = sup.acquire().await.unwrap();
    let (holder, holder_join) = Actor::spawn(None, Idle, ()).await.unwrap();
    let ask = {
        let (desk, cell) = (desk.clone(), holder.get_cell());
        tokio::spawn(async move { call!(desk, LeaseMsg::Acquire, cell) })
    };
    until("the request queued", || sup.stats().waiting == 1).await;
    holder.stop(None);
    holder_join.await.unwrap();
    until("the request withdrew", || sup.stats().waiting == 0).await;
    assert!(ask.await.unwrap().is_err(), "nobody answers a gone holder");
    lease.release().await.unwrap();
    sup.shutdown().await.unwrap();
    assert_eq!(broker.acquire_calls(), 1);
    broker.assert_quiescent(sup.stats());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_requesters_cleanup_failure_reaches_the_error_sink() {
    let (sup, mut failures) = common::supervisor_whose_releases_fail().await;
    let desk = sup.lease_desk().await.unwrap();
    let (holder, holder_join) = Actor::spawn(None, Idle, ()).await.unwrap();
    let lease = call!(desk, LeaseMsg::Acquire, holder.get_cell())
        .unwrap()
        .unwrap();
    let token = lease.token();
    drop(lease);
    holder.kill();
    holder_join.await.unwrap();
    let failure = tokio::time::timeout(Duration::from_secs(20), failures.recv())
        .await
        .expect("the failure never reached the sink")
        .unwrap();
    assert_eq!(failure.token, token);
    assert_eq!(failure.error.code(), codes::LEASE_CLEANUP_FAILED);
    sup.shutdown().await.unwrap();
}
