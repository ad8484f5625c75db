//! What the benches share: the runtime every figure is taken on, the timed loop that runs on it,
//! the samples behind each bench's ratio rows and the printer of those rows, test-mode
//! detection, the scratch dir for job temp dirs, and the floors themselves (a raw ractor actor,
//! a tokio mpsc + oneshot echo task, the hand-written equivalents of `Supervisor::run`, and the
//! shape floor: one owner actor that leases slots by message, written by hand, in `owner.rs`).
//!
//! Each bench includes it with `mod floor;` and uses a part of it, hence the `dead_code` allow.
//!
//! Every figure is taken on a worker thread of a 2-worker multi-thread runtime. criterion's
//! `to_async(&rt)` drives the routine with `Runtime::block_on`, whose thread is *not* a worker:
//! an actor reply to it is a cross-thread wake-up (about 10 µs instead of under 1 µs, see
//! BENCHMARKS.md). So [`timed`] spawns the timed loop onto the runtime and returns the time the
//! loop itself measured (`iter_custom`).

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use criterion::BenchmarkGroup;
use criterion::measurement::WallTime;
use leasehold::{JobSpec, Supervisor};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::runtime::Runtime;
use tokio::sync::{Semaphore, mpsc, oneshot};

mod owner;
// Each bench uses a part of this module (as with `dead_code` above).
#[allow(unused_imports)]
pub use owner::{Owner, OwnerCounts};

// ---------------------------------------------------------------------------------------------
// Runtime, timed loops, modes
// ---------------------------------------------------------------------------------------------

/// The runtime every figure is taken on: multi-thread, 2 workers.
pub fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Runs a timed loop on a runtime worker (see the module docs for why) and records its time
/// under `key`, keeping the last `keep` samples.
pub fn timed<F, Fut>(b: &mut criterion::Bencher<'_>, rt: &Runtime, key: &str, keep: usize, make: F)
where
    F: Fn(u64) -> Fut,
    Fut: Future<Output = Duration> + Send + 'static,
{
    b.to_async(rt).iter_custom(|iters| {
        let run = tokio::spawn(make(iters));
        async move {
            let elapsed = run.await.expect("timed loop panicked");
            record(key, keep, iters, elapsed);
            elapsed
        }
    });
}

/// Sets a group's warm-up and measurement times, unless the command line sets them
/// (`-- --warm-up-time 0.2 --measurement-time 1` for a quick look): criterion lets a group's own
/// settings win over its command line, so a group applies only those the command line left.
pub fn times(group: &mut BenchmarkGroup<'_, WallTime>, warm_up: Duration, measurement: Duration) {
    let given =
        |flag: &str| std::env::args().any(|a| a == flag || a.starts_with(&format!("{flag}=")));
    if !given("--warm-up-time") {
        group.warm_up_time(warm_up);
    }
    if !given("--measurement-time") {
        group.measurement_time(measurement);
    }
}

/// criterion's id of a benchmark, `group/function/parameter`: the key of its samples.
pub fn key(group: &str, function: &str, parameter: &str) -> String {
    format!("{group}/{function}/{parameter}")
}

/// `cargo bench -- --test` (CI's smoke run): criterion runs every benchmark once.
pub fn test_mode() -> bool {
    std::env::args().any(|a| a == "--test")
}

/// `cargo bench -- --list`: criterion only lists the benchmarks.
pub fn list_mode() -> bool {
    std::env::args().any(|a| a == "--list")
}

// ---------------------------------------------------------------------------------------------
// Samples, for the ratio rows
// ---------------------------------------------------------------------------------------------

/// Per-iteration times (ns) of the last `keep` routine calls of each benchmark. In benchmark
/// mode criterion calls the routine `sample_size` times after its warm-up, so the last
/// `sample_size` calls are exactly its samples, and their median is criterion's median.
static SAMPLES: Mutex<BTreeMap<String, Series>> = Mutex::new(BTreeMap::new());

struct Series {
    keep: usize,
    ns_per_iter: Vec<f64>,
}

fn record(key: &str, keep: usize, iters: u64, elapsed: Duration) {
    let mut samples = SAMPLES.lock().expect("samples lock");
    let series = samples.entry(key.to_owned()).or_insert_with(|| Series {
        keep,
        ns_per_iter: Vec::new(),
    });
    series
        .ns_per_iter
        .push(elapsed.as_nanos() as f64 / iters.max(1) as f64);
    if series.ns_per_iter.len() > series.keep {
        series.ns_per_iter.remove(0);
    }
}

/// Median per-iteration time (ns) of a benchmark, if it ran.
pub fn median(key: &str) -> Option<f64> {
    let samples = SAMPLES.lock().expect("samples lock");
    let mut v = samples.get(key)?.ns_per_iter.clone();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    Some(if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    })
}

