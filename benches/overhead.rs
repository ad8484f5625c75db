//! Overhead benchmarks: every leasehold figure sits next to its floor, measured in the same run,
//! so that the report is a ratio (see `BENCHMARKS.md`).
//!
//! Groups (criterion ids are `group/function/parameter`):
//!
//! - `lease_round_trip`: `acquire` + `release` against a tokio `Semaphore`, a tokio
//!   mpsc + oneshot round trip to a task, and a raw ractor `call` (one and two in a row).
//! - `job_lifecycle`: `Supervisor::run` with a no-op body against the hand-written equivalent
//!   (semaphore permit, temp dir, spawn, join, remove the dir).
//! - `contention`: workers × slots, a fixed number of acquire + release per iteration,
//!   leasehold against a tokio `Semaphore`; per-acquire wait percentiles are collected once per
//!   pair, outside criterion's timing.
//! - `flood`: 100 000 concurrent `run` calls on 8 slots against 100 000 hand-written jobs. An
//!   untimed probe with the counting allocator below gives the bytes each waiting job costs, and
//!   asserts no leak: the supervisor's books balance, a second flood leaves nothing more behind
//!   than the first, and the heap is back at its baseline once the supervisor has stopped
//!   (`LEASEHOLD_BENCH_STRICT_RESIDUAL=1` also demands it of a live supervisor).
//! - `etcd` (feature `etcd`): `EtcdBroker` acquire + release, driven directly and through a
//!   supervisor (uncontended, 8 slots), against one bare etcd put, all on a single-member etcd
//!   on loopback that the group starts (data dir on the scratch file system, see
//!   `scratch_dir`). The etcd binary is `$LEASEHOLD_ETCD_BIN` or `etcd` on `PATH`; without one
//!   it prints a loud skip line and measures nothing; with `LEASEHOLD_REQUIRE_ETCD=1` (CI) a
//!   missing binary is a panic.
//! - `summary`: the ratio table, from the very samples criterion measured above.
//!
//! Every figure is taken on a worker thread of a 2-worker multi-thread runtime. criterion's
//! `to_async(&rt)` drives the routine with `Runtime::block_on`, whose thread is *not* a worker:
//! an actor reply to it is a cross-thread wake-up (about 10 µs instead of under 1 µs, NOTES.md).
//! So each routine spawns its timed loop onto the runtime and returns the time the loop itself
//! measured (`iter_custom`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use hdrhistogram::Histogram;
use leasehold::{JobSpec, Lease, Supervisor};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use tokio::runtime::Runtime;
use tokio::sync::{Barrier, Semaphore, SemaphorePermit, mpsc, oneshot};

// ---------------------------------------------------------------------------------------------
// Counting allocator
// ---------------------------------------------------------------------------------------------

/// Counts live heap bytes while [`TRACKING`] is on (the flood group only). Outside that window
/// each allocation pays one relaxed load, so the other groups are not slowed by a contended
/// counter. Counts are signed and relative: a block allocated before the window and freed inside
/// it lowers the count, which is right for "how much did the live heap change since the
/// baseline".
struct CountingAlloc;

static TRACKING: AtomicBool = AtomicBool::new(false);
static CURRENT: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

