//! Child processes are part of a worker's physical lifetime: a job's process group is stopped
//! on cancellation, reaped, and proven empty before its temp dir and slot are touched.
#![cfg(target_os = "linux")]

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{EventLog, Plan, TestBroker};
use leasehold::{CancellationToken, JobSpec, ProcessSpec, Supervisor};
use parking_lot::Mutex;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::oneshot;

/// Watches, on a thread of its own, for the moment the temp dir is gone while one of `pids`
/// still exists (alive or unreaped): the order this issue forbids.
struct OrderWatch {
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<Option<String>>,
}

impl OrderWatch {
    fn start(dir: PathBuf, pids: Vec<i32>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let handle = std::thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                let dir_gone = !dir.exists();
                if dir_gone && let Some(pid) = pids.iter().find(|p| common::proc_exists(**p)) {
                    return Some(format!("temp dir removed while pid {pid} still existed"));
                }
                std::thread::yield_now();
            }
            None
        });
        Self { stop, handle }
    }

    fn finish(self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(violation) = self.handle.join().unwrap() {
            panic!("{violation}");
        }
    }
}

/// A broker that records, at each release, whether any of the watched pids still exists.
fn broker_checking(pids: Arc<Mutex<Vec<i32>>>, log: EventLog) -> TestBroker {
    let broker = TestBroker::new(1);
    broker.on_release(move |_| {
        let left: Vec<_> = pids
            .lock()
            .iter()
            .copied()
            .filter(|p| common::proc_exists(*p))
            .collect();
        log.push(if left.is_empty() {
            "release:all-gone".to_owned()
        } else {
            format!("release:alive {left:?}")
        });
        Plan::Ok
    });
    broker
}

async fn read_pids(stdout: tokio::process::ChildStdout, n: usize) -> Vec<i32> {
    let mut lines = BufReader::new(stdout).lines();
    let mut pids = Vec::new();
    while pids.len() < n {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("the child printed its pids");
        pids.push(line.trim().parse().unwrap());
    }
    pids
}