// ---------------------------------------------------------------------------------------------
// The ratio table
// ---------------------------------------------------------------------------------------------

pub fn fmt_ns(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.3} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

/// Prints a bench's ratio table heading; `false` (and nothing printed) under `--list`, where no
/// benchmark ran. `unit` says what one figure is ("per acquire + release", "per lease", ...).
pub fn table_start(title: &str, unit: &str) -> bool {
    if list_mode() {
        return false;
    }
    println!();
    println!("## leasehold {title}: ratio table");
    println!();
    if test_mode() {
        println!("(criterion test mode: every figure below is ONE iteration, not a measurement)");
    } else {
        println!(
            "Medians of the criterion samples taken above ({unit}), leasehold / floor, measured \
             in this run."
        );
    }
    println!();
    println!("| figure | leasehold | floor | ratio (time) | target |");
    println!("|---|---|---|---|---|");
    true
}

/// One ratio row: leasehold's median over the floor's, both divided by `per` (the operations
/// in one iteration, for a per-operation figure; the ratio does not depend on it), with an
/// optional target (`≤ x×` on the time ratio).
pub fn ratio_row(label: &str, leasehold: &str, floor: &str, per: u64, target: Option<f64>) {
    let (Some(a), Some(b)) = (median(leasehold), median(floor)) else {
        println!("| {label} | not run | not run | - | - |");
        return;
    };
    let ratio = a / b;
    let verdict = match target {
        // One iteration says nothing about a target.
        Some(t) if test_mode() => format!("≤ {t:.2}× (not judged in test mode)"),
        Some(t) if ratio <= t => format!("≤ {t:.2}×: met"),
        Some(t) => format!("≤ {t:.2}×: MISSED"),
        None => "- (context)".to_owned(),
    };
    let per = per.max(1) as f64;
    println!(
        "| {label} | {} | {} | {ratio:.2}× | {verdict} |",
        fmt_ns(a / per),
        fmt_ns(b / per)
    );
}

/// Closes a table: says where job temp dirs were made, if any were.
pub fn table_end() {
    if let Some(base) = SCRATCH_BASE.get() {
        println!();
        println!("job temp dirs were made under {}", base.display());
    }
    println!();
}

// ---------------------------------------------------------------------------------------------
// Scratch dir, supervisor
// ---------------------------------------------------------------------------------------------

/// The base the job temp dirs live under, once a bench has made its [`scratch_dir`].
static SCRATCH_BASE: OnceLock<PathBuf> = OnceLock::new();

/// A scratch dir for job temp dirs: on tmpfs (`/dev/shm`) when the machine has one, so that the
/// figures are the library's and not the disk's (an ext4 `mkdir` + `rmdir` costs 200–300 µs on
/// the reference VM, which drowns every other cost, for leasehold and the floor alike). Set
/// `LEASEHOLD_BENCH_ROOT` to measure on another file system.
pub fn scratch_dir() -> tempfile::TempDir {
    let make = |base: &Path| {
        tempfile::Builder::new()
            .prefix("leasehold-bench-")
            .tempdir_in(base)
            .ok()
            .map(|dir| (base.to_path_buf(), dir))
    };
    let chosen = std::env::var_os("LEASEHOLD_BENCH_ROOT")
        .map(PathBuf::from)
        .and_then(|base| make(&base))
        .or_else(|| make(Path::new("/dev/shm")))
        .or_else(|| make(&std::env::temp_dir()));
    let (base, dir) = chosen.expect("a writable scratch dir");
    let _ = SCRATCH_BASE.set(base);
    dir
}