fn count(delta: isize) {
    // Relaxed: the counters publish no other memory; the flood reads them after joining every
    // task that allocated, so the join's own synchronisation orders the reads.
    if TRACKING.load(Ordering::Relaxed) {
        let now = CURRENT.fetch_add(delta, Ordering::Relaxed) + delta;
        if delta > 0 && now > PEAK.load(Ordering::Relaxed) {
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
    }
}

// SAFETY: every method forwards to `System` unchanged and only adds bookkeeping on atomics,
// which never allocates.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: same contract as ours.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// Live bytes (relative) now.
fn live_bytes() -> isize {
    CURRENT.load(Ordering::Relaxed)
}

/// Starts a tracking window: the peak restarts from the current count.
fn track(on: bool) {
    PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
    TRACKING.store(on, Ordering::Relaxed);
}

// ---------------------------------------------------------------------------------------------
// Samples, for the ratio table
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
fn median(key: &str) -> Option<f64> {
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

fn test_mode() -> bool {
    std::env::args().any(|a| a == "--test")
}

// ---------------------------------------------------------------------------------------------
// Shared helpers
// ---------------------------------------------------------------------------------------------

/// The runtime every figure is taken on: multi-thread, 2 workers.
fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// Runs a timed loop on a runtime worker (see the module docs for why) and records it.
fn timed<F, Fut>(b: &mut criterion::Bencher<'_>, rt: &Runtime, key: &str, keep: usize, make: F)
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

fn key(group: &str, function: &str, parameter: &str) -> String {
    format!("{group}/{function}/{parameter}")
}

/// The base the job temp dirs of `job_lifecycle` and `flood` live under.
static SCRATCH_BASE: OnceLock<PathBuf> = OnceLock::new();

/// A scratch dir for job temp dirs: on tmpfs (`/dev/shm`) when the machine has one, so that the
/// figures are the library's and not the disk's (an ext4 `mkdir` + `rmdir` costs 200–300 µs on
/// the reference VM, which drowns every other cost, for leasehold and the floor alike). Set
/// `LEASEHOLD_BENCH_ROOT` to measure on another file system.
fn scratch_dir() -> tempfile::TempDir {
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

async fn start_supervisor(slots: u32, work_root: Option<&Path>) -> Supervisor {
    let builder = Supervisor::builder().slots(slots);
    let builder = match work_root {
        Some(root) => builder.work_root(root),
        None => builder,
    };
    builder.start().await.expect("supervisor starts")
}

async fn noop_run(sup: &Supervisor) {
    sup.run(JobSpec::new("b").expect("valid id"), |_ctx| async {
        Ok::<_, io::Error>(())
    })
    .await
    .expect("no-op job succeeds");
}

/// The hand-written equivalent of `run` with a no-op body: permit, temp dir, spawn, join,
/// remove the dir, give the permit back.
async fn hand_written_job(sem: &Semaphore, root: &Path) {
    let _permit = sem.acquire().await.expect("semaphore open");
    let dir = tempfile::tempdir_in(root).expect("temp dir");
    tokio::spawn(async { Ok::<_, io::Error>(()) })
        .await
        .expect("body task")
        .expect("body");
    dir.close().expect("temp dir removed");
}

// ---------------------------------------------------------------------------------------------
// 1. lease_round_trip
// ---------------------------------------------------------------------------------------------

/// The smallest useful ractor actor: answers a ping.
struct PingActor;

enum PingMsg {
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

const ROUND_TRIP: &str = "lease_round_trip";
const ROUND_TRIP_SAMPLES: usize = 30;

fn lease_round_trip(c: &mut Criterion) {
    let rt = runtime();
    let sup = rt.block_on(start_supervisor(8, None));
    let sem = Arc::new(Semaphore::new(8));
    let (ping, ping_join) = rt
        .block_on(Actor::spawn(None, PingActor, ()))
        .expect("ping actor starts");
    let (req_tx, mut req_rx) = mpsc::unbounded_channel::<oneshot::Sender<()>>();
    rt.spawn(async move {
        while let Some(reply) = req_rx.recv().await {
            let _ = reply.send(());
        }
    });

    let mut group = c.benchmark_group(ROUND_TRIP);
    group
        .sample_size(ROUND_TRIP_SAMPLES)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Elements(1));
    let p = "slots=8";

    let k = key(ROUND_TRIP, "leasehold", p);
    group.bench_function(BenchmarkId::new("leasehold", p), |b| {
        timed(b, &rt, &k, ROUND_TRIP_SAMPLES, |iters| {
            let sup = sup.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let mut lease: Lease = sup.acquire().await.expect("acquire");
                    lease.release().await.expect("release");
                }
                start.elapsed()
            }
        });
    });

    let k = key(ROUND_TRIP, "tokio_semaphore", p);
    group.bench_function(BenchmarkId::new("tokio_semaphore", p), |b| {
        timed(b, &rt, &k, ROUND_TRIP_SAMPLES, |iters| {
            let sem = Arc::clone(&sem);
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let permit: SemaphorePermit<'_> = sem.acquire().await.expect("semaphore open");
                    drop(permit);
                }
                start.elapsed()
            }
        });
    });

    let k = key(ROUND_TRIP, "mpsc_oneshot", p);
    group.bench_function(BenchmarkId::new("mpsc_oneshot", p), |b| {
        timed(b, &rt, &k, ROUND_TRIP_SAMPLES, |iters| {
            let tx = req_tx.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let (reply, answer) = oneshot::channel();
                    tx.send(reply).expect("echo task alive");
                    answer.await.expect("echo answers");
                }
                start.elapsed()
            }
        });
    });

    let k = key(ROUND_TRIP, "ractor_call", p);
    group.bench_function(BenchmarkId::new("ractor_call", p), |b| {
        timed(b, &rt, &k, ROUND_TRIP_SAMPLES, |iters| {
            let ping = ping.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    ractor::call!(ping, PingMsg::Ping).expect("ping answers");
                }
                start.elapsed()
            }
        });
    });

    // Context, not a target: acquire + release is two messages to the actor, each answered.
    let k = key(ROUND_TRIP, "ractor_call_x2", p);
    group.bench_function(BenchmarkId::new("ractor_call_x2", p), |b| {
        timed(b, &rt, &k, ROUND_TRIP_SAMPLES, |iters| {
            let ping = ping.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    ractor::call!(ping, PingMsg::Ping).expect("ping answers");
                    ractor::call!(ping, PingMsg::Ping).expect("ping answers");
                }
                start.elapsed()
            }
        });
    });
    group.finish();

    rt.block_on(async {
        sup.shutdown().await.expect("shutdown");
        ping.stop(None);
        ping_join.await.expect("ping actor joins");
    });
}

// ---------------------------------------------------------------------------------------------
// 2. job_lifecycle
// ---------------------------------------------------------------------------------------------

const LIFECYCLE: &str = "job_lifecycle";
const LIFECYCLE_SAMPLES: usize = 20;

fn job_lifecycle(c: &mut Criterion) {
    let rt = runtime();
    let scratch = scratch_dir();
    let sup_root = scratch.path().join("leasehold");
    let hand_root = Arc::new(scratch.path().join("hand"));
    std::fs::create_dir_all(&*hand_root).expect("hand-written root");
    let sup = rt.block_on(start_supervisor(8, Some(&sup_root)));
    let sem = Arc::new(Semaphore::new(8));

    let mut group = c.benchmark_group(LIFECYCLE);
    group
        .sample_size(LIFECYCLE_SAMPLES)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Elements(1));
    let p = "noop_body";

    let k = key(LIFECYCLE, "leasehold_run", p);
    group.bench_function(BenchmarkId::new("leasehold_run", p), |b| {
        timed(b, &rt, &k, LIFECYCLE_SAMPLES, |iters| {
            let sup = sup.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    noop_run(&sup).await;
                }
                start.elapsed()
            }
        });
    });

    let k = key(LIFECYCLE, "hand_written", p);
    group.bench_function(BenchmarkId::new("hand_written", p), |b| {
        timed(b, &rt, &k, LIFECYCLE_SAMPLES, |iters| {
            let sem = Arc::clone(&sem);
            let root = Arc::clone(&hand_root);
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    hand_written_job(&sem, &root).await;
                }
                start.elapsed()
            }
        });
    });
    group.finish();

    rt.block_on(sup.shutdown()).expect("shutdown");
}

// ---------------------------------------------------------------------------------------------
// 3. contention
// ---------------------------------------------------------------------------------------------

const CONTENTION: &str = "contention";
const CONTENTION_SAMPLES: usize = 10;
const WORKERS: [usize; 3] = [8, 64, 1024];
const SLOTS: [u32; 3] = [1, 8, 32];
/// acquire + release operations per iteration, split evenly over the workers.
const TOTAL_OPS: u64 = 8192;

