//! The worker is linked to the supervisor while its body runs (a supervisor that dies takes it
//! along) and unlinks before it ends, so that the supervisor hears no supervision event for it:
//! the job's driver reports its end, once.

use tokio::sync::oneshot;

use crate::{JobSpec, Supervisor};

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