async fn run_cancelled_group(
    script: &'static str,
    npids: usize,
    sup_grace: Duration,
) -> (Vec<i32>, EventLog, String) {
    let pids: Arc<Mutex<Vec<i32>>> = Arc::default();
    let log = EventLog::default();
    let broker = broker_checking(Arc::clone(&pids), log.clone());
    let sup = Supervisor::builder()
        .broker(broker.clone())
        .process_grace(sup_grace)
        .start()
        .await
        .unwrap();
    let cancel = CancellationToken::new();
    let (started_tx, started_rx) = oneshot::channel();
    let job = {
        let (sup, pids) = (sup.clone(), Arc::clone(&pids));
        let spec = JobSpec::new("group").unwrap().with_cancel(cancel.clone());
        tokio::spawn(async move {
            sup.run(spec, move |ctx| async move {
                let mut child = ctx
                    .spawn_process(
                        ProcessSpec::new("sh")
                            .arg("-c")
                            .arg(script)
                            .stdout(Stdio::piped()),
                    )
                    .unwrap();
                let recorded = read_pids(child.stdout.take().unwrap(), npids).await;
                pids.lock().extend(&recorded);
                started_tx
                    .send((recorded, ctx.temp_dir().to_path_buf()))
                    .unwrap();
                ctx.cancelled().await;
                Err::<(), _>(std::io::Error::from(std::io::ErrorKind::Interrupted))
            })
            .await
        })
    };
    let (recorded, dir) = started_rx.await.unwrap();
    for pid in &recorded {
        assert!(
            common::proc_alive(*pid),
            "pid {pid} should run before the cancellation"
        );
    }
    // The next job waits for the slot and must see every pid gone when it starts.
    let next = {
        let (sup, pids) = (sup.clone(), Arc::clone(&pids));
        tokio::spawn(async move {
            sup.run(JobSpec::new("next").unwrap(), move |_ctx| async move {
                let left: Vec<_> = pids
                    .lock()
                    .iter()
                    .copied()
                    .filter(|p| common::proc_exists(*p))
                    .collect();
                Ok::<_, std::io::Error>(left)
            })
            .await
        })
    };
    let watch = OrderWatch::start(dir.clone(), recorded.clone());
    cancel.cancel();
    let err = job.await.unwrap().unwrap_err();
    let left_at_next = next.await.unwrap().unwrap();
    watch.finish();
    assert!(
        left_at_next.is_empty(),
        "slot granted again while {left_at_next:?} existed"
    );
    assert!(!dir.exists());
    for pid in &recorded {
        assert!(
            !common::proc_exists(*pid),
            "pid {pid} left behind (alive or unreaped)"
        );
    }
    let report = sup.shutdown().await.unwrap();
    broker.assert_quiescent(report.stats);
    (recorded, log, err.code().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_job_has_its_whole_process_group_reaped_before_temp_dir_and_slot_move() {
    let script = "echo $$; sleep 30 & echo $!; sleep 30 & echo $!; wait";
    let (pids, log, code) = run_cancelled_group(script, 3, Duration::from_secs(5)).await;
    assert_eq!(pids.len(), 3);
    assert_eq!(code, "LEASE_BODY_CANCELLED");
    assert_eq!(log.events(), ["release:all-gone", "release:all-gone"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_that_ignores_sigterm_is_killed_after_the_grace_and_the_order_still_holds() {
    // Ignored signals stay ignored across exec: the sleep ignores SIGTERM too.
    let script = "trap '' TERM; echo $$; sleep 30 & echo $!; wait; wait";
    let started = std::time::Instant::now();
    let grace = Duration::from_millis(300);
    let (pids, log, code) = run_cancelled_group(script, 2, grace).await;
    assert_eq!(pids.len(), 2);
    assert!(started.elapsed() >= grace, "SIGKILL came before the grace");
    assert_eq!(code, "LEASE_BODY_CANCELLED");
    assert_eq!(log.events(), ["release:all-gone", "release:all-gone"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_still_writing_into_the_temp_dir_keeps_it_until_the_child_is_gone() {
    let dest = tempfile::tempdir().unwrap();
    let copy = dest.path().join("copy.txt");
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    let script = "i=0; while [ $i -lt 20 ]; do echo $i >> out.txt; sleep 0.01; i=$((i+1)); done; cp out.txt \"$DEST\"";
    let dir = sup
        .run(JobSpec::new("writer").unwrap(), move |ctx| async move {
            // The body does not wait for its child: the slot does.
            let _child = ctx
                .spawn_process(
                    ProcessSpec::new("sh")
                        .arg("-c")
                        .arg(script)
                        .env("DEST", &copy),
                )
                .unwrap();
            Ok::<_, std::io::Error>(ctx.temp_dir().to_path_buf())
        })
        .await
        .unwrap();
    assert!(!dir.exists());
    // The child wrote all its lines into the temp dir and copied them out at its very end.
    let written = std::fs::read_to_string(dest.path().join("copy.txt")).unwrap();
    assert_eq!(written.lines().count(), 20);
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_outside_the_temp_dir_are_refused_and_nothing_runs() {
    let marker_dir = tempfile::tempdir().unwrap();
    let marker = marker_dir.path().join("ran");
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    let marker_in_job = marker.clone();
    let codes = sup
        .run(JobSpec::new("paths").unwrap(), move |ctx| async move {
            let marker = marker_in_job;
            std::os::unix::fs::symlink("/etc", ctx.temp_dir().join("etc-link")).unwrap();
            let mut codes = Vec::new();
            for bad in ["../x", "/etc/passwd", "etc-link/passwd", "a/../../x"] {
                let spec = ProcessSpec::new("touch").arg(&marker).input(bad);
                match ctx.spawn_process(spec) {
                    Err(e) => codes.push(e.code()),
                    Ok(_) => panic!("{bad:?} was accepted"),
                }
                assert_eq!(
                    ctx.path(bad).unwrap_err().code(),
                    "JOB_PATH_REFUSED",
                    "{bad:?}"
                );
            }
            let spec = ProcessSpec::new("touch").arg(&marker).current_dir("../");
            codes.push(ctx.spawn_process(spec).unwrap_err().code());
            // A confined path is accepted and resolves inside the temp dir.
            let inside = ctx.path("out/frame.png").unwrap();
            assert!(inside.starts_with(ctx.temp_dir()));
            Ok::<_, std::io::Error>(codes)
        })
        .await
        .unwrap();
    assert_eq!(codes, ["JOB_PATH_REFUSED"; 5]);
    assert!(!marker.exists(), "a refused process ran");
    sup.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_running_process_groups_and_waits_for_them() {
    let sup = Supervisor::builder().slots(1).start().await.unwrap();
    let (tx, rx) = oneshot::channel();
    let job = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(JobSpec::new("long").unwrap(), move |ctx| async move {
                let mut child = ctx
                    .spawn_process(
                        ProcessSpec::new("sh")
                            .arg("-c")
                            .arg("echo $$; sleep 30 & wait")
                            .stdout(Stdio::piped()),
                    )
                    .unwrap();
                let pid = read_pids(child.stdout.take().unwrap(), 1).await[0];
                tx.send(pid).unwrap();
                let status = child.wait().await.unwrap();
                Ok::<_, std::io::Error>(status.success())
            })
            .await
        })
    };
    let pid = rx.await.unwrap();
    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.cancelled_jobs, 1);
    assert_eq!(report.quarantined, 0);
    assert!(!common::proc_exists(pid));
    // The body saw its child die of the signal.
    let outcome = job.await.unwrap();
    assert!(
        matches!(outcome, Ok(false))
            || outcome
                .as_ref()
                .is_err_and(|e| e.code() == "LEASE_BODY_CANCELLED")
    );
}