/// A supervisor on `slots` local slots; its job temp dirs under `work_root` when given (else
/// under its own temp dir, for benches whose jobs are explicit leases).
pub async fn start_supervisor(slots: u32, work_root: Option<&Path>) -> Supervisor {
    let builder = Supervisor::builder().slots(slots);
    let builder = match work_root {
        Some(root) => builder.work_root(root),
        None => builder,
    };
    builder.start().await.expect("supervisor starts")
}

/// `n` round trips of an explicit lease: acquire, then release.
pub async fn acquire_release(sup: &Supervisor, n: u64) {
    for _ in 0..n {
        let mut lease = sup.acquire().await.expect("acquire");
        lease.release().await.expect("release");
    }
}

/// One `Supervisor::run` with a no-op body.
pub async fn noop_run(sup: &Supervisor) {
    sup.run(JobSpec::new("b").expect("valid id"), |_ctx| async {
        Ok::<_, io::Error>(())
    })
    .await
    .expect("no-op job succeeds");
}

// ---------------------------------------------------------------------------------------------
// Floors: one raw ractor call, one mpsc + oneshot round trip
// ---------------------------------------------------------------------------------------------

/// The smallest useful ractor actor: answers a ping. One `call` to it is the floor of one
/// answered message to leasehold's supervisor actor.
pub struct PingActor;

pub enum PingMsg {
    Ping(RpcReplyPort<()>),
}

impl Actor for PingActor {
    type Msg = PingMsg;
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<PingMsg>,
        _args: (),
    ) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<PingMsg>,
        msg: PingMsg,
        _state: &mut (),
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            PingMsg::Ping(reply) => {
                let _ = reply.send(());
            }
        }
        Ok(())
    }
}

/// One raw ractor `call` to a [`PingActor`].
pub async fn ping(actor: &ActorRef<PingMsg>) {
    ractor::call!(actor, PingMsg::Ping).expect("ping answers");
}

/// A tokio task that answers every oneshot it is sent: the mpsc + oneshot round-trip floor
/// (kameo's `benches/overhead.rs` compares its request/reply with the same). The task ends when
/// every sender is gone.
pub fn spawn_echo(rt: &Runtime) -> mpsc::UnboundedSender<oneshot::Sender<()>> {
    let (tx, mut rx) = mpsc::unbounded_channel::<oneshot::Sender<()>>();
    rt.spawn(async move {
        while let Some(reply) = rx.recv().await {
            let _ = reply.send(());
        }
    });
    tx
}

/// One round trip to the task of [`spawn_echo`].
pub async fn echo(tx: &mpsc::UnboundedSender<oneshot::Sender<()>>) {
    let (reply, answer) = oneshot::channel();
    tx.send(reply).expect("echo task alive");
    answer.await.expect("echo answers");
}

// ---------------------------------------------------------------------------------------------
// Floors: the hand-written equivalents of `run` with a no-op body
// ---------------------------------------------------------------------------------------------

/// The hand-written equivalent of `run` with a no-op body, without an actor: a permit, a temp
/// dir, the body spawned as a tokio task and joined, the dir removed, the permit given back.
pub async fn hand_written_task_job(sem: &Semaphore, root: &Path) {
    let _permit = sem.acquire().await.expect("semaphore open");
    let dir = tempfile::tempdir_in(root).expect("temp dir");
    tokio::spawn(async { Ok::<_, io::Error>(()) })
        .await
        .expect("body task")
        .expect("body");
    dir.close().expect("temp dir removed");
}

/// The floor of a job that needs no temp dir: a permit, a fresh [`JobWorker`] spawned that runs
/// a no-op body in its `post_start` and stops itself, its `JoinHandle` awaited, the permit
/// given back. Also the floor of a job actor: an actor spawned and joined.
pub async fn hand_written_ractor_noop(sem: &Semaphore) {
    let _permit = sem.acquire().await.expect("semaphore open");
    let body = || async { Ok::<_, io::Error>(()) };
    let (_worker, join) = Actor::spawn(None, JobWorker(PhantomData), body)
        .await
        .expect("worker starts");
    join.await.expect("worker joins");
}