/// A pool of slots as the contention workload sees it.
trait Pool: Clone + Send + Sync + 'static {
    type Guard<'a>: Send
    where
        Self: 'a;
    fn take(&self) -> impl Future<Output = Self::Guard<'_>> + Send;
    fn give<'a>(guard: Self::Guard<'a>) -> impl Future<Output = ()> + Send + 'a;
}

impl Pool for Supervisor {
    type Guard<'a> = Lease;

    async fn take(&self) -> Lease {
        self.acquire().await.expect("acquire")
    }

    async fn give<'a>(mut lease: Self::Guard<'a>) {
        lease.release().await.expect("release");
    }
}

impl Pool for Arc<Semaphore> {
    type Guard<'a> = SemaphorePermit<'a>;

    async fn take(&self) -> SemaphorePermit<'_> {
        self.acquire().await.expect("semaphore open")
    }

    fn give<'a>(permit: Self::Guard<'a>) -> impl Future<Output = ()> + Send + 'a {
        drop(permit);
        std::future::ready(())
    }
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds")
}

async fn worker_loop<P: Pool>(
    pool: P,
    ops: u64,
    mut latency: Option<Histogram<u64>>,
) -> Option<Histogram<u64>> {
    match latency.as_mut() {
        None => {
            for _ in 0..ops {
                let guard = pool.take().await;
                P::give(guard).await;
            }
        }
        Some(hist) => {
            for _ in 0..ops {
                let asked = Instant::now();
                let guard = pool.take().await;
                hist.saturating_record(asked.elapsed().as_nanos() as u64);
                P::give(guard).await;
            }
        }
    }
    latency
}

/// `workers` tasks do `TOTAL_OPS` acquire + release between them. The clock starts when every
/// worker is spawned and released through a barrier, and stops when the last has been joined.
async fn contend<P: Pool>(
    pool: &P,
    workers: usize,
    latency: bool,
) -> (Duration, Option<Histogram<u64>>) {
    let per_worker = TOTAL_OPS / workers as u64;
    let barrier = Arc::new(Barrier::new(workers + 1));
    let handles: Vec<_> = (0..workers)
        .map(|_| {
            let pool = pool.clone();
            let barrier = Arc::clone(&barrier);
            let hist = latency.then(new_histogram);
            tokio::spawn(async move {
                barrier.wait().await;
                worker_loop(pool, per_worker, hist).await
            })
        })
        .collect();
    barrier.wait().await;
    let start = Instant::now();
    let mut outcomes = Vec::with_capacity(workers);
    for handle in handles {
        outcomes.push(handle.await.expect("worker panicked"));
    }
    let elapsed = start.elapsed();
    let merged = latency.then(|| {
        let mut all = new_histogram();
        for h in outcomes.into_iter().flatten() {
            all.add(h).expect("same bounds");
        }
        all
    });
    (elapsed, merged)
}

/// Wait percentiles (ns) of one contention pair, collected outside criterion's timing.
struct LatencyRow {
    workers: usize,
    slots: u32,
    leasehold: [u64; 3],
    semaphore: [u64; 3],
}

static LATENCY: Mutex<Vec<LatencyRow>> = Mutex::new(Vec::new());

fn percentiles(h: &Histogram<u64>) -> [u64; 3] {
    [
        h.value_at_quantile(0.50),
        h.value_at_quantile(0.99),
        h.value_at_quantile(0.999),
    ]
}

fn contention(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group(CONTENTION);
    group
        .sample_size(CONTENTION_SAMPLES)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .throughput(Throughput::Elements(TOTAL_OPS));

    for workers in WORKERS {
        for slots in SLOTS {
            let sup = rt.block_on(start_supervisor(slots, None));
            let sem = Arc::new(Semaphore::new(slots as usize));
            let p = format!("workers={workers},slots={slots}");
            // Percentiles once per pair, on the first call (so that a filter that skips this
            // pair skips them too), untimed.
            let mut latency_done = false;

            let k = key(CONTENTION, "leasehold", &p);
            group.bench_function(BenchmarkId::new("leasehold", &p), |b| {
                if !latency_done {
                    latency_done = true;
                    let (sup, sem) = (sup.clone(), Arc::clone(&sem));
                    let (l, s) = rt.block_on(async move {
                        tokio::spawn(async move {
                            let (_, l) = contend(&sup, workers, true).await;
                            let (_, s) = contend(&sem, workers, true).await;
                            (l.expect("histogram"), s.expect("histogram"))
                        })
                        .await
                        .expect("latency pass")
                    });
                    LATENCY.lock().expect("latency lock").push(LatencyRow {
                        workers,
                        slots,
                        leasehold: percentiles(&l),
                        semaphore: percentiles(&s),
                    });
                }
                timed(b, &rt, &k, CONTENTION_SAMPLES, |iters| {
                    let sup = sup.clone();
                    async move {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            total += contend(&sup, workers, false).await.0;
                        }
                        total
                    }
                });
            });

            let k = key(CONTENTION, "tokio_semaphore", &p);
            group.bench_function(BenchmarkId::new("tokio_semaphore", &p), |b| {
                timed(b, &rt, &k, CONTENTION_SAMPLES, |iters| {
                    let sem = Arc::clone(&sem);
                    async move {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            total += contend(&sem, workers, false).await.0;
                        }
                        total
                    }
                });
            });

            rt.block_on(sup.shutdown()).expect("shutdown");
        }
    }
    group.finish();
}

// ---------------------------------------------------------------------------------------------
// 4. flood
// ---------------------------------------------------------------------------------------------

const FLOOD: &str = "flood";
const FLOOD_SAMPLES: usize = 10;
const FLOOD_JOBS: usize = 100_000;
const FLOOD_SLOTS: u32 = 8;
/// What may stay allocated without counting as growth: runtime and allocator bookkeeping that
/// does not scale with the number of jobs (blocking-pool threads, timer wheels, channel
/// blocks). A leak of even 8 bytes per job would be 800 KB.
const FLOOD_RESIDUAL_SLACK: isize = 256 * 1024;
/// Set to 1 to also require that a *live* supervisor's heap is back near its pre-flood baseline
/// after the drain (today it keeps the capacity of its waiter maps; see BENCHMARKS.md).
const STRICT_RESIDUAL_ENV: &str = "LEASEHOLD_BENCH_STRICT_RESIDUAL";

