//! The shape of a job's path, counted by leasehold itself (`leasehold::Counts`): a no-op `run`
//! is one task (its worker's) and at most four wakes of leasehold's machinery (the supervisor's
//! turn that grants it and spawns its worker, the worker, the supervisor's turn that sees the
//! worker's end and releases, the caller woken with its answer), on a current-thread runtime
//! and on a multi-thread one.
//!
//! The counts are process-wide, so this file holds one test, which runs alone in its binary.

use std::time::Duration;

use leasehold::{Counts, JobSpec, Supervisor};

const JOBS: u64 = 500;

/// Runs `JOBS` no-op jobs one after another (after a warm-up) and returns the counts per job.
async fn per_job(sup: &Supervisor) -> [f64; 4] {
    let run = |i: u64| {
        let sup = sup.clone();
        async move {
            sup.run(JobSpec::new(format!("shape-{i}")).unwrap(), |_ctx| async {
                Ok::<_, std::convert::Infallible>(())
            })
            .await
            .expect("a no-op job")
        }
    };
    for i in 0..20 {
        run(i).await;
    }
    let before = Counts::now();
    for i in 0..JOBS {
        // A lost wake would hang here: it fails instead.
        tokio::time::timeout(Duration::from_secs(30), run(i))
            .await
            .unwrap_or_else(|_| panic!("job {i} never ended"));
    }
    let c = Counts::now().since(before);
    let per = |x: u64| x as f64 / JOBS as f64;
    [per(c.polls), per(c.tasks), per(c.messages), per(c.rings)]
}

async fn start() -> Supervisor {
    Supervisor::builder()
        .slots(8)
        .cleanup_timeout(Duration::from_secs(5))
        .start()
        .await
        .expect("a supervisor")
}

fn check(flavor: &str, [polls, tasks, messages, rings]: [f64; 4]) {
    println!(
        "{flavor}: per no-op job {polls:.2} polls, {tasks:.2} tasks, {messages:.2} messages, {rings:.2} doorbells"
    );
    assert!(
        polls <= 4.0,
        "{flavor}: a no-op job took {polls:.2} wakes of leasehold's machinery (at most 4)"
    );
    assert!(
        polls >= 3.0,
        "{flavor}: {polls:.2} wakes per job: the counter misses some (each job needs the supervisor twice and its worker once)"
    );
    assert_eq!(
        tasks, 1.0,
        "{flavor}: a no-op job spawned {tasks:.2} tasks (its worker's only)"
    );
    assert_eq!(
        messages, 2.0,
        "{flavor}: the request and the worker's end, nothing else"
    );
}

#[test]
fn a_no_op_job_is_one_task_and_at_most_four_wakes() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let counts = rt.block_on(async {
        let sup = start().await;
        let counts = per_job(&sup).await;
        sup.shutdown().await.expect("shutdown");
        counts
    });
    check("current-thread runtime", counts);
    drop(rt);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let counts = rt.block_on(async {
        // Measured from a worker thread of the runtime, as the benches do.
        tokio::spawn(async {
            let sup = start().await;
            let counts = per_job(&sup).await;
            sup.shutdown().await.expect("shutdown");
            counts
        })
        .await
        .expect("the counted loop")
    });
    check("multi-thread runtime", counts);
}
