//! A job's temp dir is made on first use: a job that never asks for one costs no directory, a
//! dir made late (by a tracked task) is still removed before the slot returns, a dir that
//! cannot be made reaches the body as a typed error and loses no slot, and a context kept past
//! its job makes nothing.

use std::path::{Path, PathBuf};

use leasehold::{JobSpec, Supervisor, WorkerContext};
use tokio::sync::oneshot;

fn entries(root: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(root)
        .map(|dir| dir.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default()
}

async fn supervisor(root: &Path) -> Supervisor {
    Supervisor::builder()
        .slots(1)
        .work_root(root)
        .start()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_never_asks_for_its_temp_dir_makes_none() {
    let root = tempfile::tempdir().unwrap();
    let sup = supervisor(root.path()).await;
    let work_root = PathBuf::from(sup.work_root());
    let seen = sup
        .run(JobSpec::new("no-dir").unwrap(), {
            let work_root = work_root.clone();
            move |_ctx| async move { Ok::<_, std::io::Error>(entries(&work_root)) }
        })
        .await
        .unwrap();
    assert!(seen.is_empty(), "a directory was made: {seen:?}");
    assert!(entries(&work_root).is_empty());
    assert_eq!(sup.stats().active, 0);
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_temp_dir_exists_from_its_first_use_and_is_gone_when_run_returns() {
    let root = tempfile::tempdir().unwrap();
    let sup = supervisor(root.path()).await;
    let work_root = PathBuf::from(sup.work_root());
    let dir = sup
        .run(JobSpec::new("with-dir").unwrap(), |ctx| async move {
            let dir = ctx.temp_dir().to_path_buf();
            assert!(dir.is_dir());
            assert!(dir.starts_with(ctx.temp_dir().parent().unwrap()));
            // The same dir on every call, from every clone of the context.
            assert_eq!(ctx.clone().temp_dir(), dir);
            assert_eq!(ctx.try_temp_dir().unwrap(), dir);
            std::fs::write(ctx.path("frame").unwrap(), b"x")?;
            Ok::<_, std::io::Error>(dir)
        })
        .await
        .unwrap();
    assert!(dir.starts_with(&work_root));
    assert!(!dir.exists(), "the temp dir outlived the job");
    assert!(entries(&work_root).is_empty());
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_temp_dir_first_made_by_a_tracked_task_after_the_body_is_removed_before_the_slot_returns()
{
    let root = tempfile::tempdir().unwrap();
    let sup = supervisor(root.path()).await;
    let work_root = PathBuf::from(sup.work_root());
    let (go, gate) = oneshot::channel::<()>();
    let (made_tx, made) = oneshot::channel::<PathBuf>();
    let job = tokio::spawn({
        let sup = sup.clone();
        async move {
            sup.run(JobSpec::new("late-dir").unwrap(), |ctx| async move {
                let c = ctx.clone();
                ctx.spawn(async move {
                    gate.await.unwrap();
                    let dir = c.temp_dir().to_path_buf();
                    std::fs::write(dir.join("late"), b"x").unwrap();
                    made_tx.send(dir).unwrap();
                });
                Ok::<_, std::io::Error>(())
            })
            .await
        }
    });
    // The body has ended; its task has not asked for the dir yet.
    assert!(entries(&work_root).is_empty());
    go.send(()).unwrap();
    let dir = made.await.unwrap();
    job.await.unwrap().unwrap();
    assert!(
        !dir.exists(),
        "a dir made by a tracked task outlived the job"
    );
    assert_eq!(sup.stats().active, 0);
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_temp_dir_that_cannot_be_made_reaches_the_body_as_a_typed_error_and_loses_no_slot() {
    let root = tempfile::tempdir().unwrap();
    let sup = supervisor(root.path()).await;
    let work_root = PathBuf::from(sup.work_root());
    // The work root is gone: nothing can be made under it.
    std::fs::remove_dir_all(&work_root).unwrap();
    let (code, path, write) = sup
        .run(JobSpec::new("no-room").unwrap(), |ctx| async move {
            let err = ctx.try_temp_dir().unwrap_err();
            let path = ctx.temp_dir().to_path_buf();
            let write = std::fs::write(path.join("frame"), b"x");
            Ok::<_, std::io::Error>((err.code(), path, write))
        })
        .await
        .unwrap();
    assert_eq!(code, "LEASE_PREPARE_FAILED");
    assert!(path.starts_with(&work_root), "{path:?}");
    assert!(!path.exists());
    assert!(write.is_err(), "the body's first file operation fails");
    let stats = sup.stats();
    assert_eq!((stats.active, stats.quarantined), (0, 0), "{stats:?}");
    assert_eq!(stats.acquired_total, stats.released_total);
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_context_kept_past_its_job_makes_no_temp_dir() {
    let root = tempfile::tempdir().unwrap();
    let sup = supervisor(root.path()).await;
    let work_root = PathBuf::from(sup.work_root());
    let kept: WorkerContext = sup
        .run(JobSpec::new("kept").unwrap(), |ctx| async move {
            Ok::<_, std::io::Error>(ctx)
        })
        .await
        .unwrap();
    let err = kept.try_temp_dir().unwrap_err();
    assert_eq!(err.code(), "LEASE_PREPARE_FAILED");
    assert!(!kept.temp_dir().exists());
    assert!(entries(&work_root).is_empty());
    sup.shutdown().await.unwrap();
}