/// Times of one flood.
#[derive(Clone, Copy, Default)]
struct FloodRun {
    /// Spawning every caller until every one is queued behind the held slots.
    queue: Duration,
    /// From letting the slots go until the last job has returned.
    drain: Duration,
    total: Duration,
}

/// Live heap over the baseline taken at the start of one flood (meaningful only while the
/// counting allocator is tracking).
#[derive(Clone, Copy, Default)]
struct FloodBytes {
    /// With every job queued.
    queued: isize,
    /// The highest point.
    peak: isize,
    /// After the drain: every caller joined, the supervisor (if any) still alive.
    residual: isize,
}

/// The untimed memory probe's figures.
#[derive(Clone, Copy)]
struct FloodMemory {
    /// `size_of_val` of one caller's future (what each spawned task stores inline).
    caller_future: usize,
    run: FloodRun,
    bytes: FloodBytes,
    /// Leasehold only: what a second flood on the same supervisor left over the first.
    growth_second_flood: Option<isize>,
    /// Leasehold only: live heap after the supervisor shut down, over the first baseline.
    after_shutdown: Option<isize>,
}

static FLOOD_MEMORY: Mutex<BTreeMap<&'static str, FloodMemory>> = Mutex::new(BTreeMap::new());

/// Restarts the peak at the current count and returns that count.
fn baseline() -> isize {
    let now = live_bytes();
    PEAK.store(now, Ordering::Relaxed);
    now
}

