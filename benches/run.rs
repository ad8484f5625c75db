//! `Supervisor::run` with a no-op body, one job at a time on 8 slots, next to its hand-written
//! equivalents measured in the same run (see `BENCHMARKS.md`). Every side makes its job temp
//! dirs in the same work root, on tmpfs when the machine has one (`floor::scratch_dir`):
//!
//! - `leasehold_run`: `sup.run(JobSpec::new(..)?, |_ctx| async { Ok(()) })`;
//! - `hand_written_ractor_worker` (the target's floor, `run` ≤ 1.5× of it, issue 11): a tokio
//!   `Semaphore` permit, a temp dir, a fresh ractor actor per job that runs the body in its
//!   `post_start` and stops itself, its `JoinHandle` awaited, the dir removed, the permit
//!   dropped: the shape of `run`, without its guarantees;
//! - `hand_written_task` (context): the same with the body spawned as a tokio task and joined
//!   instead of an actor;
//! - `leasehold_spawn_job` (issue 15): `sup.spawn_job(..)` of an actor that stops itself in
//!   `post_start`, its outcome joined: a job actor's whole lifecycle (slot, temp dir, the
//!   worker, the job's watch and the actor spawned and joined, the pipeline), next to `run`'s.
//!
//! criterion ids are `job_lifecycle/<function>/noop_body`. The last "benchmark", `summary`,
//! prints the ratio rows from the samples criterion took above. `-- --test` runs each once.

mod floor;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tokio::sync::Semaphore;

use floor::{key, ratio_row, start_supervisor, table_end, table_start, timed};

const GROUP: &str = "job_lifecycle";
const SAMPLES: usize = 20;
const PARAM: &str = "noop_body";
const SLOTS: u32 = 8;
const LEASEHOLD: &str = "leasehold_run";
const RACTOR_WORKER: &str = "hand_written_ractor_worker";
const TASK: &str = "hand_written_task";
const ACTOR_JOB: &str = "leasehold_spawn_job";

/// A job actor that stops as soon as it has started.
struct NoopActor;

impl ractor::Actor for NoopActor {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ractor::ActorRef<()>,
        (): (),
    ) -> Result<(), ractor::ActorProcessingErr> {
        Ok(())
    }

    async fn post_start(
        &self,
        myself: ractor::ActorRef<()>,
        (): &mut (),
    ) -> Result<(), ractor::ActorProcessingErr> {
        myself.stop(None);
        Ok(())
    }
}
/// `run` with a no-op body ≤ 1.5× the hand-written equivalent with a per-job ractor worker
/// (issue 11, point 6).
const TARGET: f64 = 1.5;

fn job_lifecycle(c: &mut Criterion) {
    let rt = floor::runtime();
    let scratch = floor::scratch_dir();
    let sup = rt.block_on(start_supervisor(SLOTS, Some(scratch.path())));
    // The supervisor's own work root (canonicalized), where its job temp dirs go: the floors
    // make theirs there too.
    let root = Arc::new(PathBuf::from(sup.work_root()));
    let sem = Arc::new(Semaphore::new(SLOTS as usize));

    let mut group = c.benchmark_group(GROUP);
    group
        .sample_size(SAMPLES)
        .throughput(Throughput::Elements(1));
    floor::times(
        &mut group,
        Duration::from_millis(500),
        Duration::from_secs(3),
    );

    let k = key(GROUP, LEASEHOLD, PARAM);
    group.bench_function(BenchmarkId::new(LEASEHOLD, PARAM), |b| {
        timed(b, &rt, &k, SAMPLES, |iters| {
            let sup = sup.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    floor::noop_run(&sup).await;
                }
                start.elapsed()
            }
        });
    });

    let k = key(GROUP, ACTOR_JOB, PARAM);
    group.bench_function(BenchmarkId::new(ACTOR_JOB, PARAM), |b| {
        timed(b, &rt, &k, SAMPLES, |iters| {
            let sup = sup.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let job = leasehold::JobSpec::new("bench-actor").expect("valid id");
                    let (_actor, outcome) = sup
                        .spawn_job(job, NoopActor, |_ctx| ())
                        .await
                        .expect("spawned");
                    outcome.join().await.expect("stopped");
                }
                start.elapsed()
            }
        });
    });

    let k = key(GROUP, RACTOR_WORKER, PARAM);
    group.bench_function(BenchmarkId::new(RACTOR_WORKER, PARAM), |b| {
        timed(b, &rt, &k, SAMPLES, |iters| {
            let (sem, root) = (Arc::clone(&sem), Arc::clone(&root));
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    floor::hand_written_ractor_job(&sem, &root).await;
                }
                start.elapsed()
            }
        });
    });

    let k = key(GROUP, TASK, PARAM);
    group.bench_function(BenchmarkId::new(TASK, PARAM), |b| {
        timed(b, &rt, &k, SAMPLES, |iters| {
            let (sem, root) = (Arc::clone(&sem), Arc::clone(&root));
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    floor::hand_written_task_job(&sem, &root).await;
                }
                start.elapsed()
            }
        });
    });
    group.finish();

    rt.block_on(sup.shutdown()).expect("shutdown");
}

fn summary(_c: &mut Criterion) {
    if !table_start("`run` lifecycle", "per job") {
        return;
    }
    let k = |f: &str| key(GROUP, f, PARAM);
    ratio_row(
        "**`run` no-op / hand-written with a per-job ractor worker** (permit + tempdir + actor spawned and joined + remove)",
        &k(LEASEHOLD),
        &k(RACTOR_WORKER),
        1,
        Some(TARGET),
    );
    ratio_row(
        "`run` no-op / hand-written with a tokio task (permit + tempdir + spawn + join + remove)",
        &k(LEASEHOLD),
        &k(TASK),
        1,
        None,
    );
    ratio_row(
        "`spawn_job` (a job actor that stops in `post_start`) / `run` no-op",
        &k(ACTOR_JOB),
        &k(LEASEHOLD),
        1,
        None,
    );
    ratio_row(
        "`spawn_job` / hand-written with a per-job ractor worker",
        &k(ACTOR_JOB),
        &k(RACTOR_WORKER),
        1,
        None,
    );
    table_end();
}

criterion_group! {
    name = benches;
    config = Criterion::default().without_plots().nresamples(20_000);
    targets = job_lifecycle, summary
}
criterion_main!(benches);