/// What a job that writes one file writes.
pub const FRAME: &[u8] = b"one small frame of output";

/// The floor of a job that writes one file in its temp dir: a permit, a temp dir made, a fresh
/// [`JobWorker`] whose body writes the file, its `JoinHandle` awaited, the dir removed, the
/// permit given back.
pub async fn hand_written_ractor_file(sem: &Semaphore, root: &Path) {
    let _permit = sem.acquire().await.expect("semaphore open");
    let dir = tempfile::tempdir_in(root).expect("temp dir");
    let file = dir.path().join("frame");
    let body = move || async move { std::fs::write(file, FRAME) };
    let (_worker, join) = Actor::spawn(None, JobWorker(PhantomData), body)
        .await
        .expect("worker starts");
    join.await.expect("worker joins");
    dir.close().expect("temp dir removed");
}

/// One `Supervisor::run` whose body writes one file in its temp dir.
pub async fn file_run(sup: &Supervisor) {
    sup.run(JobSpec::new("f").expect("valid id"), |ctx| async move {
        std::fs::write(ctx.temp_dir().join("frame"), FRAME)
    })
    .await
    .expect("the file job succeeds");
}

/// A job actor that stops as soon as it has started.
pub struct NoopActor;

impl Actor for NoopActor {
    type Msg = ();
    type State = ();
    type Arguments = ();

    async fn pre_start(&self, _myself: ActorRef<()>, (): ()) -> Result<(), ActorProcessingErr> {
        Ok(())
    }

    async fn post_start(
        &self,
        myself: ActorRef<()>,
        (): &mut (),
    ) -> Result<(), ActorProcessingErr> {
        myself.stop(None);
        Ok(())
    }
}

/// A no-op job through `submit`, its handle joined.
pub async fn noop_submit(sup: &Supervisor) {
    sup.submit(JobSpec::new("s").expect("valid id"), |_ctx| async {
        Ok::<_, io::Error>(())
    })
    .join()
    .await
    .expect("no-op job succeeds");
}

/// One `Supervisor::spawn_job` of a [`NoopActor`], its outcome joined.
pub async fn noop_spawn_job(sup: &Supervisor) {
    let job = JobSpec::new("a").expect("valid id");
    let (_actor, outcome) = sup
        .spawn_job(job, NoopActor, |_ctx| ())
        .await
        .expect("spawned");
    outcome.join().await.expect("stopped");
}

// ---------------------------------------------------------------------------------------------
// The shape floor (`owner.rs`): a lease by message from one owner actor, by hand
// ---------------------------------------------------------------------------------------------

/// `n` round trips of a lease from the shape floor: acquire, then release (awaited).
pub async fn owner_acquire_release(owner: &Owner, n: u64) {
    for _ in 0..n {
        let slot = owner.acquire().await;
        owner.release(slot).await;
    }
}

/// The shape floor of `run` with a no-op body: a lease from the owner, a fresh [`JobWorker`]
/// that runs the body in its `post_start` and stops itself, joined, the lease released.
pub async fn owner_ractor_noop(owner: &Owner) {
    let slot = owner.acquire().await;
    let body = || async { Ok::<_, io::Error>(()) };
    let (_worker, join) = Actor::spawn(None, JobWorker(PhantomData), body)
        .await
        .expect("worker starts");
    join.await.expect("worker joins");
    owner.release(slot).await;
}

/// A per-job ractor worker: runs the body it was started with in `post_start`, then stops.
pub struct JobWorker<B>(pub PhantomData<fn() -> B>);

impl<B, Fut> Actor for JobWorker<B>
where
    B: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = io::Result<()>> + Send,
{
    type Msg = ();
    type State = Option<B>;
    type Arguments = B;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        body: B,
    ) -> Result<Option<B>, ActorProcessingErr> {
        Ok(Some(body))
    }

    async fn post_start(
        &self,
        myself: ActorRef<()>,
        body: &mut Option<B>,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(body) = body.take() {
            body().await?;
        }
        myself.stop(None);
        Ok(())
    }
}
