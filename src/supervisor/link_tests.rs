//! The worker is linked to the supervisor while its body runs (a supervisor that dies takes it
//! along) and unlinks before it ends, so that the supervisor hears no supervision event for it:
//! the supervisor sees its end on its join handle, once. A worker that cannot be spawned is a
//! report too: the job never started. A spawn that does not end on the supervisor's one poll
//! is finished by a task of its own, and the job runs as any other.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio::sync::oneshot;

use super::handle::Supervisor;
use crate::hosts::{Hosts, SpawnHost};
use crate::job::JobSpec;

/// A worker's spawn as a test scripts it.
enum Spawn {
    /// Every spawn fails.
    Refused,
    /// Every spawn yields once in `pre_start`, so it does not end on the supervisor's one poll.
    Yields,
}

impl SpawnHost for Spawn {
    fn starting(&self, _job_id: &str) -> BoxFuture<'static, Result<(), String>> {
        match self {
            Spawn::Refused => Box::pin(async { Err("this worker's spawn is refused".into()) }),
            Spawn::Yields => Box::pin(async {
                tokio::task::yield_now().await;
                Ok(())
            }),
        }
    }
}

async fn supervisor_whose_spawns(spawn: Spawn, slots: u32) -> Supervisor {
    let hosts = Hosts {
        spawns: Some(Arc::new(spawn)),
        ..Hosts::os()
    };
    Supervisor::builder()
        .slots(slots)
        .hosts(hosts)
        .start()
        .await
        .unwrap()
}

fn children(sup: &Supervisor) -> Vec<ractor::ActorCell> {
    sup.inner()
        .inbox
        .actor()
        .expect("the actor is bound")
        .get_cell()
        .get_children()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_is_linked_while_its_body_runs_and_unlinked_once_it_has_ended() {
    let sup = Supervisor::builder().slots(2).start().await.unwrap();
    assert!(children(&sup).is_empty());
    let (started_tx, started) = oneshot::channel::<()>();
    let (finish, gate) = oneshot::channel::<()>();
    let job = tokio::spawn({
        let sup = sup.clone();
        async move {
            sup.run(JobSpec::new("linked").unwrap(), move |_ctx| async move {
                started_tx.send(()).unwrap();
                gate.await.unwrap();
                Ok::<_, std::io::Error>(())
            })
            .await
        }
    });
    started.await.unwrap();
    let running = children(&sup);
    assert_eq!(
        running.len(),
        1,
        "the running worker is the supervisor's child"
    );
    let worker = running[0].clone();
    assert!(worker.try_get_supervisor().is_some());
    finish.send(()).unwrap();
    job.await.unwrap().unwrap();
    assert!(
        children(&sup).is_empty(),
        "the ended worker is no child any more"
    );
    // Unlinked by the worker itself before it ended: ractor had no supervisor to send
    // `ActorStarted` or `ActorTerminated` to.
    assert!(worker.try_get_supervisor().is_none());
    assert_eq!(worker.get_status(), ractor::ActorStatus::Stopped);
    // The supervisor handled no supervision event for it (ractor would have sent two:
    // `ActorStarted` after the worker's `post_start`, and `ActorTerminated`). The job's end
    // reached it as the driver's one report, already in before `run` returned.
    let events = || {
        sup.inner()
            .stats
            .supervision_events
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    // Anything ractor sent would be handled in the actor's next turns: give it some.
    for _ in 0..3 {
        sup.stats();
        let _ = sup.waiters().await;
    }
    assert_eq!(events(), 0);
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_be_spawned_gives_its_slots_back_and_its_caller_hears_why() {
    use std::sync::atomic::{AtomicBool, Ordering};

    let sup = supervisor_whose_spawns(Spawn::Refused, 3).await;
    let ran = Arc::new(AtomicBool::new(false));
    let job = JobSpec::new("refused").unwrap().with_slots(2);
    let run = sup.run(job, {
        let ran = Arc::clone(&ran);
        move |_ctx| async move {
            ran.store(true, Ordering::SeqCst);
            Ok::<_, std::io::Error>(())
        }
    });
    // A guard against a hang (a driver that never reports leaves its caller waiting), not a
    // race: the answer comes in a few turns.
    let err = tokio::time::timeout(std::time::Duration::from_secs(60), run)
        .await
        .expect("the caller hears why")
        .unwrap_err();
    assert_eq!(err.code(), "LEASE_PREPARE_FAILED", "{err}");
    assert!(
        matches!(
            err.prepare_error(),
            Some(crate::error::PrepareError::WorkerSpawn(_))
        ),
        "{err:?}"
    );
    assert!(!ran.load(Ordering::SeqCst), "the body never ran");
    // Both slots are back, counted as slots, by the time the caller heard.
    let stats = sup.stats();
    assert_eq!(stats.held_slots, 0, "{stats:?}");
    assert_eq!(stats.active, 0, "{stats:?}");
    assert_eq!(stats.quarantined, 0, "{stats:?}");
    assert_eq!(stats.acquired_total, stats.released_total, "{stats:?}");
    assert!(sup.leases().is_empty());
    // And they serve the next caller: all three at once.
    let mut lease = sup.acquire_many(3).await.unwrap();
    lease.release().await.unwrap();
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_spawn_that_does_not_end_at_once_is_finished_off_the_mailbox_and_the_job_runs() {
    let sup = supervisor_whose_spawns(Spawn::Yields, 2).await;
    // Several at once, some sharing a batch: each spawn yields in `pre_start`.
    let jobs: Vec<_> = (0..6)
        .map(|i| {
            let sup = sup.clone();
            tokio::spawn(async move {
                let id = format!("yields-{i}");
                sup.run(JobSpec::new(id).unwrap(), move |ctx| async move {
                    let dir = ctx.temp_dir().to_path_buf();
                    std::fs::write(dir.join("f"), b"x")?;
                    Ok::<_, std::io::Error>((i, dir))
                })
                .await
            })
        })
        .collect();
    for (i, job) in jobs.into_iter().enumerate() {
        // A guard against a hang (a spawn whose report is lost), not a race.
        let (n, dir) = tokio::time::timeout(std::time::Duration::from_secs(60), job)
            .await
            .expect("the job ends")
            .unwrap()
            .unwrap();
        assert_eq!(n, i);
        assert!(!dir.exists(), "its temp dir was removed before it answered");
    }
    let stats = sup.stats();
    assert_eq!(stats.held_slots, 0, "{stats:?}");
    assert_eq!(stats.acquired_total, stats.released_total, "{stats:?}");
    assert!(children(&sup).is_empty());
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.quarantined, 0);
}