/// Waits (sleeping briefly, bounded) until `ready` holds.
async fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ready() {
        assert!(
            Instant::now() < deadline,
            "flood: timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

/// `run` answers before the actor publishes its stats for that message: waits until they show
/// an idle supervisor.
async fn settle(sup: &Supervisor) {
    let idle = || {
        let s = sup.stats();
        s.active == 0
            && s.waiting == 0
            && s.acquired_total == s.released_total + s.release_failed_total
    };
    wait_until("the stats settle", idle).await;
}

async fn leasehold_caller(sup: Supervisor) {
    noop_run(&sup).await;
}

async fn hand_written_caller(sem: Arc<Semaphore>, root: Arc<PathBuf>, asking: Arc<AtomicUsize>) {
    asking.fetch_add(1, Ordering::Relaxed);
    hand_written_job(&sem, &root).await;
}

/// 100 000 `run` calls queue behind the supervisor's slots, held as explicit leases so that
/// every job is provably waiting when the memory is read; then the slots go and the flood
/// drains. Asserts that nothing leaked in the supervisor's books.
async fn flood_leasehold(sup: &Supervisor) -> (FloodRun, FloodBytes) {
    settle(sup).await;
    let before = sup.stats();
    let mut gates = Vec::with_capacity(FLOOD_SLOTS as usize);
    for _ in 0..FLOOD_SLOTS {
        gates.push(sup.acquire().await.expect("gate acquire"));
    }
    let mut callers = Vec::with_capacity(FLOOD_JOBS);
    let base = baseline();
    let start = Instant::now();
    for _ in 0..FLOOD_JOBS {
        callers.push(tokio::spawn(leasehold_caller(sup.clone())));
    }
    wait_until("every job is queued", || sup.stats().waiting == FLOOD_JOBS).await;
    let queue = start.elapsed();
    let queued = live_bytes() - base;
    let drain_start = Instant::now();
    for gate in &mut gates {
        gate.release().await.expect("gate release");
    }
    for caller in callers.drain(..) {
        caller.await.expect("caller task");
    }
    let drain = drain_start.elapsed();
    let total = start.elapsed();
    settle(sup).await;
    let stats = sup.stats();
    assert_eq!(
        stats.active, 0,
        "flood: no lease may stay active: {stats:?}"
    );
    assert_eq!(stats.waiting, 0, "flood: nobody may still wait: {stats:?}");
    assert_eq!(
        stats.acquired_total, stats.released_total,
        "flood: every grant released: {stats:?}"
    );
    assert_eq!(
        stats.release_failed_total, 0,
        "flood: no release failed: {stats:?}"
    );
    assert_eq!(
        stats.acquired_total - before.acquired_total,
        (FLOOD_JOBS + FLOOD_SLOTS as usize) as u64,
        "flood: one grant per job and per gate: {stats:?}"
    );
    let residual = live_bytes() - base;
    let peak = PEAK.load(Ordering::Relaxed) - base;
    (
        FloodRun {
            queue,
            drain,
            total,
        },
        FloodBytes {
            queued,
            peak,
            residual,
        },
    )
}

/// The same flood, hand-written: 100 000 tasks wait on a semaphore whose permits are held.
async fn flood_hand_written(root: &Arc<PathBuf>) -> (FloodRun, FloodBytes) {
    let sem = Arc::new(Semaphore::new(FLOOD_SLOTS as usize));
    let gates = Arc::clone(&sem)
        .acquire_many_owned(FLOOD_SLOTS)
        .await
        .expect("gate permits");
    let asking = Arc::new(AtomicUsize::new(0));
    let mut callers = Vec::with_capacity(FLOOD_JOBS);
    let base = baseline();
    let start = Instant::now();
    for _ in 0..FLOOD_JOBS {
        let caller = hand_written_caller(Arc::clone(&sem), Arc::clone(root), Arc::clone(&asking));
        callers.push(tokio::spawn(caller));
    }
    wait_until("every job is queued", || {
        asking.load(Ordering::Relaxed) == FLOOD_JOBS
    })
    .await;
    // The counter is bumped in the same poll that queues the acquire; one more tick settles it.
    tokio::time::sleep(Duration::from_millis(1)).await;
    let queue = start.elapsed();
    let queued = live_bytes() - base;
    let drain_start = Instant::now();
    drop(gates);
    for caller in callers.drain(..) {
        caller.await.expect("caller task");
    }
    let drain = drain_start.elapsed();
    let total = start.elapsed();
    let residual = live_bytes() - base;
    let peak = PEAK.load(Ordering::Relaxed) - base;
    (
        FloodRun {
            queue,
            drain,
            total,
        },
        FloodBytes {
            queued,
            peak,
            residual,
        },
    )
}

async fn warm(sup: &Supervisor) {
    // Blocking-pool threads, lazily built statics: one-time allocations not charged to a flood.
    for _ in 0..64 {
        noop_run(sup).await;
    }
}

/// The memory probe, untimed, with the counting allocator on: two floods on one fresh
/// supervisor, then its shutdown.
async fn probe_leasehold(root: PathBuf) -> FloodMemory {
    let sup = start_supervisor(FLOOD_SLOTS, Some(&root)).await;
    warm(&sup).await;
    let caller_future = std::mem::size_of_val(&leasehold_caller(sup.clone()));
    track(true);
    let first_base = live_bytes();
    let (run, bytes) = flood_leasehold(&sup).await;
    let after_first = live_bytes();
    flood_leasehold(&sup).await;
    let growth = live_bytes() - after_first;
    sup.shutdown().await.expect("shutdown");
    drop(sup);
    let after_shutdown = live_bytes() - first_base;
    track(false);
    assert!(
        growth <= FLOOD_RESIDUAL_SLACK,
        "flood: a second flood left {growth} more bytes than the first (slack {FLOOD_RESIDUAL_SLACK}): a leak"
    );
    assert!(
        after_shutdown <= FLOOD_RESIDUAL_SLACK,
        "flood: {after_shutdown} bytes still allocated after the supervisor stopped (slack {FLOOD_RESIDUAL_SLACK})"
    );
    if std::env::var_os(STRICT_RESIDUAL_ENV).is_some_and(|v| v == "1") {
        assert!(
            bytes.residual <= FLOOD_RESIDUAL_SLACK,
            "flood: a live supervisor kept {} bytes after the drain (slack {FLOOD_RESIDUAL_SLACK})",
            bytes.residual
        );
    }
    FloodMemory {
        caller_future,
        run,
        bytes,
        growth_second_flood: Some(growth),
        after_shutdown: Some(after_shutdown),
    }
}

async fn probe_hand_written(root: Arc<PathBuf>) -> FloodMemory {
    let caller_future = std::mem::size_of_val(&hand_written_caller(
        Arc::new(Semaphore::new(1)),
        Arc::clone(&root),
        Arc::new(AtomicUsize::new(0)),
    ));
    track(true);
    let (run, bytes) = flood_hand_written(&root).await;
    track(false);
    assert!(
        bytes.residual <= FLOOD_RESIDUAL_SLACK,
        "flood (hand-written): {} bytes still allocated after the drain",
        bytes.residual
    );
    FloodMemory {
        caller_future,
        run,
        bytes,
        growth_second_flood: None,
        after_shutdown: None,
    }
}

fn flood(c: &mut Criterion) {
    let rt = runtime();
    let scratch = scratch_dir();
    let sup_root = scratch.path().join("leasehold");
    let probe_root = scratch.path().join("probe");
    let hand_root = Arc::new(scratch.path().join("hand"));
    std::fs::create_dir_all(&*hand_root).expect("hand-written root");
    let sup = rt.block_on(start_supervisor(FLOOD_SLOTS, Some(&sup_root)));
    rt.block_on(warm(&sup));

    let mut group = c.benchmark_group(FLOOD);
    // One iteration is one whole flood: flat sampling, the fewest samples criterion allows.
    group
        .sample_size(FLOOD_SAMPLES)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(1))
        .measurement_time(Duration::from_secs(1))
        .throughput(Throughput::Elements(FLOOD_JOBS as u64));
    let p = format!("jobs={FLOOD_JOBS},slots={FLOOD_SLOTS}");

    let k = key(FLOOD, "leasehold_run", &p);
    // The memory probe runs on the first call, untimed (so a filter that skips this benchmark
    // skips it too).
    let mut probed = false;
    group.bench_function(BenchmarkId::new("leasehold_run", &p), |b| {
        if !probed {
            probed = true;
            let root = probe_root.clone();
            let memory = rt.block_on(rt.spawn(probe_leasehold(root))).expect("probe");
            FLOOD_MEMORY
                .lock()
                .expect("flood lock")
                .insert("leasehold_run", memory);
        }
        timed(b, &rt, &k, FLOOD_SAMPLES, |iters| {
            let sup = sup.clone();
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total += flood_leasehold(&sup).await.0.total;
                }
                total
            }
        });
    });

    let k = key(FLOOD, "hand_written", &p);
    let mut probed = false;
    group.bench_function(BenchmarkId::new("hand_written", &p), |b| {
        if !probed {
            probed = true;
            let memory = rt
                .block_on(rt.spawn(probe_hand_written(Arc::clone(&hand_root))))
                .expect("probe");
            FLOOD_MEMORY
                .lock()
                .expect("flood lock")
                .insert("hand_written", memory);
        }
        timed(b, &rt, &k, FLOOD_SAMPLES, |iters| {
            let root = Arc::clone(&hand_root);
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    total += flood_hand_written(&root).await.0.total;
                }
                total
            }
        });
    });
    group.finish();

    rt.block_on(sup.shutdown()).expect("shutdown");
}

// ---------------------------------------------------------------------------------------------
// 5. etcd
// ---------------------------------------------------------------------------------------------

/// The group needs the `etcd` feature (off by default) and an `etcd` binary; without the
/// binary it prints a loud skip line and measures nothing.
#[cfg(feature = "etcd")]
mod etcd_group {
    use super::*;
    use std::fs::File;
    use std::io::{Read, Write};
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::os::unix::fs::PermissionsExt;
    use std::process::{Child, Command, Stdio};
    use std::sync::atomic::AtomicU64;

    use leasehold::{AcquireRequest, EtcdBroker, EtcdConfig, SlotBroker};

    pub(crate) const ETCD: &str = "etcd";
    pub(crate) const ETCD_BARE_PUT: &str = "bare_put";
    pub(crate) const ETCD_BROKER: &str = "etcd_broker";
    pub(crate) const ETCD_SUPERVISOR: &str = "leasehold";
    /// The pool's capacity; every figure is uncontended (one acquire at a time).
    pub(crate) const ETCD_SLOTS: u32 = 8;
    const ETCD_SAMPLES: usize = 20;
    /// The floor's key and value (the value about as long as a leasehold slot record), outside
    /// the pool's prefix.
    const FLOOR_KEY: &str = "bench-floor/put";
    const FLOOR_VALUE: &str = "leasehold/v1 holder lease=0123456789abcdef";
    /// Set to `1` (CI does) to make a missing etcd binary a failure instead of a skip.
    const REQUIRE_ETCD_ENV: &str = "LEASEHOLD_REQUIRE_ETCD";
    /// How long etcd gets to answer `/health` with `"health":"true"`.
    const HEALTH_LIMIT: Duration = Duration::from_secs(30);
    /// Fresh port pairs tried when etcd exits early (a port taken between probe and bind).
    const START_ATTEMPTS: usize = 5;

    /// `$LEASEHOLD_ETCD_BIN`, else `etcd` on `PATH`; `None` (after a loud skip line) when there
    /// is none, a panic when CI requires one.
    fn etcd_binary() -> Option<PathBuf> {
        let executable = |p: &Path| {
            std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        };
        let found = match std::env::var_os("LEASEHOLD_ETCD_BIN").filter(|b| !b.is_empty()) {
            Some(bin) => Some(PathBuf::from(bin)).filter(|b| executable(b)),
            None => std::env::var_os("PATH").and_then(|path| {
                std::env::split_paths(&path)
                    .map(|dir| dir.join("etcd"))
                    .find(|c| executable(c))
            }),
        };
        if found.is_none() {
            if std::env::var(REQUIRE_ETCD_ENV).as_deref() == Ok("1") {
                panic!(
                    "{REQUIRE_ETCD_ENV}=1 but no etcd binary was found (apt-get install etcd-server)"
                );
            }
            eprintln!(
                "\n*** SKIPPED etcd benchmarks: no etcd binary (apt-get install etcd-server) ***\n"
            );
        }
        found
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("bind 127.0.0.1:0")
            .port()
    }

    /// `GET /health` over plain HTTP/1.1: whether etcd says it is healthy.
    fn healthy(port: u16) -> bool {
        let ask = || -> io::Result<String> {
            let timeout = Duration::from_millis(500);
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let mut stream = TcpStream::connect_timeout(&addr, timeout)?;
            stream.set_read_timeout(Some(timeout))?;
            stream.set_write_timeout(Some(timeout))?;
            write!(
                stream,
                "GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
            )?;
            let mut response = String::new();
            stream.read_to_string(&mut response)?;
            Ok(response)
        };
        ask().is_ok_and(|r| r.contains("\"health\":\"true\""))
    }

    /// One single-member etcd on free loopback ports, its data dir on the scratch file system
    /// (tmpfs when there is one, as for the job temp dirs: the figures are round trips and
    /// etcd's own work, not the disk's fsync); killed and reaped on drop.
    pub(crate) struct EtcdServer {
        child: Child,
        endpoint: String,
        dir: tempfile::TempDir,
    }

    impl EtcdServer {
        fn start(bin: &Path) -> Self {
            let mut last = String::new();
            for _ in 0..START_ATTEMPTS {
                let dir = etcd_scratch_dir();
                let (client, peer) = (free_port(), free_port());
                if client == peer {
                    continue;
                }
                let log = File::create(dir.path().join("etcd.log")).expect("etcd log file");
                let log_err = log.try_clone().expect("etcd log file");
                let endpoint = format!("http://127.0.0.1:{client}");
                let peer_url = format!("http://127.0.0.1:{peer}");
                let child = Command::new(bin)
                    .arg("--name")
                    .arg("b")
                    .arg("--data-dir")
                    .arg(dir.path().join("data"))
                    .arg("--listen-client-urls")
                    .arg(&endpoint)
                    .arg("--advertise-client-urls")
                    .arg(&endpoint)
                    .arg("--listen-peer-urls")
                    .arg(&peer_url)
                    .arg("--initial-advertise-peer-urls")
                    .arg(&peer_url)
                    .arg("--initial-cluster")
                    .arg(format!("b={peer_url}"))
                    .stdin(Stdio::null())
                    .stdout(log)
                    .stderr(log_err)
                    .spawn()
                    .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
                let mut server = Self {
                    child,
                    endpoint,
                    dir,
                };
                let deadline = Instant::now() + HEALTH_LIMIT;
                loop {
                    if let Ok(Some(status)) = server.child.try_wait() {
                        last = format!("etcd exited early ({status}):\n{}", server.log_tail());
                        break;
                    }
                    if healthy(client) {
                        return server;
                    }
                    assert!(
                        Instant::now() < deadline,
                        "etcd not healthy within {HEALTH_LIMIT:?} on {}:\n{}",
                        server.endpoint,
                        server.log_tail()
                    );
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            panic!("etcd did not start in {START_ATTEMPTS} attempts; last: {last}");
        }

        fn log_tail(&self) -> String {
            let log = std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            lines[lines.len().saturating_sub(20)..].join("\n")
        }
    }

    impl Drop for EtcdServer {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// The data dir's parent: `LEASEHOLD_BENCH_ROOT`, else `/dev/shm`, else the temp dir.
    fn etcd_scratch_dir() -> tempfile::TempDir {
        std::env::var_os("LEASEHOLD_BENCH_ROOT")
            .map(PathBuf::from)
            .into_iter()
            .chain([PathBuf::from("/dev/shm"), std::env::temp_dir()])
            .find_map(|base| {
                tempfile::Builder::new()
                    .prefix("leasehold-bench-etcd-")
                    .tempdir_in(base)
                    .ok()
            })
            .expect("a writable scratch dir for etcd")
    }

    /// What the group measures against: started on the first benchmark that runs, so that a
    /// filter that skips the whole group starts no etcd.
    struct EtcdBench {
        client: etcd_client::Client,
        broker: Arc<EtcdBroker>,
        next_request: Arc<AtomicU64>,
        sup: Supervisor,
        server: EtcdServer,
    }

    fn start_bench(rt: &Runtime, bin: &Path) -> EtcdBench {
        let server = EtcdServer::start(bin);
        let endpoint = server.endpoint.clone();
        println!(
            "etcd benchmarks on {} at {endpoint}, data dir under {}",
            bin.display(),
            server.dir.path().display()
        );
        let (client, broker, sup) = rt.block_on(async {
            let client = etcd_client::Client::connect([endpoint.as_str()], None)
                .await
                .expect("etcd client connects");
            let config = EtcdConfig::new([endpoint.as_str()], "bench", ETCD_SLOTS);
            // Two brokers on the same pool: one driven directly, one owned by the supervisor.
            let broker = EtcdBroker::connect(config.clone())
                .await
                .expect("broker connects");
            let sup_broker = EtcdBroker::connect(config).await.expect("broker connects");
            let sup = Supervisor::builder()
                .broker(sup_broker)
                .start()
                .await
                .expect("supervisor starts");
            (client, Arc::new(broker), sup)
        });
        EtcdBench {
            client,
            broker,
            next_request: Arc::new(AtomicU64::new(1)),
            sup,
            server,
        }
    }

    /// A bare etcd put against `EtcdBroker` acquire + release (direct and through a supervisor),
    /// all on one loopback etcd. One broker acquire is a lease grant and two transactions (join
    /// the queue and read the pool, claim a slot and read the pool); its release is one revoke.
    pub(crate) fn etcd(c: &mut Criterion) {
        let Some(bin) = etcd_binary() else {
            return;
        };
        let rt = runtime();
        let mut bench: Option<EtcdBench> = None;

        let mut group = c.benchmark_group(ETCD);
        group
            .sample_size(ETCD_SAMPLES)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3))
            .throughput(Throughput::Elements(1));
        let p = format!("slots={ETCD_SLOTS}");

        let k = key(ETCD, ETCD_BARE_PUT, &p);
        group.bench_function(BenchmarkId::new(ETCD_BARE_PUT, &p), |b| {
            let s = bench.get_or_insert_with(|| start_bench(&rt, &bin));
            timed(b, &rt, &k, ETCD_SAMPLES, |iters| {
                let mut client = s.client.clone();
                async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        client
                            .put(FLOOR_KEY, FLOOR_VALUE, None)
                            .await
                            .expect("etcd put");
                    }
                    start.elapsed()
                }
            });
        });

        let k = key(ETCD, ETCD_BROKER, &p);
        group.bench_function(BenchmarkId::new(ETCD_BROKER, &p), |b| {
            let s = bench.get_or_insert_with(|| start_bench(&rt, &bin));
            timed(b, &rt, &k, ETCD_SAMPLES, |iters| {
                let (broker, next) = (Arc::clone(&s.broker), Arc::clone(&s.next_request));
                async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let id = next.fetch_add(1, Ordering::Relaxed);
                        let token = broker
                            .acquire(AcquireRequest::new(id, None))
                            .await
                            .expect("broker acquire");
                        broker.release(token).await.expect("broker release");
                    }
                    start.elapsed()
                }
            });
        });

        let k = key(ETCD, ETCD_SUPERVISOR, &p);
        group.bench_function(BenchmarkId::new(ETCD_SUPERVISOR, &p), |b| {
            let s = bench.get_or_insert_with(|| start_bench(&rt, &bin));
            timed(b, &rt, &k, ETCD_SAMPLES, |iters| {
                let sup = s.sup.clone();
                async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let mut lease: Lease = sup.acquire().await.expect("acquire");
                        lease.release().await.expect("release");
                    }
                    start.elapsed()
                }
            });
        });
        group.finish();

        if let Some(EtcdBench {
            client,
            broker,
            sup,
            server,
            ..
        }) = bench
        {
            rt.block_on(sup.shutdown()).expect("shutdown");
            drop((client, broker, sup));
            // The runtime (and every etcd client task on it) goes before the server does.
            drop(rt);
            drop(server);
        }
    }
}

#[cfg(feature = "etcd")]
use etcd_group::{ETCD, ETCD_BARE_PUT, ETCD_BROKER, ETCD_SLOTS, ETCD_SUPERVISOR, etcd};

#[cfg(not(feature = "etcd"))]
fn etcd(_c: &mut Criterion) {}

// ---------------------------------------------------------------------------------------------
// 6. summary
// ---------------------------------------------------------------------------------------------

fn fmt_ns(ns: f64) -> String {
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

/// One ratio row: leasehold median over floor median, with an optional target (`≤ x` on the
/// time ratio).
fn ratio_row(label: &str, lh: &str, floor: &str, target: Option<f64>) {
    let (Some(a), Some(b)) = (median(lh), median(floor)) else {
        println!("| {label} | not run | not run | - | - |");
        return;
    };
    let ratio = a / b;
    let verdict = match target {
        Some(t) if ratio <= t => format!("≤ {t:.2}×: met"),
        Some(t) => format!("≤ {t:.2}×: MISSED"),
        None => "-".to_owned(),
    };
    println!(
        "| {label} | {} | {} | {ratio:.2}× | {verdict} |",
        fmt_ns(a),
        fmt_ns(b)
    );
}

/// The etcd rows: `EtcdBroker` acquire + release, alone and through a supervisor, over one bare
/// etcd put on the same loopback server.
#[cfg(feature = "etcd")]
fn etcd_rows() {
    let k = |f: &str| key(ETCD, f, &format!("slots={ETCD_SLOTS}"));
    ratio_row(
        "etcd acquire+release (broker) / bare etcd put",
        &k(ETCD_BROKER),
        &k(ETCD_BARE_PUT),
        Some(3.0),
    );
    ratio_row(
        "etcd acquire+release (supervisor) / bare etcd put",
        &k(ETCD_SUPERVISOR),
        &k(ETCD_BARE_PUT),
        Some(3.0),
    );
}

fn summary(_c: &mut Criterion) {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    println!();
    println!("## leasehold overhead: ratio table");
    println!();
    if test_mode() {
        println!("(criterion test mode: every figure below is ONE iteration, not a measurement)");
    } else {
        println!(
            "Medians of the criterion samples taken above (per-iteration time), leasehold / floor."
        );
    }
    println!();
    println!("| figure | leasehold | floor | ratio (time) | target |");
    println!("|---|---|---|---|---|");
    let rt = |f: &str| key(ROUND_TRIP, f, "slots=8");
    ratio_row(
        "lease round trip / tokio Semaphore",
        &rt("leasehold"),
        &rt("tokio_semaphore"),
        None,
    );
    ratio_row(
        "lease round trip / mpsc+oneshot",
        &rt("leasehold"),
        &rt("mpsc_oneshot"),
        None,
    );
    ratio_row(
        "lease round trip / 1 raw ractor call",
        &rt("leasehold"),
        &rt("ractor_call"),
        Some(1.0),
    );
    ratio_row(
        "lease round trip / 2 raw ractor calls",
        &rt("leasehold"),
        &rt("ractor_call_x2"),
        None,
    );
    ratio_row(
        "run lifecycle / hand-written",
        &key(LIFECYCLE, "leasehold_run", "noop_body"),
        &key(LIFECYCLE, "hand_written", "noop_body"),
        Some(1.5),
    );
    for workers in WORKERS {
        for slots in SLOTS {
            let p = format!("workers={workers},slots={slots}");
            // Throughput ≥ 0.8× the semaphore's is time ≤ 1.25×.
            let target = (workers == 64 && slots == 8).then_some(1.25);
            ratio_row(
                &format!("contention {workers} workers / {slots} slots (per {TOTAL_OPS} ops)"),
                &key(CONTENTION, "leasehold", &p),
                &key(CONTENTION, "tokio_semaphore", &p),
                target,
            );
        }
    }
    let fp = format!("jobs={FLOOD_JOBS},slots={FLOOD_SLOTS}");
    ratio_row(
        &format!("flood total time, {FLOOD_JOBS} jobs"),
        &key(FLOOD, "leasehold_run", &fp),
        &key(FLOOD, "hand_written", &fp),
        None,
    );

    #[cfg(feature = "etcd")]
    etcd_rows();

    let latency = LATENCY.lock().expect("latency lock");
    if !latency.is_empty() {
        println!();
        println!("### contention: per-acquire wait (one untimed pass per pair)");
        println!();
        println!(
            "| workers | slots | leasehold p50 / p99 / p99.9 | tokio Semaphore p50 / p99 / p99.9 |"
        );
        println!("|---|---|---|---|");
        for row in latency.iter() {
            let f = |p: [u64; 3]| {
                format!(
                    "{} / {} / {}",
                    fmt_ns(p[0] as f64),
                    fmt_ns(p[1] as f64),
                    fmt_ns(p[2] as f64)
                )
            };
            println!(
                "| {} | {} | {} | {} |",
                row.workers,
                row.slots,
                f(row.leasehold),
                f(row.semaphore)
            );
        }
    }

    let floods = FLOOD_MEMORY.lock().expect("flood lock");
    if !floods.is_empty() {
        println!();
        println!(
            "### flood: {FLOOD_JOBS} concurrent jobs on {FLOOD_SLOTS} slots (untimed memory probe)"
        );
        println!();
        println!(
            "| | queue | drain | caller future | bytes per waiting job | peak per job | residual after drain | 2nd flood growth | after shutdown |"
        );
        println!("|---|---|---|---|---|---|---|---|---|");
        let opt = |v: Option<isize>| v.map_or_else(|| "-".to_owned(), |v| format!("{v} B"));
        for (name, m) in floods.iter() {
            println!(
                "| {name} | {} | {} | {} B | {:.0} B | {:.0} B | {} B | {} | {} |",
                fmt_ns(m.run.queue.as_nanos() as f64),
                fmt_ns(m.run.drain.as_nanos() as f64),
                m.caller_future,
                m.bytes.queued as f64 / FLOOD_JOBS as f64,
                m.bytes.peak as f64 / FLOOD_JOBS as f64,
                m.bytes.residual,
                opt(m.growth_second_flood),
                opt(m.after_shutdown),
            );
        }
        if let (Some(l), Some(h)) = (floods.get("leasehold_run"), floods.get("hand_written")) {
            let per = |m: &FloodMemory| m.bytes.queued as f64 / FLOOD_JOBS as f64;
            let verdict = if per(l) <= 1024.0 { "met" } else { "MISSED" };
            // A spawned task stores its future inline; what the hand-written task costs beyond its
            // future is the runtime's per-task overhead, the same for both.
            let task_overhead = per(h) - h.caller_future as f64;
            let supervisor_side = per(l) - l.caller_future as f64 - task_overhead;
            println!();
            println!(
                "flood memory: {:.0} B per waiting job (hand-written {:.0} B, {:.2}×); target ≤ 1 KiB: {verdict}",
                per(l),
                per(h),
                per(l) / per(h)
            );
            println!(
                "  of which: caller future {} B, tokio task overhead ≈ {task_overhead:.0} B, supervisor side ≈ {supervisor_side:.0} B",
                l.caller_future
            );
            let residual_verdict = if l.bytes.residual <= FLOOD_RESIDUAL_SLACK {
                "met"
            } else {
                "MISSED"
            };
            println!(
                "flood residual with the supervisor alive: {} B ({:.0} B per job of the flood); target: back near baseline: {residual_verdict}",
                l.bytes.residual,
                l.bytes.residual as f64 / FLOOD_JOBS as f64
            );
        }
    }
    if let Some(base) = SCRATCH_BASE.get() {
        println!();
        println!("job temp dirs were made under {}", base.display());
    }
    println!();
}

criterion_group! {
    name = benches;
    config = Criterion::default().without_plots().nresamples(20_000);
    targets = lease_round_trip, job_lifecycle, contention, flood, etcd, summary
}
criterion_main!(benches);
